"""The paper's scale on a GPU with random weights (issue 22, part 3): Qwen3-8B and the DFlash b16 drafter's
shapes, built on the device in bf16, timed with and without castspec/graphs.py. JSON, costs only.

    python -m castspec.bench.gpu_scale --device cuda --out F.json [--scale full|small] [--dtype bf16]
        [--graphs auto|on|off] [--prefixes 512,4096] [--packed 1,2,4,...,128] [--tokens 64] [--reps 3]

It reports, for each forward mode (captured graphs where they are on, and eager):
  ar          `ar` decode ms/token (and the whole call per token) from a prefix, against the HBM floor at that
              prefix: the bytes a decode step reads (every layer matrix, the lm_head and the KV cache) divided by
              the read rate measured in the same run (and by the copy rate, the figure an `nvidia-smi`-style
              bandwidth test gives)
  verify      the verify forward of 1..128 packed tokens at each prefix (castspec.probe: the real packed forward,
              ancestor masks, the argmax sync), with its floor
  draft       the drafter pass after a round's commit, per prefix
  host        host work per round: tree build, mask, walk, compaction per width (probe), and a real `cast` round
              at N = 63 split into drafter pass, verify and host time
and transformers `generate` (greedy, the same random model) per token. With random weights no drafted token is
meaningfully accepted: acceptance and speed-ups of `cast` are not measured here, only what each part costs.
`--scale small` runs a down-scaled pair of the same structure (bench/scale_configs.py), so a CPU test can run
the whole benchmark in seconds.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from ..config import DrafterConfig
from ..engine import DTYPES, Engine
from ..floor import Floors, draft_cost, verify_cost
from ..graphs import DEFAULT_BUCKETS, GraphConfig, MODES, enable
from ..models.dflash import DFlashDrafter
from ..models.load import build_target
from ..probe import DEFAULT_PACKED, probe
from ..round import synchronize
from .engine import hf_ms_per_token
from .scale_configs import pair

# verify passes up to 128 packed tokens are measured: their graphs need a bucket
BENCH_BUCKETS = DEFAULT_BUCKETS + (128,)


def copy_gbps(device: torch.device, repeats: int = 10) -> float:
    """Bytes moved (read plus written) per second by a large device-to-device copy, the best of `repeats`."""
    n = (256 if device.type == "cuda" else 32) * 1024 * 1024 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best / 1e9


def build_models(scale: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(transformers model, castspec target with the same weights, castspec drafter), all random, made on the
    device: the real checkpoints do not travel to a lent GPU, and timing does not depend on the values."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    target_json, drafter_json = pair(scale)
    hf_config = Qwen3Config(**{k: v for k, v in target_json.items() if k != "architectures"})
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval().requires_grad_(False)
    target = build_target(hf.config, hf.state_dict(), dtype, device)
    drafter = DFlashDrafter(DrafterConfig.from_json(drafter_json), dtype=dtype, device=device)
    with torch.no_grad():
        for p in drafter.parameters():  # the fused matrices start uninitialized; norms start at one
            if p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return hf, target, drafter.eval().requires_grad_(False), target_json, drafter_json


def ar_timing(engine: Engine, ids: list[int], tokens: int, reps: int) -> dict:
    """`ar` from the prompt `ids`: decode ms/token (after prefill) and the whole call per token, the median of
    `reps` runs after a warm-up run (kernels, graphs captured for the shapes the run meets)."""
    kw = dict(input_ids=ids, method="ar", max_new_tokens=tokens, stop_token_ids=())  # no early stop on random text
    engine.generate(**kw)
    runs = []
    for _ in range(reps):
        synchronize(engine.device)
        t = time.perf_counter()
        r = engine.generate(**kw)
        synchronize(engine.device)
        runs.append((r.stats.decode_ms_per_token, (time.perf_counter() - t) * 1e3 / len(r.token_ids)))
    decode_ms, whole_ms = sorted(runs)[len(runs) // 2]
    return {"decode_ms_per_token": decode_ms, "whole_call_ms_per_token": whole_ms,
            "decode_ms_per_token_runs": [r[0] for r in runs]}


def cast_round(engine: Engine, ids: list[int], tokens: int, width: int) -> dict:
    """One `cast` decode at a fixed width, split per round into drafter pass, verify and host work."""
    kw = dict(input_ids=ids, method="cast", width=width, max_new_tokens=tokens, stop_token_ids=())
    engine.generate(**kw)
    rounds = engine.generate(**kw).stats.rounds
    n = len(rounds)
    draft, verify, host = (sum(getattr(r, k) for r in rounds) / n for k in ("draft_ms", "verify_ms", "host_ms"))
    return {"width": width, "rounds": n, "mean_packed": sum(r.packed for r in rounds) / n,
            "draft_ms_per_round": draft, "verify_ms_per_round": verify, "host_ms_per_round": host,
            "round_ms": draft + verify + host, "host_share": host / (draft + verify + host)}


def measure_mode(engine: Engine, graphs: GraphConfig, args, floors: Floors, prompt: list[int]) -> dict:
    """Everything but transformers for one forward mode (graphs as `graphs` says)."""
    target, drafter = engine.target, engine.drafter
    on = enable(target, drafter, graphs)
    P = args.prefixes[0]
    ar = ar_timing(engine, prompt[:P], args.tokens, args.reps)
    mid = P + args.tokens // 2  # the mean prefix of the timed steps
    step = verify_cost(target, 1, mid)
    ar.update(prefix=P, floor_ms=step.floor_ms(floors), floor_ms_at_copy_rate=step.nbytes / (args.copy_gbps * 1e6),
              step_bytes=step.nbytes)
    ar["ratio_to_floor"] = ar["decode_ms_per_token"] / ar["floor_ms"]
    profile = probe(engine, packed=args.packed, prefix_lens=args.prefixes, reps=args.reps, warmup=args.warmup,
                    progress=False, seed=args.seed)
    verify = {"packed": profile.packed, "prefix_lens": profile.prefix_lens, "ms": profile.verify_ms,
              "floor_ms": profile.floor["verify_floor_ms"], "ratio_to_floor": profile.floor["verify_ratio"],
              "ratio_to_one_row": [[m / row[0] for m in row] for row in profile.verify_ms]
              if profile.packed[0] == 1 else None}
    draft = {"prefix_lens": profile.prefix_lens, "ms": profile.draft_ms,
             "floor_ms": [draft_cost(drafter, target, p, ctx_rows=3).floor_ms(floors) for p in profile.prefix_lens],
             "per_ar_step": profile.draft_ms[0] / ar["decode_ms_per_token"]}
    out = {"graphs": on, "ar": ar, "verify": verify, "draft": draft,
           "host": {"per_width_ms": profile.host_ms, "cast_round": cast_round(engine, prompt[:P], args.tokens, 63)}}
    if on:
        out["graph_counts"] = {"target": vars(target.graphs.counts), "drafter": vars(drafter.graphs.counts)}
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", choices=("full", "small"), default="full")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    ap.add_argument("--graphs", choices=MODES, default="auto",
                    help="auto: graphs on CUDA (measured against eager too), eager elsewhere")
    ap.add_argument("--prefixes", default=None, help="comma-separated prefix lengths (default 512,4096; small: "
                    "64,256); the first is also ar's and the cast round's prompt length")
    ap.add_argument("--packed", default=",".join(map(str, DEFAULT_PACKED)))
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per timed decode")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers generate")
    args = ap.parse_args(argv)
    args.prefixes = [int(x) for x in (args.prefixes or ("512,4096" if args.scale == "full" else "64,256")).split(",")]
    args.packed = [int(x) for x in args.packed.split(",")]
    if min(args.prefixes) < 1 or min(args.packed) < 1 or args.tokens < 2 or args.reps < 1 or args.warmup < 0:
        ap.error("prefixes, packed counts and reps must be positive, tokens at least 2")
    if max(args.packed) > BENCH_BUCKETS[-1]:
        ap.error(f"packed counts above {BENCH_BUCKETS[-1]} have no graph bucket")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    dtype = DTYPES[args.dtype]
    import transformers

    report = {"device": str(device), "machine": platform.machine(), "torch": torch.__version__,
              "transformers": transformers.__version__, "scale": args.scale, "dtype": args.dtype,
              "tokens": args.tokens, "reps": args.reps, "note": "random weights: costs only, no acceptance"}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    hf, target, drafter, target_json, drafter_json = build_models(args.scale, dtype, device, args.seed)
    report["build_s"] = time.perf_counter() - t0
    report["configs"] = {"target": target_json, "drafter": drafter_json}
    mats = [p for p in target.model.layers.parameters() if p.dim() == 2] + [target.head_weight]
    report["weight_bytes"] = sum(p.numel() * p.element_size() for p in mats)  # what every decode step reads
    engine = Engine(target, None, drafter, f"{args.dtype}: benchmark", source=f"random {args.scale} qwen3",
                    drafter_source=f"random {args.scale} dflash")
    with torch.inference_mode():
        floors = Floors.measure(device, dtype)
        args.copy_gbps = copy_gbps(device)
    report["floors"] = {"read_gbps": floors.read_gbps, "copy_gbps": args.copy_gbps, "gemm_gflops": floors.gemm_gflops}
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, target.cfg.vocab_size, (max(args.prefixes),), generator=g).tolist()

    graphs = GraphConfig(mode=args.graphs, buckets=BENCH_BUCKETS)
    modes = {"graphs": graphs} if graphs.active(device) else {}
    modes["eager"] = GraphConfig(mode="off")
    report["graph_config"] = {"mode": graphs.mode, "buckets": list(graphs.buckets), "key_step": graphs.key_step,
                              "active": graphs.active(device)}
    report["modes"] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, cfg in modes.items():
        t = time.perf_counter()
        report["modes"][name] = measure_mode(engine, cfg, args, floors, prompt)
        report["modes"][name]["wall_s"] = time.perf_counter() - t
        print(json.dumps({name: report["modes"][name]["ar"]}), flush=True)
        out.write_text(json.dumps(report, indent=2))  # each mode as it ends: a run cut short keeps what it measured
    enable(target, drafter, GraphConfig(mode="off"))
    if not args.no_hf:
        with torch.inference_mode():
            ms = statistics.median(hf_ms_per_token(hf, prompt[:args.prefixes[0]], args.tokens)
                                   for _ in range(args.reps))
        report["transformers"] = {"whole_call_ms_per_token": ms, "prefix": args.prefixes[0]}
    report["summary"] = summary(report)
    print(json.dumps(report["summary"], indent=2))
    out.write_text(json.dumps(report, indent=2))
    return 0


def summary(report: dict) -> dict:
    """The ratios issue 22 states its targets in, from this run's numbers (the first mode: graphs where on)."""
    name, mode = next(iter(report["modes"].items()))
    ar, verify, draft = mode["ar"], mode["verify"], mode["draft"]
    out = {"mode": name, "ar_decode_ms_per_token": ar["decode_ms_per_token"], "ar_floor_ms": ar["floor_ms"],
           "ar_ratio_to_floor": ar["ratio_to_floor"], "draft_per_ar_step": draft["per_ar_step"],
           "host_ms_per_round_cast63": mode["host"]["cast_round"]["host_ms_per_round"]}
    packed = verify["packed"]
    if 1 in packed and 64 in packed:
        out["verify64_over_verify1"] = {str(p): row[packed.index(64)] / row[packed.index(1)]
                                        for p, row in zip(verify["prefix_lens"], verify["ms"])}
    if "transformers" in report:
        out["ar_speedup_vs_transformers_whole_call"] = (report["transformers"]["whole_call_ms_per_token"]
                                                        / ar["whole_call_ms_per_token"])
    if "eager" in report["modes"] and name != "eager":
        eager = report["modes"]["eager"]["ar"]["decode_ms_per_token"]
        out["ar_eager_over_graphs"] = eager / ar["decode_ms_per_token"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
