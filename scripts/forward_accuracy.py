"""How close the bf16 forwards' logits are to the fp32 model's: tree-verify logits (32 rows behind real prefixes
of 128 / 512 / 1,024 tokens of MT-Bench questions) of castspec's native bf16 forward with this build's library and
with another build's, and of its bf16 forward on torch's kernels (CASTSPEC_NATIVE=0), each against the same
forward in fp32 (mean and max |logit difference|, KL(fp32 || bf16) per row, top-1 agreement). Prints JSON.

    python scripts/forward_accuracy.py --base-lib OTHER.so [--out FILE]

OTHER.so as for scripts/forward_ab.py. The prefixes' caches are this build's in every bf16 run: only the verify
forward is the other library's. Each side runs in a process of its own (fp32 and torch's path load differently).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

PREFIXES = (128, 512, 1024)
ROWS = 32


def logits(mode: str, base_lib: str | None, out: str) -> None:
    """One side's verify logits {(library, prefix): [ROWS, vocab]} saved to `out`."""
    import castspec
    from castspec.probe import _draft_shape, _prefilled
    from castspec.prompts import mtbench
    from castspec.tree import build_tree

    engine = castspec.load(dtype="float32" if mode == "fp32" else "bfloat16")
    target, drafter = engine.target, engine.drafter
    ids = engine.tokenizer(" ".join(p.text for p in mtbench()))["input_ids"]
    libs = {"this": None}
    if base_lib:
        sys.path.insert(0, os.path.dirname(__file__))
        from forward_ab import other_library, swapped
        libs["base"] = other_library(base_lib)
    _, _, logprobs = _draft_shape(drafter, target.cfg.vocab_size, 0)
    res = {}
    with torch.inference_mode():
        for P in PREFIXES:
            s = _prefilled(target, drafter, ids[:P], 64)
            pack, seg = s.verify_segment(build_tree(logprobs, ROWS - 1, 8))
            for name, lib in libs.items():
                got = {}

                def call():
                    got["l"] = target.forward_segments(pack.ids, pack.positions, [seg], taps=s.taps)[0][0].float()
                if lib is None:
                    call()
                else:
                    swapped(call, [(target.backend._code, "_fn", lib.forward_rows)])()
                res[f"{name}@{P}"] = got["l"].clone()
    torch.save(res, out)


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (x - ref).abs()
    kl = torch.nn.functional.kl_div(x.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "kl_mean": float(kl.mean()),
            "top1_agree": float((x.argmax(-1) == ref.argmax(-1)).float().mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-lib", required=True)
    p.add_argument("--out")
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: one side, in its own process
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        logits(args.side, args.base_lib if args.side == "bf16" else None, args.side_out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for side, native in (("bf16", None), ("fp32", None), ("torch-bf16", "0")):
            env = dict(os.environ, **({"CASTSPEC_NATIVE": native} if native else {}))
            path = os.path.join(tmp, f"{side}.pt")
            subprocess.run([sys.executable, __file__, "--base-lib", args.base_lib, "--side", side,
                            "--side-out", path], check=True, env=env)
            got[side] = torch.load(path)
    report = {}
    for P in PREFIXES:
        ref = got["fp32"][f"this@{P}"]
        report[P] = {"this": compare(got["bf16"][f"this@{P}"], ref), "base": compare(got["bf16"][f"base@{P}"], ref),
                     "torch": compare(got["torch-bf16"][f"this@{P}"], ref)}
    text = json.dumps({"base_lib": args.base_lib, "rows": ROWS, "prefixes": report}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
