"""`castspec diagnose-drafter`, `draft-vocab` and `eval-drafter`: look at a trained drafter (accuracy per block
position against n-gram baselines, R in real decoding) and give it a smaller head (a draft vocabulary)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..engine import DTYPES, load
from ..models.draft_vocab import coverage, save_draft_vocab, token_counts, top_tokens
from ..models.load import load_drafter, load_target
from ..prompts import EVAL_SETS
from ..train.datagen import load_records, shard_files
from ..train.diagnose import diagnose
from ..train.evaluate import evaluate_drafter
from .common import UserError, int_list, print_report, writable_dir


def cmd_diagnose_drafter(args) -> int:
    data = Path(args.data)
    if not shard_files(data):
        raise UserError(f"no training data in {data}: run `castspec make-data --out {data}` first")
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    drafter = load_drafter(Path(args.drafter), loaded.model)
    with torch.inference_mode():
        report = diagnose(loaded.model, drafter, load_records(data), args.test_records)
    return print_report(report, args.out)


def cmd_draft_vocab(args) -> int:
    drafter_dir, dirs = Path(args.drafter), [Path(d) for d in args.data.split(",") if d]
    if not (drafter_dir / "config.json").is_file():
        raise UserError(f"{drafter_dir} is not a drafter directory (no config.json)")
    for data in dirs:
        if not shard_files(data):
            raise UserError(f"no training data in {data}: run `castspec make-data --out {data}` first")
    loaded = load_target(args.target)
    # refuse a drafter made for another target before writing anything
    drafter = load_drafter(drafter_dir, loaded.model)
    vocab = loaded.model.cfg.vocab_size
    if not 0 <= args.size <= vocab:
        raise UserError(f"--size must be between 1 and the vocabulary size {vocab} (or 0: the whole vocabulary)")
    writable_dir(drafter_dir)
    if args.size == 0 or args.size == vocab:
        save_draft_vocab(drafter_dir, None)
        return print_report({"drafter": str(drafter_dir), "draft_vocab": "full"})
    records = [r for data in dirs for r in load_records(data)]
    keep = tuple(loaded.model.cfg.eos_token_ids)
    if args.grow:
        if drafter.draft_vocab is None:
            raise UserError(f"--grow: {drafter_dir} has no draft vocabulary to grow")
        if drafter.draft_vocab.numel() > args.size:
            raise UserError(f"--grow: the current draft vocabulary ({drafter.draft_vocab.numel()}) is larger than --size")
        keep += tuple(drafter.draft_vocab.tolist())  # the tokens its head was trained to score stay
    ids = top_tokens(token_counts(records, vocab), args.size, keep)
    save_draft_vocab(drafter_dir, ids)
    report = {"drafter": str(drafter_dir), "draft_vocab": len(ids), "train_coverage": coverage(records, ids)}
    held = sorted(dirs[0].glob("heldout-*.pt"))
    if held:  # the prompts training never saw: what decoding on new prompts will meet
        report["heldout_coverage"] = coverage(torch.load(held[-1], weights_only=True), ids)
    return print_report(report)


def cmd_eval_drafter(args) -> int:
    sets = [x.strip() for x in args.sets.split(",") if x.strip()]
    unknown = [x for x in sets if x not in EVAL_SETS]
    if unknown or not sets:  # before the model load: a typo should not cost one
        raise UserError(f"--sets: unknown prompt set {unknown[0] if unknown else '(none)'!r}; "
                        f"choose from {', '.join(EVAL_SETS)}")
    if not args.temperature >= 0:
        raise UserError(f"--temperature must be 0 or more, not {args.temperature}")
    seeds, widths = int_list("--seeds", args.seeds), int_list("--widths", args.widths)
    engine = load(target=args.target, drafter=args.drafter, dtype=args.dtype)
    if engine.drafter is None:
        raise UserError("no drafter to evaluate: pass --drafter DIR")
    report = evaluate_drafter(engine, per_domain=args.per_domain, max_new_tokens=args.max_new_tokens,
                              widths=widths, sets=sets, temperature=args.temperature, seeds=seeds)
    return print_report(report, args.out)


def register(sub) -> None:
    g = sub.add_parser("diagnose-drafter", help="teacher-forced accuracy per block position vs n-gram baselines",
                       description="On records of a make-data dataset: the drafter's top-1 accuracy at each block "
                                   "position and the top-1 accuracy of unigram/bigram/trigram tables counted on "
                                   "the other records (JSON).")
    g.add_argument("--data", required=True, help="dataset directory from make-data")
    g.add_argument("--drafter", required=True)
    g.add_argument("--target", default=None)
    g.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    g.add_argument("--test-records", type=int, default=200)
    g.add_argument("--out", default=None)
    g.set_defaults(func=cmd_diagnose_drafter)

    v = sub.add_parser("draft-vocab", help="score only the tokens the target writes most (a faster drafter head)",
                       description="Write DRAFTER/draft_vocab.safetensors: the SIZE most frequent tokens of the "
                                   "target's responses in a make-data dataset (plus its stop tokens). The drafter "
                                   "head then reads only those rows of the lm_head; decoding stays exact.")
    v.add_argument("--drafter", required=True, help="drafter directory (public DFlash layout)")
    v.add_argument("--data", required=True, help="dataset directory from make-data, or several separated by commas")
    v.add_argument("--size", type=int, default=16384, help="tokens to keep; 0 removes the draft vocabulary")
    v.add_argument("--grow", action="store_true",
                   help="keep the drafter's current draft vocabulary and add the most frequent other tokens up to "
                        "SIZE (its head was trained on those)")
    v.add_argument("--target", default=None)
    v.set_defaults(func=cmd_draft_vocab)

    e = sub.add_parser("eval-drafter", help="R of chain and cast on the held-out prompts, per domain (JSON)")
    e.add_argument("--drafter", required=True)
    e.add_argument("--target", default=None)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--per-domain", type=int, default=10)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--widths", default="15,31,63")
    e.add_argument("--sets", default="heldout",
                   help=f"comma-separated prompt sets: {', '.join(EVAL_SETS)} (the others are of kinds no training "
                        "prompt has; each reported per domain and relative to the held-out set, overall and domain by domain)")
    e.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; above 0, sampled decoding (each prompt once per --seeds)")
    e.add_argument("--seeds", default="0", help="comma-separated seeds of the sampled runs (with --temperature)")
    e.add_argument("--out", default=None, help="also write the JSON here")
    e.set_defaults(func=cmd_eval_drafter)