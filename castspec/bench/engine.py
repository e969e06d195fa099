"""Engine benchmark (JSON): `ar` vs transformers `generate` per dtype, the weight-bandwidth floor, and the share
of host-side work (top-K, tree, mask, walk, gather) in a `cast` round at N = 63.

    python -m castspec.bench.engine --out runs/engine.json [--tokens 64] [--prompts 3]

All numbers come from one run on one machine: compare ratios, not absolute times across runs.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Explain how vaccines train the immune system.",
           "List three tips for writing clear emails."]


def bandwidth_gbps() -> float:
    """Read bandwidth of a large tensor reduction: the floor of a decode step is weight bytes / this."""
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    return x.numel() * 4 * 5 / (time.perf_counter() - t) / 1e9


def hf_ms_per_token(hf, ids: list[int], tokens: int) -> float:
    inp = torch.tensor([ids])
    hf.generate(inp, max_new_tokens=4, do_sample=False)  # warm-up
    t = time.perf_counter()
    hf.generate(inp, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return (time.perf_counter() - t) * 1e3 / tokens


def ours_ms_per_token(engine, ids: list[int], tokens: int) -> float:
    engine.generate(input_ids=ids, method="ar", max_new_tokens=4)
    t = time.perf_counter()
    r = engine.generate(input_ids=ids, method="ar", max_new_tokens=tokens)
    return (time.perf_counter() - t) * 1e3 / len(r.token_ids)


def host_share(engine, ids: list[int], tokens: int, width: int) -> dict:
    r = engine.generate(input_ids=ids, method="cast", width=width, max_new_tokens=tokens)
    rounds = r.stats.rounds
    total = sum(x.draft_ms + x.verify_ms + x.host_ms for x in rounds)
    return {"width": width, "rounds": len(rounds), "host_ms_per_round": sum(x.host_ms for x in rounds) / len(rounds),
            "round_ms": total / len(rounds), "host_share": sum(x.host_ms for x in rounds) / total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/engine.json")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--drafter", default=None, help="drafter for the host-share measurement (default: shipped, "
                    "else a randomly initialised one in the DFlash layout)")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    import castspec
    from castspec.models.load import resolve_target_dir

    hf_dir = resolve_target_dir(None)
    report = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "tokens": args.tokens, "dtypes": {}}
    bw = bandwidth_gbps()
    report["read_bandwidth_gbps"] = bw
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        engine = castspec.load(dtype=name, drafter=args.drafter)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.target.parameters())
        rows = []
        for text in PROMPTS[:args.prompts]:
            ids = engine.encode(messages=[{"role": "user", "content": text}])
            rows.append({"hf": hf_ms_per_token(hf, ids, args.tokens), "ours": ours_ms_per_token(engine, ids, args.tokens)})
        hf_ms = sum(r["hf"] for r in rows) / len(rows)
        ours = sum(r["ours"] for r in rows) / len(rows)
        floor = weight_bytes / (bw * 1e9) * 1e3
        entry = {"transformers_ms_per_token": hf_ms, "castspec_ar_ms_per_token": ours, "speedup_vs_transformers":
                 hf_ms / ours, "weight_bytes": weight_bytes, "bandwidth_floor_ms": floor, "ratio_to_floor": ours / floor,
                 "per_prompt": rows}
        if engine.drafter is None:
            from transformers import AutoConfig

            from castspec.models.load import rope_parameters_of
            from castspec.train.trainer import TrainConfig, drafter_config_for, init_drafter

            rope = rope_parameters_of(AutoConfig.from_pretrained(hf_dir))
            dcfg = drafter_config_for(engine.target, TrainConfig(), rope)
            engine.drafter = init_drafter(engine.target, dcfg, False, 0).converted(dtype)
            entry["drafter"] = "random (host share only)"
        ids = engine.encode(messages=[{"role": "user", "content": PROMPTS[0]}])
        entry["host_share_cast63"] = host_share(engine, ids, args.tokens, 63)
        report["dtypes"][name] = entry
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "per_prompt"}}, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
