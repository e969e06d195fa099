"""A forward's matrix products alone (JSON): every weight matrix of the target multiplied once by M rows, on
castspec's packed kernels (csrc/gemm.c, what every native forward runs) and on torch's matmul with the same
weights, against the floor measured in the same run (weight bytes / read rate, FLOPs / matmul rate).

    python -m castspec.bench.products --out runs/products.json [--rows 1,2,4,8,16,32,64] [--dtype bf16]
        [--repeats 5] [--target HF_DIR_OR_GGUF]

`castspec probe` times whole forwards (attention, norms and the rest included); this isolates the products, to
say how far multi-row products are from the machine's limits and to tune the kernels. Each matrix is timed inside
a sweep over all of them, so its weights come from memory as in a real forward; the best of the repeats.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..engine import load
from ..floor import Floors
from ..native import build as native
from ..native.pack import pack_panels, packable


def step_matrices(target) -> list[torch.Tensor]:
    """The matrices one forward multiplies by: fused q|k|v, o_proj, fused gate|up and down_proj of every layer,
    and the lm_head."""
    mats = [w for layer in target.model.layers for w in (layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight,
                                                         layer.mlp.gate_up_weight, layer.mlp.down_proj.weight)]
    return [*mats, target.head_weight]


def _gemm_call(lib, w: torch.Tensor, rows: int) -> Callable[[], None]:
    """A closure running gemm.c's product of `rows` random rows by w (packed here), as layer.h calls it: inputs in
    the weight's dtype, padded with zero rows to a multiple of 16, fp32 sums out."""
    packed = pack_panels(w.detach(), lib.gemm_panel_group())
    O, I = w.shape
    x = torch.zeros(-(-rows // 16) * 16, I, dtype=w.dtype)
    x[:rows] = torch.randn(rows, I).to(w.dtype)
    y = torch.empty(rows, O)
    entry = lib.gemm_bf16_f32 if w.dtype == torch.bfloat16 else lib.gemm_f32
    args = (packed.data_ptr(), x.data_ptr(), y.data_ptr(), rows, O, I, x.stride(0), y.stride(0))
    return lambda buffers=(packed, x, y): entry(*args)  # the default argument keeps the buffers alive


def products_ms(target, rows: int, repeats: int) -> dict:
    """ms for all of a forward's products with `rows` rows: {"gemm": ..., "torch": ...} (gemm only where the
    native library loads and every matrix is packable)."""
    mats = step_matrices(target)
    kernels = {}
    lib = native.library()
    if lib is not None and all(packable(w) for w in mats):
        kernels["gemm"] = [_gemm_call(lib, w, rows) for w in mats]
    xs = [torch.randn(rows, w.shape[1]).to(w.dtype) for w in mats]
    kernels["torch"] = [(lambda x=x, w=w: F.linear(x, w)) for x, w in zip(xs, mats)]
    best = {name: [float("inf")] * len(mats) for name in kernels}
    with torch.inference_mode():
        for name, fns in kernels.items():
            for fn in fns:  # warm-up: lazy kernel choice, page faults
                fn()
        for _ in range(repeats):
            for name, fns in kernels.items():
                for i, fn in enumerate(fns):
                    t = time.perf_counter()
                    fn()
                    best[name][i] = min(best[name][i], time.perf_counter() - t)
    return {name: sum(v) * 1e3 for name, v in best.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/products.json")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target", default=None, help="HF directory or GGUF (default: the embedded SmolLM2-135M)")
    args = ap.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        if any(r < 1 for r in rows):
            raise ValueError
    except ValueError:
        ap.error(f"--rows must be positive integers separated by commas, not {args.rows!r}")
    target = load(target=args.target, dtype=args.dtype).target
    lib = native.library()
    mats = step_matrices(target)
    weight_bytes = sum(w.numel() * w.element_size() for w in mats)
    params = sum(w.numel() for w in mats)
    floors = Floors.measure(torch.device("cpu"), target.dtype)
    report = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "dtype": str(target.dtype), "amx": bool(lib is not None and lib.gemm_amx_on()),
              "weight_bytes": weight_bytes, "read_gbps": floors.read_gbps, "gemm_gflops": floors.gemm_gflops,
              "rows": rows, "ms": {}, "floor_ms": [], "ratio_to_floor": {}}
    for m in rows:
        got = products_ms(target, m, args.repeats)
        floor = floors.floor_ms(weight_bytes, 2.0 * params * m)
        report["floor_ms"].append(floor)
        for name, ms in got.items():
            report["ms"].setdefault(name, []).append(ms)
            report["ratio_to_floor"].setdefault(name, []).append(ms / floor)
        print(f"rows {m:3d}: " + "  ".join(f"{name} {ms:7.2f} ms ({ms / floor:4.2f}x floor)"
                                           for name, ms in got.items()) + f"  floor {floor:6.2f} ms", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
