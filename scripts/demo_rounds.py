"""Where a demo prompt's `cast` time goes, width by width: for one of `castspec demo`'s prompts (index 0 code,
1 chat, 2 math), `ar` and then `cast` at each width given (an integer, `auto`, or `auto+cal` for the calibrated
rule), three times in turn; per run the speedup over `ar` and the rounds split into drafted ones (tokens committed,
rows verified, ms in the drafter pass / verify / host work) and plain ones.

    python scripts/demo_rounds.py 1 auto auto+cal 7
"""
import statistics
import sys

import castspec
from castspec.cli.demo import DEMO_PROMPTS


def mean(rounds, field):
    return round(statistics.mean(getattr(r, field) for r in rounds), 2) if rounds else None


def main() -> None:
    prompt = DEMO_PROMPTS[int(sys.argv[1]) if len(sys.argv) > 1 else 1]
    widths = sys.argv[2:] or ["auto", "7"]
    engine = castspec.load(device="cpu", dtype="auto")
    engine.generate(prompt="Hello", method="ar", max_new_tokens=4)
    messages = [{"role": "user", "content": prompt}]
    for _ in range(3):
        ar = engine.generate(messages=messages, method="ar", max_new_tokens=96).stats
        for w in widths:
            width = "auto" if w.startswith("auto") else int(w)
            s = engine.generate(messages=messages, method="cast", width=width, calibrate=w.endswith("+cal"),
                                max_new_tokens=96).stats
            drafted = [r for r in s.rounds if r.packed > 1]
            plain = [r for r in s.rounds if r.packed <= 1]
            committed = None if not drafted else round(mean(drafted, "accepted") + 1, 2)
            print(f"width {w}: ar {ar.decode_ms_per_token:.1f} -> {s.decode_ms_per_token:.1f} ms/token "
                  f"({ar.decode_ms_per_token / s.decode_ms_per_token:.2f}x), R {s.mean_accepted:.2f}; {len(drafted)} "
                  f"drafted rounds (committed {committed}, rows {mean(drafted, 'packed')}, draft / verify / host "
                  f"{mean(drafted, 'draft_ms')} / {mean(drafted, 'verify_ms')} / {mean(drafted, 'host_ms')} ms); "
                  f"{len(plain)} plain (verify {mean(plain, 'verify_ms')} ms); ar's step "
                  f"{statistics.mean(r.verify_ms for r in ar.rounds):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
