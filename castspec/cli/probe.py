"""`castspec probe`: measure this deployment's verify costs and store the profile that width="auto" uses."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cost import CostProfile, profile_path
from ..env import cache_dir
from ..probe import QUICK_PACKED, engine_key, plot_profile, probe, probe_batch
from .common import UserError, add_model_args, load_engine


def cmd_probe(args) -> int:
    try:
        packed = tuple(int(x) for x in args.packed.split(","))
        prefixes = tuple(int(x) for x in args.prefix_lens.split(","))
        batches = tuple(int(x) for x in args.batch_sizes.split(",")) if args.batch_sizes else ()
    except ValueError:
        raise UserError("--packed, --prefix-lens and --batch-sizes are comma lists of integers") from None
    if min(packed) < 1 or min(prefixes) < 1 or min(batches, default=1) < 1:
        raise UserError("packed counts, prefix lengths and batch sizes must be >= 1")
    engine = load_engine(args)
    ctx = engine.target.cfg.max_positions
    if max(prefixes) + max(packed) + 2 > ctx:
        raise UserError(f"prefix {max(prefixes)} + {max(packed)} packed tokens exceed the context ({ctx})")
    profile = probe(engine, packed, prefixes, reps=args.reps, warmup=args.warmup)
    if batches:
        # at the prefix the cost policy prices batched rounds at (the profile's first), so that a plain round and
        # a drafted one of the same batch compare at the same key reads
        probe_batch(engine, profile, batches, prefix=prefixes[0], reps=args.reps, warmup=args.warmup)
    # the deployment's profile is what width="auto" and the cost policy read: a probe of a few shapes (a check
    # of one verify size, say) must not replace it with one the rules cannot price wider trees from
    covers = min(packed) == 1 and max(packed) >= max(QUICK_PACKED)
    store = covers if args.store is None else args.store
    stored = profile_path(cache_dir(), engine_key(engine)) if store else None
    if stored is not None:
        profile.save(stored)
    else:
        print(f"castspec: not stored as this deployment's profile: it measures packed counts up to {max(packed)}, "
              f"and width=\"auto\" reads 1 to {max(QUICK_PACKED)} at least (--store stores it anyway)",
              file=sys.stderr)
    if args.out:
        profile.save(Path(args.out))
    if args.plot:
        plot_profile(profile, args.plot)
    print(floor_table(profile), file=sys.stderr)  # for the eye; stdout stays one JSON document
    print(json.dumps({"profile": None if stored is None else str(stored), "packed": profile.packed,
                      "verify_ms": profile.verify_ms, "draft_ms": profile.draft_ms, "prefill_ms": profile.prefill_ms,
                      "host_ms": profile.host_ms, "batch": profile.batch, "floor": profile.floor}, indent=2))
    return 0


def floor_table(profile: CostProfile) -> str:
    """Measured time, floor and their ratio for every shape: one block per prefix (and per batch size)."""
    f = profile.floor
    lines = [f"floor = max(bytes / {f['read_gbps']:.1f} GB/s, FLOPs / {f['gemm_gflops']:.0f} GFLOP/s), "
             "both measured in this run",
             f"{'shape':>22} {'measured ms':>12} {'floor ms':>9} {'ratio':>6}   over 1 row: measured, floor"]

    def row(shape: str, measured: float, floor: float | None, ratio: float | None, over: str = "") -> None:
        if floor is not None:  # None: no drafter pass
            lines.append(f"{shape:>22} {measured:12.2f} {floor:9.2f} {ratio:6.2f}{over}")

    def over_one_row(i: int, j: int) -> str:
        m, fl = f.get("verify_over_one_row"), f.get("verify_floor_over_one_row")
        return f"   {m[i][j]:11.2f} {fl[i][j]:6.2f}" if m and m[i] and fl and fl[i] else ""

    def draft_over_one_row(i: int) -> str:
        m, fl = f.get("draft_over_one_row"), f.get("draft_floor_over_one_row")
        return f"   {m[i]:11.3f} {fl[i]:6.3f}" if m and fl else ""

    for i, P in enumerate(profile.prefix_lens):
        for j, (n, ms, floor, ratio) in enumerate(zip(profile.packed, profile.verify_ms[i], f["verify_floor_ms"][i],
                                                      f["verify_ratio"][i])):
            row(f"prefix {P} verify {n}", ms, floor, ratio, over_one_row(i, j))
        row(f"prefix {P} draft", profile.draft_ms[i], f["draft_floor_ms"][i], f["draft_ratio"][i],
            draft_over_one_row(i))
        if profile.prefill_ms:
            row(f"prompt of {P}", profile.prefill_ms[i], f["prefill_floor_ms"][i], f["prefill_ratio"][i])
    for B, entry in sorted(profile.batch.items(), key=lambda kv: int(kv[0])):
        for n, ms, floor, ratio in zip(entry["packed"], entry["verify_ms"], entry["verify_floor_ms"],
                                       entry["verify_ratio"]):
            row(f"batch {B} verify {n}", ms, floor, ratio)
        row(f"batch {B} draft", entry["draft_ms"], entry["draft_floor_ms"], entry["draft_ratio"])
    return "\n".join(lines)


def register(sub) -> None:
    p = sub.add_parser("probe", help="time the verify path over packed counts; store the cost profile",
                       description="Packed forward with the tree mask and cache as decoding runs it, the drafter "
                                   "pass and host overhead h(N); medians after warm-ups.")
    add_model_args(p)
    p.add_argument("--packed", default="1,2,4,8,16,24,32,48,64,96,128")
    p.add_argument("--prefix-lens", default="128,512")
    p.add_argument("--batch-sizes", default="", help="also time batched (serving) shapes, e.g. 2,4,8,16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--store", action=argparse.BooleanOptionalAction, default=None,
                   help="store the result as this deployment's profile (default: when it measures packed counts "
                        "1 to at least 64, what width=\"auto\" reads)")
    p.add_argument("--out", default=None, help="also write the profile JSON here")
    p.add_argument("--plot", default=None, help="PNG of latency vs packed tokens")
    p.set_defaults(func=cmd_probe)
