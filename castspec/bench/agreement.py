"""Greedy agreement of one dtype with another (issue 16 part 6): how far a bf16 continuation follows fp32's.

    python -m castspec.bench.agreement --n 4 --max-new-tokens 96 --out runs/agreement.json
        [--target HF_DIR|GGUF] [--prompts FILE.jsonl] [--dtypes fp32,bf16] [--device cpu] [--same-weights]

Runs greedy `ar` on the first n prompts of each domain (code, math, chat: what `castspec bench` runs, or a
prompts file in its format) with the target loaded in each of the two dtypes, and writes per prompt the first
position where the second dtype's continuation differs from the first's (null when identical), the count of
identical continuations, the reference's top-two logit gap there (how near a tie its choice was) and its nearest
tie anywhere, the dtypes, the native mode (CASTSPEC_NATIVE) and the git commit. `--same-weights` rounds the
reference's weights to the candidate's dtype first, so that only the arithmetic differs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

from .. import env
from ..engine import DTYPES, load
from .harness import NO_THINKING, builtin_prompts, file_prompts

DOMAINS = ["code", "math", "chat"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two continuations differ (one ending early counts), None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def top_two_gaps(result) -> list[float | None]:
    """Per output position, the gap between the two best log-probabilities (= the logits' gap): how near a tie
    the greedy choice was."""
    return [x.top[0][1] - x.top[1][1] if len(x.top) > 1 else None for x in result.logprobs]


def continuations(target, dtype: str, device: str, prompts, max_new: int,
                  weights_in: torch.dtype | None = None) -> list:
    """Greedy `ar` results (with the top two log-probabilities per position); with `weights_in`, every weight is
    first rounded to that dtype (and kept in `dtype`): the reference then runs the candidate's very weights in
    its own arithmetic."""
    engine = load(target=target, drafter=None, device=device, dtype=dtype)
    if weights_in is not None:
        with torch.no_grad():
            for p in engine.target.parameters():
                p.copy_(p.to(weights_in).to(p.dtype))  # in place: fused views and native pointers stay valid
    return [engine.generate(messages=p.messages, input_ids=p.input_ids, method="ar", max_new_tokens=max_new,
                            chat_template_kwargs=NO_THINKING, logprobs=2) for p in prompts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=4, help="prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--target", default=None, help="HF directory or GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--prompts", default=None, help="JSONL prompts file (castspec bench's format)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="reference,candidate")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--same-weights", action="store_true",
                    help="round the reference's weights to the candidate dtype first, so that only the arithmetic "
                         "differs (a checkpoint whose weights are not exact in bf16, such as a dequantized GGUF, "
                         "otherwise also measures rounding the weights)")
    args = ap.parse_args(argv)
    reference, candidate = args.dtypes.split(",")
    prompts = file_prompts(Path(args.prompts), args.n) if args.prompts else builtin_prompts(DOMAINS, args.n)
    weights_in = DTYPES[candidate] if args.same_weights else None
    ref = continuations(args.target, reference, args.device, prompts, args.max_new_tokens, weights_in)
    got = continuations(args.target, candidate, args.device, prompts, args.max_new_tokens)
    rows = []
    for p, a, b in zip(prompts, ref, got):
        at, gaps = first_difference(a.token_ids, b.token_ids), top_two_gaps(a)
        # how near a tie the reference's choice was where the two part
        rows.append({"domain": p.domain, "id": p.id, "tokens": len(b.token_ids), "first_difference": at,
                     "reference_gap_there": gaps[at] if at is not None and at < len(gaps) else None,
                     "reference_min_gap": min((g for g in gaps if g is not None), default=None)})
    identical = sum(r["first_difference"] is None for r in rows)
    report = {"reference": reference, "reference_weights": candidate if args.same_weights else reference,
              "dtype": candidate, "native_mode": env.native_mode(), "commit": git_commit(),
              "target": args.target, "max_new_tokens": args.max_new_tokens, "identical": identical,
              "prompts": len(rows), "per_prompt": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    firsts = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    print(f"{candidate} vs {reference}: {identical}/{len(rows)} continuations identical "
          f"(native {report['native_mode']}); first differences at {sorted(firsts) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
