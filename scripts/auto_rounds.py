"""Which rounds `width="auto"` drafts on one of `castspec demo`'s prompts (0 code, 1 chat, 2 math) and what the
first 7 (and 3) nodes of each of its trees would have committed on the same round, against N = 7's own rounds
(greedy: both runs write the same tokens, so rounds are compared by the output position they start at).

    python scripts/auto_rounds.py 1
"""
import statistics
import sys

import castspec
from castspec.allocate import PolicySpec
from castspec.cli.demo import DEMO_PROMPTS
from castspec.decode import DecodeStats, decode


def accepted_within(path: list[int], k: int) -> int:
    """Accepted nodes among the tree's first k (best-first order: a path's rows ascend)."""
    return next((i for i, row in enumerate(path) if row > k), len(path))


def run(engine, ids, width):
    """Decode with `width`; per drafted round: where it starts, its nodes, and what it and its heads accepted."""
    cfg = engine.config(method="cast", width=width, max_new_tokens=96)
    profile, calibration = engine.cost_inputs(PolicySpec.for_request(cfg), False)
    stats, log = DecodeStats(), []

    def on_round(logprobs, tree, path, emitted):
        log.append(dict(pos=stats.new_tokens, nodes=len(tree), acc=len(path), h7=accepted_within(path, 7),
                        h3=accepted_within(path, 3)))

    tokens = [t for chunk in decode(engine.target, engine.drafter, ids, cfg, stats, profile, calibration,
                                    on_round=on_round) for t in chunk]
    return tokens, stats, log


def mean(rounds, key) -> float:
    return statistics.mean(r[key] for r in rounds) if rounds else 0.0


def main():
    engine = castspec.load(device="cpu", dtype="auto")
    ids = engine.encode(messages=[{"role": "user", "content": DEMO_PROMPTS[int(sys.argv[1])]}])
    t7, _, l7 = run(engine, ids, 7)
    ta, sa, la = run(engine, ids, "auto")
    if t7 != ta:
        sys.exit("the two runs wrote different tokens: rounds cannot be compared by position")
    print(f"N=7: {len(l7)} rounds, commit {1 + mean(l7, 'acc'):.3f}")
    print(f"auto: {len(sa.rounds)} rounds, {len(la)} drafted: commit {1 + mean(la, 'acc'):.3f}, nodes "
          f"{mean(la, 'nodes'):.2f}; its first 7 nodes would commit {1 + mean(la, 'h7'):.3f}, 3 nodes "
          f"{1 + mean(la, 'h3'):.3f}")
    by_pos = {r["pos"]: r["acc"] + 1 for r in l7}
    same = [by_pos[r["pos"]] for r in la if r["pos"] in by_pos]
    print(f"N=7 rounds at auto's drafted positions: {len(same)}, commit {statistics.mean(same) if same else 0:.3f}")
    print("auto's drafted rounds (position, nodes, accepted):", [(r["pos"], r["nodes"], r["acc"]) for r in la])
    print("N=7's rounds (position, accepted):", [(r["pos"], r["acc"]) for r in l7])


if __name__ == "__main__":
    main()
