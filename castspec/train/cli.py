"""`castspec make-data`, `castspec train-drafter`, `castspec eval-drafter`."""
from __future__ import annotations

import json
from pathlib import Path


def _writable_dir(path: str) -> Path:
    from ..cli import UserError

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output directory {p} is not writable ({e.strerror})") from None
    return p


def cmd_make_data(args) -> int:
    import torch

    from ..engine import DTYPES
    from ..models.load import load_target
    from ..prompts import training_prompts
    from .datagen import DataGenConfig, generate_dataset

    out = _writable_dir(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = DataGenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                        temperature=args.temperature, seed=args.seed, dtype=args.dtype)
    loaded = load_target(args.target, dtype=DTYPES[args.dtype])
    if loaded.tokenizer is None:
        from ..cli import UserError

        raise UserError(f"target {loaded.source} has no tokenizer: make-data needs one to apply the chat template")
    stop = set(loaded.model.cfg.eos_token_ids) | {loaded.tokenizer.eos_token_id}
    prompts = training_prompts(seed=args.seed)
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    summary = generate_dataset(loaded.model, loaded.tokenizer, prompts, out, cfg, stop, args.limit_tokens)
    print(json.dumps(summary))
    return 0


def register(sub) -> None:
    p = sub.add_parser("make-data", help="generate drafter training data with the target (resumable)",
                       description="Prompts from offline sources -> the target's own responses, sharded.")
    p.add_argument("--out", required=True, help="dataset directory (rerun to resume)")
    p.add_argument("--target", default=None, help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="generate in the dtype you will decode in (default bf16)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--limit-tokens", type=int, default=None, help="stop once this many response tokens exist")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.set_defaults(func=cmd_make_data)
