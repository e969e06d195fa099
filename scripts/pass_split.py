"""A drafter pass as rounds run it (right after a verify), split into its one native call and the host's work
around it (building the block, the call's arguments, the marginals): medians (ms) over REPS passes, as JSON.

    python scripts/pass_split.py [--prefix 128] [--reps 100] [--host-only]

`--host-only` makes the native call a no-op and runs the passes back to back: the host's work alone, warm (right
after a verify it also waits on what the verify pushed out of the caches).

The native call is timed by wrapping the drafter code's library entry `draft_pass`, so the same script times
another checkout's Python (`PYTHONPATH=<its root> python scripts/pass_split.py`) as long as it has that entry.
Nothing else should run meanwhile.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import castspec
from castspec.config import DecodeConfig
from castspec.probe import _draft_calls, _draft_shape, _verify_call
from castspec.round import run_round
from castspec.sequence import Sequence
from castspec.tree import build_tree


class _TimedLibrary:
    """The drafter code's library with `draft_pass` timed into `times` (ms); every other entry as it is."""

    def __init__(self, lib, times: list[float]):
        self._lib, self._times = lib, times

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def draft_pass(self, *args):
        t = time.perf_counter()
        rc = self._lib.draft_pass(*args)
        self._times.append((time.perf_counter() - t) * 1e3)
        return rc


class _NoPass(_TimedLibrary):
    """The library with `draft_pass` a no-op (its outputs left unwritten): the host's work alone."""

    def draft_pass(self, *args):
        self._times.append(0.0)
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--host-only", action="store_true",
                   help="the native call a no-op and no verify between passes: the host's work alone, warm")
    args = p.parse_args()
    engine = castspec.load()
    target, drafter = engine.target, engine.drafter
    L, g, logprobs = _draft_shape(drafter, target.cfg.vocab_size, 0)
    with torch.inference_mode():
        prompt = torch.randint(0, target.cfg.vocab_size, (args.prefix,), generator=g).tolist()
        seq = Sequence(target, drafter, prompt, DecodeConfig(method="cast", max_new_tokens=2), 16)
        run_round(target, drafter, [seq], None, prefill_budget=args.prefix)
        verify = _verify_call(target, [seq], build_tree(logprobs, 0, 8))
        draft = _draft_calls(target, drafter, [seq], L)()
        draft()  # builds and checks the drafter's native code
        code, native_ms, whole_ms = drafter.backend.built, [], []
        code._lib = (_NoPass if args.host_only else _TimedLibrary)(code._lib, native_ms)
        for _ in range(args.reps):
            if not args.host_only:
                verify()
            t = time.perf_counter()
            draft()
            whole_ms.append((time.perf_counter() - t) * 1e3)
    if len(native_ms) != len(whole_ms):
        raise SystemExit("the passes did not run as one native call each (no draft_pass entry in this checkout?)")
    host = [w - n for w, n in zip(whole_ms, native_ms)]
    print(json.dumps({"checkout": castspec.__file__, "prefix": args.prefix, "reps": args.reps,
                      "host_only": args.host_only,
                      "threads": torch.get_num_threads(),
                      "median_ms": {"pass": round(statistics.median(whole_ms), 3),
                                    "native call": round(statistics.median(native_ms), 3),
                                    "host": round(statistics.median(host), 3)}}))


if __name__ == "__main__":
    main()
