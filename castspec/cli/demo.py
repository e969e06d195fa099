"""`castspec demo`: the defaults, two or three prompts, `ar` vs `cast`, and what each one cost."""
from __future__ import annotations

import sys

import torch

from .common import add_model_args, load_engine, parse_width

DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain why the sky is blue in three sentences.",
    "A baker sells 12 loaves a day for 5 days. How many loaves is that? Answer step by step.",
]


def run_demo(engine, max_new_tokens: int = 96, width="auto", out=None, repeats: int = 2) -> list[dict]:
    """Each prompt with every method `repeats` times, the methods in turn (ar, cast, ar, cast, ...), each method's
    faster run reported: a shared machine's speed moves between runs by as much as a method gains on a prompt
    the drafter predicts poorly, and one run of each would report that drift as the speedup."""
    out = out or sys.stdout  # looked up per call: a default bound at import would miss a redirected stdout
    methods = ["ar", "cast"] if engine.drafter is not None else ["ar"]
    print(f"castspec demo: target in {engine.dtype_reason}; methods {', '.join(methods)}", file=out)
    print(f"exactness: {engine.exactness}: {engine.exactness_reason}", file=out)
    if engine.drafter is None:
        print("(no drafter is installed for this target, so only `ar` runs; pass --drafter DIR to compare)",
              file=out)
    # one untimed warm-up so that one-time kernel compilation does not land in the first prompt's numbers
    engine.generate(prompt="Hello", method="ar", max_new_tokens=4)
    rows = []
    for prompt in DEMO_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        results = {}
        for _ in range(max(repeats, 1)):
            for m in methods:
                r = engine.generate(messages=messages, method=m, width=width, max_new_tokens=max_new_tokens)
                if m not in results or r.stats.decode_ms_per_token < results[m].stats.decode_ms_per_token:
                    results[m] = r
        print(f"\n### {prompt}", file=out)
        print(results[methods[-1]].text.strip(), file=out)
        for m, r in results.items():
            s = r.stats
            speed = results["ar"].stats.decode_ms_per_token / max(s.decode_ms_per_token, 1e-9)
            print(f"  {m:>5}: {s.new_tokens:3d} tokens  R={s.mean_accepted:.2f}  "
                  f"{s.decode_ms_per_token:6.1f} ms/token  speedup over ar {speed:.2f}x", file=out)
            rows.append({"prompt": prompt, "method": m, **s.to_dict(), "speedup": speed})
        if "cast" in results:
            check_exact(engine, messages, results["ar"].token_ids, results["cast"].token_ids, out)
    return rows


class ExactnessError(RuntimeError):
    """`cast` and `ar` gave different greedy tokens in fp32, where they must agree token for token."""


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (one ending early counts), or None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two_gap(engine, messages: list[dict], position: int) -> float | None:
    """The gap between the target's two best logits at output `position`, from an `ar` re-run (log-probabilities
    differ from logits by one constant per position, so their gap is the logits' gap)."""
    r = engine.generate(messages=messages, method="ar", max_new_tokens=position + 1, logprobs=2)
    if r.logprobs is None or len(r.logprobs) <= position or len(r.logprobs[position].top) < 2:
        return None  # ar stopped before that position: cast ran past a stop token ar chose
    (_, first), (_, second) = r.logprobs[position].top[:2]
    return first - second


def choice(ids: list[int], pos: int) -> str:
    return f"chose token {ids[pos]}" if pos < len(ids) else "had ended"


def check_exact(engine, messages: list[dict], ar: list[int], cast: list[int], out) -> None:
    """Greedy `cast` must equal `ar`: with bit-exact forwards (engine.exactness) or in fp32 a difference is a bug
    (raise); on torch's kernels in bf16/fp16 the two forwards round differently, so they may part where the top
    two logits nearly tie: say where, and how near the tie was."""
    pos = first_difference(ar, cast)
    if pos is None:
        return
    where = f"cast and ar part at output position {pos} (ar {choice(ar, pos)}, cast {choice(cast, pos)})"
    if engine.exactness == "bit-exact" or engine.dtype == torch.float32:
        dtype = "fp32" if engine.dtype == torch.float32 else str(engine.dtype).removeprefix("torch.")
        raise ExactnessError(f"{where} in {dtype} on {engine.exactness} forwards, where greedy cast must equal ar "
                             "token for token: this is an exactness bug")
    gap = top_two_gap(engine, messages, pos)
    tie = f"ar's top two logits there are {gap:.3g} apart" if gap is not None else "ar stopped there"
    print(f"  ({where}; {tie}: in {str(engine.dtype).removeprefix('torch.')} on {engine.exactness_reason}, "
          "the two forwards may part at near-ties)", file=out)


def cmd_demo(args) -> int:
    width = parse_width(args.width)  # before the load: a typo should not cost one
    try:
        run_demo(load_engine(args), args.max_new_tokens, width, repeats=args.repeats)
    except ExactnessError as e:
        print(f"castspec demo: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="ar vs cast on built-in prompts with the default model",
                       description="Load the defaults and show text, R, ms/token and speedup for a few prompts "
                                   "(each method run --repeats times in turn, its faster run reported).")
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--width", default="auto")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each method per prompt, in turn; the faster one is reported (default 2)")
    p.set_defaults(func=cmd_demo)
