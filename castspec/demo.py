"""`castspec demo`: the defaults, two or three prompts, `ar` vs `cast`, and what each one cost."""
from __future__ import annotations

import sys

DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain why the sky is blue in three sentences.",
    "A baker sells 12 loaves a day for 5 days. How many loaves is that? Answer step by step.",
]


def run_demo(engine, max_new_tokens: int = 96, width="auto", out=sys.stdout) -> list[dict]:
    methods = ["ar", "cast"] if engine.drafter is not None else ["ar"]
    print(f"castspec demo: target in {engine.dtype_reason}; methods {', '.join(methods)}", file=out)
    if engine.drafter is None:
        print("(no drafter is installed for this target, so only `ar` runs; pass --drafter DIR to compare)",
              file=out)
    # one untimed warm-up so that one-time kernel compilation does not land in the first prompt's numbers
    engine.generate(prompt="Hello", method="ar", max_new_tokens=4)
    rows = []
    for prompt in DEMO_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        results = {m: engine.generate(messages=messages, method=m, width=width, max_new_tokens=max_new_tokens)
                   for m in methods}
        print(f"\n### {prompt}", file=out)
        print(results[methods[-1]].text.strip(), file=out)
        for m, r in results.items():
            s = r.stats
            speed = results["ar"].stats.decode_ms_per_token / max(s.decode_ms_per_token, 1e-9)
            print(f"  {m:>5}: {s.new_tokens:3d} tokens  R={s.mean_accepted:.2f}  "
                  f"{s.decode_ms_per_token:6.1f} ms/token  speedup over ar {speed:.2f}x", file=out)
            rows.append({"prompt": prompt, "method": m, **s.to_dict(), "speedup": speed})
        if "cast" in results and results["cast"].token_ids != results["ar"].token_ids:
            print("  (bf16: cast and ar differ after a near-tie of the top two logits; fp32 is exact)", file=out)
    return rows


def cmd_demo(args) -> int:
    from .cli import load_engine

    run_demo(load_engine(args), args.max_new_tokens, args.width)
    return 0


def register(sub) -> None:
    from .cli import add_model_args

    p = sub.add_parser("demo", help="ar vs cast on built-in prompts with the default model",
                       description="Load the defaults and show text, R, ms/token and speedup for a few prompts.")
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--width", default="auto")
    p.set_defaults(func=cmd_demo)
