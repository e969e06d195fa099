"""Whole native forwards timed with this build of castspec's C library and with another build, in one process,
alternating call by call: verify forwards of trees of ROWS packed rows behind one request's prefix, ragged
verifies of a batch of requests, and a batched drafter pass, as rounds run them. On a machine whose speed drifts
between runs and within them, what an A/B of a change to the native code can see. Prints medians (ms) as JSON.

    python scripts/forward_ab.py --base-lib OTHER.so [--rows 1,8,16,32,64] [--prefix 128] [--batch 16] [--reps 25]

OTHER.so: the library another checkout builds (its path: `python -c "from castspec.native import build;
print(build.library()._name)"` there); it must share this build's structs (native/abi.py), and uses AMX as this
process's library does. Nothing else should run meanwhile.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

import castspec
from castspec.native import abi, build
from castspec.probe import _draft_calls, _draft_shape, _prefilled, _verify_call
from castspec.tree import build_tree


def other_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (args, result) in abi.SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    lib.gemm_use_amx.argtypes = [ctypes.c_int]
    lib.gemm_use_amx(build.library().gemm_amx_on())
    return lib


def swapped(call, codes: list[tuple[object, str, object]]):
    """`call` with each code's entry `attr` set to the other library's function while it runs."""
    def run():
        kept = [(code, attr, getattr(code, attr)) for code, attr, _ in codes]
        for code, attr, fn in codes:
            setattr(code, attr, fn)
        try:
            call()
        finally:
            for code, attr, fn in kept:
                setattr(code, attr, fn)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-lib", required=True)
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    engine = castspec.load()
    target, drafter = engine.target, engine.drafter
    step, draft = target.backend._code, drafter.backend._code
    base = other_library(args.base_lib)
    other = [(step, "_fn", base.forward_rows), (draft, "_lib", base)]
    L, g, logprobs = _draft_shape(drafter, target.cfg.vocab_size, 0)
    seqs = []
    with torch.inference_mode():
        for _ in range(args.batch + 1):  # the first for one request's shapes, the others for the batch's
            prompt = torch.randint(0, target.cfg.vocab_size, (args.prefix,), generator=g).tolist()
            s = _prefilled(target, drafter, prompt, 64)
            seqs.append(s)
        shapes = {f"verify {n}": _verify_call(target, seqs[:1], build_tree(logprobs, n - 1, 8))
                  for n in map(int, args.rows.split(","))}
        batch = seqs[1:]
        shapes[f"batch {args.batch} verify 1 each"] = _verify_call(target, batch, build_tree(logprobs, 0, 8))
        shapes[f"batch {args.batch} verify 2 each"] = _verify_call(target, batch, build_tree(logprobs, 1, 8))
        shapes["draft pass"] = _draft_calls(target, drafter, seqs[:1], L)()
        shapes[f"batch {args.batch} draft pass"] = _draft_calls(target, drafter, batch, L)()
        # as rounds run them: a drafter pass right after a verify, which has streamed the target's weights
        before = {name: shapes["verify 1"] if "draft" in name else None for name in shapes}
        calls = {(name, side): fn if side == "this" else swapped(fn, other)
                 for name, fn in shapes.items() for side in ("this", "base")}
        times = {k: [] for k in calls}
        for fn in calls.values():
            fn()
        for rep in range(args.reps):
            for name in shapes:  # the two builds in turn, which one first alternating (the second finds the
                for side in (("this", "base") if rep % 2 == 0 else ("base", "this")):  # shape's data in cache)
                    if before[name] is not None:
                        before[name]()
                    t = time.perf_counter()
                    calls[(name, side)]()
                    times[(name, side)].append((time.perf_counter() - t) * 1e3)
    out = {name: {side: round(statistics.median(times[(name, side)]), 3) for side in ("this", "base")}
           for name in shapes}
    for v in out.values():
        v["this/base"] = round(v["this"] / v["base"], 3)
    print(json.dumps({"base_lib": args.base_lib, "this_lib": build.library()._name, "prefix": args.prefix,
                      "reps": args.reps, "threads": torch.get_num_threads(), "median_ms": out}, indent=1))


if __name__ == "__main__":
    main()
