"""Host work, drafter pass and verify a drafted round on the demo's prompts (`cast`, fixed width or auto, 96
tokens, the second of two passes over the prompts), for an A/B of two checkouts run alternately:

    cd /tmp && PYTHONPATH=<base worktree> <repo>/.venv/bin/python <repo>/scripts/host_ab.py base 15
    cd /tmp && <repo>/.venv/bin/python <repo>/scripts/host_ab.py new 15

(outside the repository, so that PYTHONPATH decides which castspec is imported; a fixed width keeps the trees,
and so the work, the same in both). Prints one line: the label, the castspec imported, rounds, mean packed rows,
and ms a drafted round in host work, drafter pass and verify."""
import sys

import castspec
from castspec.cli.demo import DEMO_PROMPTS

label = sys.argv[1] if len(sys.argv) > 1 else "this"
width = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "auto" else "auto"
engine = castspec.load(device="cpu", dtype="auto")
engine.generate(prompt="Hello", method="ar", max_new_tokens=4)
rounds = []
for rep in range(2):
    for prompt in DEMO_PROMPTS:
        r = engine.generate(messages=[{"role": "user", "content": prompt}], method="cast", width=width,
                            max_new_tokens=96)
        if rep:
            rounds += [x for x in r.stats.rounds if x.packed > 1]
n = max(len(rounds), 1)
print(f"{label} ({castspec.__file__}): rounds {len(rounds)} packed {sum(x.packed for x in rounds) / n:.1f} "
      f"host {sum(x.host_ms for x in rounds) / n:.3f} draft {sum(x.draft_ms for x in rounds) / n:.3f} "
      f"verify {sum(x.verify_ms for x in rounds) / n:.2f}", flush=True)
