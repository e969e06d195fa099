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


def run(engine, ids, width):
    cfg = engine.config(method="cast", width=width, max_new_tokens=96)
    profile, cal = engine.cost_inputs(PolicySpec.for_request(cfg), False)
    stats, log = DecodeStats(), []

    def cb(lp, tree, path, emitted):
        head = lambda k: next((i for i, r in enumerate(path) if r > k), len(path))
        log.append(dict(pos=stats.new_tokens, nodes=len(tree), acc=len(path), h7=head(7), h3=head(3)))
    toks = [t for c in decode(engine.target, engine.drafter, ids, cfg, stats, profile, cal, on_round=cb) for t in c]
    return toks, stats, log


def main():
    engine = castspec.load(device="cpu", dtype="auto")
    ids = engine.encode(messages=[{"role": "user", "content": DEMO_PROMPTS[int(sys.argv[1])]}])
    t7, s7, l7 = run(engine, ids, 7)
    ta, sa, la = run(engine, ids, "auto")
    assert t7 == ta
    by_pos = {r["pos"]: r["acc"] + 1 for r in l7}
    print(f"N=7: {len(l7)} rounds, commit {statistics.mean(r['acc'] + 1 for r in l7):.3f}")
    print(f"auto: {len(sa.rounds)} rounds, {len(la)} drafted: commit {statistics.mean(r['acc'] + 1 for r in la):.3f}, "
          f"nodes {statistics.mean(r['nodes'] for r in la):.2f}, head-7 commit {statistics.mean(r['h7'] + 1 for r in la):.3f}, "
          f"head-3 {statistics.mean(r['h3'] + 1 for r in la):.3f}")
    same = [by_pos[r['pos']] for r in la if r['pos'] in by_pos]
    print(f"N=7 rounds at auto's drafted positions: {len(same)}, commit {statistics.mean(same) if same else 0:.3f}")
    print("auto drafted positions:", [(r['pos'], r['nodes'], r['acc']) for r in la])
    print("N=7 positions:", [(r['pos'], r['acc']) for r in l7])


if __name__ == "__main__":
    main()
