"""A drafter pass timed two ways in one process, alternating, every cache level flushed before each call (as
decoding finds the drafter's weights after a verify): what an A/B of the pass can see on a machine whose speed
drifts between runs. Prints the medians (ms) as JSON.

    python scripts/drafter_pass_ab.py                      # the whole pass: in one native call (draft_pass),
                                                           # as the block's call and then the head's, and with
                                                           # panel_linear + torch's log_softmax as the head
    python scripts/drafter_pass_ab.py --base-lib OTHER.so  # draft.c's native call: this build against another
                                                           # library build of castspec (same DraftModel layout)
Run it from outside the repository with PYTHONPATH unset, or inside it, on the checkout to measure.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

import castspec
import castspec.models.dflash as dflash
from castspec.config import DecodeConfig
from castspec.native import abi, build
from castspec.round import run_round
from castspec.sequence import Sequence, propose_batch

PROMPT = [{"role": "user", "content": "Explain why the sky is blue in three sentences."}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-lib", help="another build of castspec's C library: time draft_block against it")
    p.add_argument("--context", type=int, default=2, help="new context rows the pass fuses (accepted tokens)")
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    eng = castspec.load(device="cpu", dtype="auto")
    target, drafter = eng.target, eng.drafter
    flush = torch.ones(100_000_000)  # 400 MB, more than every cache level
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        seq = Sequence(target, drafter, list(eng.encode(messages=PROMPT)), DecodeConfig(method="cast"), 1)
        run_round(target, drafter, [seq], None, prefill_budget=512)
        propose_batch(target, drafter, [seq.draft], [seq.root], [7])  # builds the native code, fuses the prompt
        start = seq.draft.cache.length
        feats = torch.randn(1, args.context, drafter.fc.weight.shape[1])
        run = _native_calls(drafter, seq, start, feats, args.base_lib) if args.base_lib else \
            _whole_passes(target, drafter, seq, start, feats)
        for rep in range(args.reps):
            for name in (list(run) if rep % 2 else list(run)[::-1]):
                flush.sum()
                t0 = time.perf_counter()
                run[name]()
                times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({name: round(statistics.median(v), 3) for name, v in times.items()}))


def _whole_passes(target, drafter, seq, start, feats):
    cls, head = type(drafter), dflash.panel_logprobs
    one_call = cls.propose_segments

    def two_calls(self, target, *args):  # draft.c's block, then the head's own native call
        return self.block_marginals(self.forward_segments(*args[:-1])[0], args[-1], target)

    def run(propose, panel):
        def go():
            cls.propose_segments, dflash.panel_logprobs = propose, panel
            seq.draft.cache.length, seq.draft.pending = start, feats
            propose_batch(target, drafter, [seq.draft], [seq.root], [7])
            cls.propose_segments, dflash.panel_logprobs = one_call, head
        return go

    return {"one call": run(one_call, head), "block, then head": run(two_calls, head),
            "torch head": run(two_calls, lambda *a: None)}


def _native_calls(drafter, seq, start, feats, base_lib):
    code = drafter.backend._code
    L, C = drafter.cfg.num_draft_positions, feats.shape[1]
    ctx = feats[0].contiguous()
    ctx_pos, block = torch.arange(start, start + C), torch.randn(L + 1, drafter.cfg.hidden_size)
    block_pos = torch.arange(start + C, start + C + L + 1)
    cache = seq.draft.cache
    segs = (abi.DraftSegment * 1)(abi.DraftSegment(cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, start, C,
                                                   L + 1))
    calls = {}
    for name, path in (("this build", build.library()._name), ("base build", base_lib)):
        lib = ctypes.CDLL(path)
        lib.draft_block.argtypes, lib.draft_block.restype = abi.SIGNATURES["draft_block"]
        lib.gemm_use_amx.argtypes = [ctypes.c_int]
        lib.gemm_use_amx(build.library().gemm_amx_on())  # tiles as this process's own library uses them
        out = torch.empty(L + 1, drafter.cfg.hidden_size)
        calls[name] = (lambda lib=lib, out=out: lib.draft_block(
            ctypes.byref(code._model), 1, segs, C, ctx.data_ptr(), ctx_pos.data_ptr(), L + 1, block.data_ptr(),
            block_pos.data_ptr(), out.data_ptr()))
    return calls


if __name__ == "__main__":
    main()
