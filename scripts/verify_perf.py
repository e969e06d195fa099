"""One verify shape in a loop, for `perf record` or a quick timing: a tree of ROWS packed rows behind a random
prompt of PREFIX tokens, as a round runs it (the default model and drafter, dtype auto), ITERS times after five
warm-ups; prints the mean ms.

    perf record -F 5000 -o /tmp/v8.perf python scripts/verify_perf.py 8 256 1500
"""
import sys
import time

import torch

import castspec
from castspec.probe import _draft_shape, _prefilled, _verify_call
from castspec.tree import build_tree

rows, P, iters = (int(a) for a in sys.argv[1:4])
engine = castspec.load(device="cpu", dtype="auto")
target, drafter = engine.target, engine.drafter
with torch.inference_mode():
    L, g, lp = _draft_shape(drafter, target.cfg.vocab_size, 0)
    prompt = torch.randint(0, target.cfg.vocab_size, (P,), generator=g).tolist()
    s = _prefilled(target, drafter, prompt, 64)
    call = _verify_call(target, [s], build_tree(lp, rows - 1, 8))
    for _ in range(5):
        call()
    t = time.perf_counter()
    for _ in range(iters):
        call()
    print(f"rows {rows} prefix {P}: {(time.perf_counter() - t) / iters * 1e3:.2f} ms")
