"""`castspec make-data`, `train-drafter`, `draft-vocab`, `diagnose-drafter`, `eval-drafter`."""
from __future__ import annotations

import json
import os
from pathlib import Path


def _writable_dir(path: str) -> Path:
    from .common import UserError

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"  # one per process: torchrun's ranks probe the same directory
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output directory {p} is not writable ({e.strerror})") from None
    return p


def cmd_make_data(args) -> int:
    import torch

    from ..engine import DTYPES
    from ..models.load import load_target

    _part(args.part)  # a bad --part should not cost a model load
    args.out_data = _writable_dir(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    if loaded.tokenizer is None:
        from .common import UserError

        raise UserError(f"target {loaded.source} has no tokenizer: make-data needs one to apply the chat template")
    print(json.dumps(_make_data(args, loaded)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("make-data", help="generate drafter training data with the target (resumable)",
                       description="Prompts from offline sources -> the target's own responses, sharded.")
    p.add_argument("--out", required=True, help="dataset directory (rerun to resume)")
    _add_datagen_args(p)
    p.set_defaults(func=cmd_make_data)

    t = sub.add_parser("train-drafter", help="train a DFlash-layout block drafter for a target (resumable)",
                       description="Train on the target's own responses; rerun the same command to resume.")
    t.add_argument("--data", required=True, help="dataset directory from make-data")
    t.add_argument("--out", required=True, help="run directory: checkpoint.pt and drafter/ (public layout)")
    t.add_argument("--generate", action="store_true", help="run make-data into --data first (resumable)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--seqs-per-step", type=int, default=4)
    t.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--layers", type=int, default=3)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--mask-token-id", type=int, default=16, help="default: <empty_output> of SmolLM2")
    t.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop at this step (checkpointed and exported), keeping the --steps schedule; rerun to go on")
    t.add_argument("--checkpoint-every", type=int, default=100)
    t.add_argument("--export-every", type=int, default=500)
    t.add_argument("--norm-init", choices=("target", "small", "ones"), default="target",
                   help="final norm at start: the target's (default), small (near-flat first logits) or ones")
    t.add_argument("--taps", default="", help="target layers whose outputs feed the drafter, e.g. 1,14,29 "
                   "(default: 3 spread over layers 1..N-3, the public convention)")
    t.add_argument("--fc-init", choices=("plain", "scaled"), default="plain",
                   help="fc at start: isotropic (default) or its columns scaled to the tapped features' sizes")
    t.add_argument("--init-from", default=None, help="warm start from this drafter directory (same shapes)")
    t.add_argument("--init-from-target", action="store_true",
                   help="start the drafter layers from the target's last layers")
    t.add_argument("--context-window", default="", metavar="W:STEP,...",
                   help="curriculum: blocks see only the last W context rows until STEP, e.g. 8:200,64:400 "
                   "(then the whole context, as in decoding); default: whole context from the start")
    t.add_argument("--eval-per-domain", type=int, default=10,
                   help="held-out prompts per domain for the replay R written to OUT/curve.json at each export")
    _add_datagen_args(t)
    t.set_defaults(func=cmd_train_drafter)

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
    v.add_argument("--data", required=True, help="dataset directory from make-data")
    v.add_argument("--size", type=int, default=16384, help="tokens to keep; 0 removes the draft vocabulary")
    v.add_argument("--target", default=None)
    v.set_defaults(func=cmd_draft_vocab)

    e = sub.add_parser("eval-drafter", help="R of chain and cast on the held-out prompts, per domain (JSON)")
    e.add_argument("--drafter", required=True)
    e.add_argument("--target", default=None)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--per-domain", type=int, default=10)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--widths", default="15,31,63")
    e.add_argument("--out", default=None, help="also write the JSON here")
    e.set_defaults(func=cmd_eval_drafter)


def _tap_list(text: str) -> list[int]:
    from .common import UserError

    try:
        return [int(x) for x in text.split(",")] if text.strip() else []
    except ValueError:
        raise UserError(f"--taps must be comma-separated layer numbers, got {text!r}") from None


def cmd_train_drafter(args) -> int:
    from .common import UserError
    from ..train.blocks import parse_window_schedule
    from ..train.distributed import join, leave

    try:
        parse_window_schedule(args.context_window)
    except ValueError as e:
        raise UserError(f"--context-window: {e}") from None
    if args.generate:
        _part(args.part)
    out = _writable_dir(args.out)
    ranks = join()  # under torchrun: this process's rank in the DDP group; else rank 0 of 1
    try:
        return _train_drafter(args, out, ranks)
    finally:
        leave()


def _train_drafter(args, out: Path, ranks) -> int:
    import torch

    from .common import UserError
    from ..engine import DTYPES
    from ..models.load import load_target, rope_parameters_of
    from ..train.datagen import load_records, shard_files
    from ..train.trainer import TrainConfig, TrainError, train

    data = Path(args.data)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    if args.generate:  # every rank generates its share of the batches, then all train on the whole dataset
        args.out_data = data
        _make_data(args, loaded)
        ranks.barrier()
    if not shard_files(data):
        raise UserError(f"no training data in {data}: run `castspec make-data --out {data}` or pass --generate")
    try:
        records = load_records(data)
    except Exception as e:
        raise UserError(f"cannot read training data in {data} ({type(e).__name__})") from None
    cfg = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors,
                      block_size=args.block_size, num_layers=args.layers, lr=args.lr, seed=args.seed,
                      mask_token_id=args.mask_token_id, bf16=args.dtype == "bf16",
                      checkpoint_every=args.checkpoint_every, export_every=args.export_every,
                      norm_init=args.norm_init, init_from=args.init_from, init_from_target=args.init_from_target,
                      fc_init=args.fc_init, tap_layers=_tap_list(args.taps), context_windows=args.context_window)
    from transformers import AutoConfig

    rope = rope_parameters_of(AutoConfig.from_pretrained(loaded.source))
    on_export = None
    if args.eval_per_domain > 0 and loaded.tokenizer is not None and ranks.main:
        on_export = replay_tracker(loaded, data, out, args.eval_per_domain)
    try:
        state = train(loaded.model, records, out, cfg, rope, on_export=on_export, stop_after=args.stop_after)
    except TrainError as e:
        raise UserError(str(e)) from None
    if ranks.main:
        print(json.dumps({"steps": state.step, "epoch": state.epoch, "loss": state.ema_loss,
                          "train_tau": state.ema_accept, "drafter": str(out / "drafter"), "ranks": ranks.world}))
    return 0


def replay_tracker(loaded, data: Path, out: Path, per_domain: int):
    """A hook for train(): at every export, the replay R on held-out prompts goes into out/curve.json."""
    import torch

    from ..models.load import load_drafter
    from ..prompts import heldout_prompts
    from ..train.datagen import batched_generate, encode_chat
    from ..train.replay import replay_r

    cache = data / f"heldout-{per_domain}.pt"
    if cache.exists():
        records = torch.load(cache, weights_only=True)
    else:
        prompts = heldout_prompts(per_domain)
        stop = set(loaded.model.cfg.eos_token_ids) | {loaded.tokenizer.eos_token_id}
        records = []
        for i in range(0, len(prompts), 24):
            chunk = prompts[i:i + 24]
            enc = [encode_chat(loaded.tokenizer, p.text) for p in chunk]
            for p, e, r in zip(chunk, enc, batched_generate(loaded.model, enc, 128, stop)):
                records.append({"prompt_ids": e, "response_ids": r, "domain": p.domain})
        torch.save(records, cache)
    curve_path = out / "curve.json"

    def hook(step: int, drafter_dir: Path) -> None:
        drafter = load_drafter(drafter_dir, loaded.model)
        curve = json.loads(curve_path.read_text()) if curve_path.exists() else []
        curve = [c for c in curve if c["step"] < step] + [{"step": step, "replay_R": replay_r(loaded.model, drafter,
                                                                                              records)}]
        curve_path.write_text(json.dumps(curve, indent=2))

    return hook


def _make_data(args, loaded) -> dict:
    from ..prompts import training_prompts
    from ..train.datagen import DataGenConfig, generate_dataset

    cfg = DataGenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                        temperature=args.temperature, seed=args.seed, dtype=args.dtype)
    stop = set(loaded.model.cfg.eos_token_ids) | {loaded.tokenizer.eos_token_id}
    prompts = training_prompts(seed=args.seed)
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    return generate_dataset(loaded.model, loaded.tokenizer, prompts, Path(args.out_data), cfg, stop,
                            args.limit_tokens, part=_part(args.part))


def _part(text: str | None) -> tuple[int, int]:
    """This worker's share of make-data: --part i/n, or the launcher's rank/world size under torchrun."""
    from .common import UserError
    from ..train.distributed import launched, launcher_part

    if text is None:
        return launcher_part()
    if launched():
        raise UserError("--part and torchrun both split the work: leave --part out under torchrun")
    try:
        i, n = (int(x) for x in text.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise UserError(f"--part must look like 0/2 (this process's index / number of processes), got {text!r}") from None
    return i, n


def _report(report: dict, out: str | None) -> int:
    """Print the JSON report (and write it to `out` when given)."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(text)
    return 0


def cmd_diagnose_drafter(args) -> int:
    import torch

    from .common import UserError
    from ..engine import DTYPES
    from ..models.load import load_drafter, load_target
    from ..train.datagen import load_records, shard_files
    from ..train.diagnose import diagnose

    data = Path(args.data)
    if not shard_files(data):
        raise UserError(f"no training data in {data}: run `castspec make-data --out {data}` first")
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    drafter = load_drafter(Path(args.drafter), loaded.model)
    with torch.inference_mode():
        report = diagnose(loaded.model, drafter, load_records(data), args.test_records)
    return _report(report, args.out)


def cmd_draft_vocab(args) -> int:
    import torch

    from .common import UserError
    from ..models.draft_vocab import coverage, save_draft_vocab, token_counts, top_tokens
    from ..models.load import load_drafter, load_target
    from ..train.datagen import load_records, shard_files

    drafter_dir, data = Path(args.drafter), Path(args.data)
    if not (drafter_dir / "config.json").is_file():
        raise UserError(f"{drafter_dir} is not a drafter directory (no config.json)")
    if not shard_files(data):
        raise UserError(f"no training data in {data}: run `castspec make-data --out {data}` first")
    loaded = load_target(args.target)
    load_drafter(drafter_dir, loaded.model)  # refuse a drafter made for another target before writing anything
    vocab = loaded.model.cfg.vocab_size
    if not 0 <= args.size <= vocab:
        raise UserError(f"--size must be between 1 and the vocabulary size {vocab} (or 0: the whole vocabulary)")
    _writable_dir(str(drafter_dir))
    if args.size == 0 or args.size == vocab:
        save_draft_vocab(drafter_dir, None)
        return _report({"drafter": str(drafter_dir), "draft_vocab": "full"}, None)
    records = load_records(data)
    ids = top_tokens(token_counts(records, vocab), args.size, tuple(loaded.model.cfg.eos_token_ids))
    save_draft_vocab(drafter_dir, ids)
    report = {"drafter": str(drafter_dir), "draft_vocab": len(ids), "train_coverage": coverage(records, ids)}
    held = sorted(data.glob("heldout-*.pt"))
    if held:  # the prompts training never saw: what decoding on new prompts will meet
        report["heldout_coverage"] = coverage(torch.load(held[-1], weights_only=True), ids)
    return _report(report, None)


def cmd_eval_drafter(args) -> int:
    from .. import load
    from ..train.evaluate import evaluate_drafter

    engine = load(target=args.target, drafter=args.drafter, dtype=args.dtype)
    if engine.drafter is None:
        from .common import UserError

        raise UserError("no drafter to evaluate: pass --drafter DIR")
    report = evaluate_drafter(engine, per_domain=args.per_domain, max_new_tokens=args.max_new_tokens,
                              widths=[int(w) for w in args.widths.split(",")])
    return _report(report, args.out)


def _add_datagen_args(p) -> None:
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="the dtype you will decode in (default bf16)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--limit-tokens", type=int, default=None, help="stop once this many response tokens exist")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--part", default=None, help="i/n: generate only every n-th batch, starting at i "
                   "(run n processes on one --out); under torchrun each rank takes its share without it")
