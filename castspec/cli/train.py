"""`castspec make-data` and `castspec train-drafter`: the target's own responses as training data, and a drafter
trained on them (both resumable, both splittable over processes: --part or torchrun)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..engine import DTYPES
from ..models.load import load_drafter, load_target, rope_parameters_of
from ..prompts import PROMPT_FAMILIES, SELF_WRITTEN, SELF_WRITTEN_PER_SEED, follow_ups, heldout_prompts, prompt_family
from ..train.blocks import parse_window_schedule
from ..train.datagen import (PROMPTS_FILE, DataGenConfig, answered_prompts, batched_generate, encode_chat,
    generate_dataset, load_prompts, load_records, save_prompts, self_written_prompts, shard_files)
from ..train.distributed import join, launched, launcher_part, leave
from ..train.replay import replay_r
from ..train.trainer import TrainConfig, TrainError, train
from .common import UserError, int_list, writable_dir


def cmd_make_data(args) -> int:
    _part(args.part)  # a bad --part should not cost a model load
    args.out_data = writable_dir(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    if loaded.tokenizer is None:
        raise UserError(f"target {loaded.source} has no tokenizer: make-data needs one to apply the chat template")
    print(json.dumps(_make_data(args, loaded)))
    return 0


def cmd_train_drafter(args) -> int:
    try:
        parse_window_schedule(args.context_window)
    except ValueError as e:
        raise UserError(f"--context-window: {e}") from None
    int_list("--taps", args.taps)  # bad input should not cost a model load
    if args.generate:
        _part(args.part)
    out = writable_dir(args.out)
    ranks = join()  # under torchrun: this process's rank in the DDP group; else rank 0 of 1
    try:
        return _train_drafter(args, out, ranks)
    finally:
        leave()


def _train_drafter(args, out: Path, ranks) -> int:
    datasets = [Path(d) for d in args.data.split(",") if d.strip()]
    if not datasets:
        raise UserError("--data: give at least one dataset directory")
    data = datasets[0]  # --generate writes here; the held-out replay records are cached here
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    if args.generate:  # every rank generates its share of the batches, then all train on the whole dataset
        args.out_data = data
        _make_data(args, loaded)
        ranks.barrier()
    records = []
    for d in datasets:
        if not shard_files(d):
            raise UserError(f"no training data in {d}: run `castspec make-data --out {d}` or pass --generate")
        try:
            records += load_records(d)
        except Exception as e:
            raise UserError(f"cannot read training data in {d} ({type(e).__name__})") from None
    cfg = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors,
                      block_size=args.block_size, num_layers=args.layers, lr=args.lr, seed=args.seed,
                      mask_token_id=args.mask_token_id, bf16=args.dtype == "bf16",
                      checkpoint_every=args.checkpoint_every, export_every=args.export_every,
                      norm_init=args.norm_init, init_from=args.init_from, init_from_target=args.init_from_target,
                      fc_init=args.fc_init, tap_layers=int_list("--taps", args.taps),
                      context_windows=args.context_window, kl_weight=args.kl_weight, draft_vocab=args.draft_vocab,
                      gamma=args.gamma, short_blocks=args.short_blocks, short_block_rows=args.short_block_rows)
    # deferred, as in castspec.models.load: transformers is slow to import and only model loading needs it
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
    cfg = DataGenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                        temperature=args.temperature, seed=args.seed, dtype=args.dtype, prompts=args.prompts)
    stop = set(loaded.model.cfg.eos_token_ids) | {loaded.tokenizer.eos_token_id}
    prompts = _datagen_prompts(args, loaded, stop)
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    return generate_dataset(loaded.model, loaded.tokenizer, prompts, Path(args.out_data), cfg, stop,
                            args.limit_tokens, part=_part(args.part))


def _datagen_prompts(args, loaded, stop: set[int]) -> list:
    """make-data's prompts: the prompt family --prompts drawn with --seed, or with --follow-up DIR a second turn of
    our own after each answer in that dataset. Self-written prompts are drawn once (--max-prompts draws, or
    SELF_WRITTEN_PER_SEED) and kept in the dataset's PROMPTS_FILE, which reruns read."""
    tokenizer = loaded.tokenizer
    if args.self_lead and (args.follow_up or args.prompts != SELF_WRITTEN):
        raise UserError("--self-lead applies to --prompts self (without --follow-up)")
    if not args.follow_up and args.prompts == SELF_WRITTEN:
        path = Path(args.out_data) / PROMPTS_FILE
        if not path.exists():
            save_prompts(path, self_written_prompts(loaded.model, tokenizer, args.max_prompts or SELF_WRITTEN_PER_SEED,
                                                    args.seed, stop, batch_size=args.batch_size,
                                                    leads=tuple(args.self_lead.split("|"))))
        return load_prompts(path)
    if not args.follow_up:
        return prompt_family(args.prompts, args.seed)
    source = Path(args.follow_up)
    if not shard_files(source):
        raise UserError(f"--follow-up: no make-data dataset in {source}")
    try:
        return follow_ups(answered_prompts(source, tokenizer), args.seed)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"--follow-up: {e}") from None


def _part(text: str | None) -> tuple[int, int]:
    """This worker's share of make-data: --part i/n, or the launcher's rank/world size under torchrun."""
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


def register(sub) -> None:
    p = sub.add_parser("make-data", help="generate drafter training data with the target (resumable)",
                       description="Prompts from offline sources -> the target's own responses, sharded.")
    p.add_argument("--out", required=True, help="dataset directory (rerun to resume)")
    _add_datagen_args(p)
    p.set_defaults(func=cmd_make_data)

    t = sub.add_parser("train-drafter", help="train a DFlash-layout block drafter for a target (resumable)",
                       description="Train on the target's own responses; rerun the same command to resume.")
    t.add_argument("--data", required=True,
                   help="dataset directory from make-data, or several separated by commas (trained on as one)")
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
    t.add_argument("--init-from", default=None,
                   help="warm start from this drafter directory (same shapes; or fewer layers or taps, which grows "
                   "it: the new layers and taps start adding nothing)")
    t.add_argument("--init-from-target", action="store_true",
                   help="start the drafter layers from the target's last layers")
    t.add_argument("--kl-weight", type=float, default=0.0, metavar="A",
                   help="loss = (1 - A) x cross-entropy on the target's tokens + A x KL(target || drafter) over "
                        "the whole vocabulary at each block position (0 = cross-entropy only)")
    t.add_argument("--short-blocks", type=float, default=0.0, metavar="P",
                   help="train this share of the sequences on blocks cut to --short-block-rows rows (root "
                        "included), so that a batched pass may run cut blocks (0: whole blocks only)")
    t.add_argument("--short-block-rows", type=int, default=3, metavar="N")
    t.add_argument("--gamma", type=float, default=7.0,
                   help="block position k's loss weight is exp(-(k-1)/gamma): smaller puts the drafter's capacity "
                        "on the first positions, which decide most rounds when few tokens are accepted")
    t.add_argument("--draft-vocab", default=None, metavar="DIR",
                   help="train on the draft vocabulary of this drafter directory (castspec draft-vocab): the loss "
                        "over its tokens only, as decoding scores them; a cheaper step; the exports carry it")
    t.add_argument("--context-window", default="", metavar="W:STEP,...",
                   help="curriculum: blocks see only the last W context rows until STEP, e.g. 8:200,64:400 "
                   "(then the whole context, as in decoding); default: whole context from the start")
    t.add_argument("--eval-per-domain", type=int, default=10,
                   help="held-out prompts per domain for the replay R written to OUT/curve.json at each export")
    _add_datagen_args(t)
    t.set_defaults(func=cmd_train_drafter)


def _add_datagen_args(p) -> None:
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="the dtype you will decode in (default bf16)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", default="training", choices=(*PROMPT_FAMILIES, SELF_WRITTEN),
                   help="training: every offline source but the held-out split; instructions: role play, "
                        "puzzles, extraction, comparisons, plans, constrained writing (castspec/prompts.py); self: "
                        "chat prompts the target writes itself, kept in OUT/prompts.jsonl")
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--self-lead", default="", help="--prompts self: the first words of the user turns drawn, "
                                                   "'|' between several taken in turn (e.g. 'Write a letter|Draft "
                                                   "an email'); the target writes the rest")
    p.add_argument("--follow-up", default=None, metavar="DIR",
                   help="multi-turn data: the prompts are a second user turn of our own after each of the "
                        "target's answers in DIR (a make-data dataset of first turns)")
    p.add_argument("--limit-tokens", type=int, default=None, help="stop once this many response tokens exist")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--part", default=None, help="i/n: generate only every n-th batch, starting at i "
                   "(run n processes on one --out); under torchrun each rank takes its share without it")
