"""The machine's limits and what a shape needs at least: the floor under every measured time.

No forward can be faster than reading what it reads at the machine's read rate, nor than computing its products at
the machine's matmul rate: its floor is the larger of the two. Both rates are measured in the same run as the times
they bound (a shared machine's rates move with its neighbours' load), and what each shape reads and computes is
counted from the models' parameters and configs, so the ratio measured / floor says how far a shape is from what
this machine allows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .native import build as native
from .round import synchronize


def read_gbps(device: torch.device, repeats: int = 10) -> float:
    """Read bandwidth of a large tensor reduction, the best of `repeats` (a floor is a best case, and noise on a
    shared machine only ever takes bandwidth away): the floor of a decode step is weight bytes / this."""
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def gemm_gflops(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> float:
    """The best rate (GFLOP/s) of a square matmul in `dtype`, over `repeats` calls after a warm-up.

    Square, 1024 on a CPU and 4096 on a GPU: every operand element is reused a thousand times or more, so the
    reads do not bound it and its rate is the arithmetic's alone, the most any product in this dtype reaches (a
    verify's few-row product reuses each weight only once per row and is bounded by the read). The CPU size keeps
    the operands in the caches and a call short enough to repeat on a busy machine; a GPU needs a larger grid
    to fill its units. The best call, since noise only ever takes speed away."""
    device = torch.device(device)
    size = 4096 if device.type == "cuda" else 1024
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=g, device=device).to(dtype)
    b = torch.randn(size, size, generator=g, device=device).to(dtype)
    with torch.inference_mode():
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            t = time.perf_counter()
            torch.mm(a, b)
            synchronize(device)
            best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best / 1e9


@dataclass(frozen=True)
class Floors:
    """The machine's read rate (GB/s) and matmul rate (GFLOP/s), as measured in one run."""

    read_gbps: float
    gemm_gflops: float

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype, read_repeats: int = 10,
                gemm_repeats: int = 3) -> "Floors":
        """Both rates now. For a reduced-precision dtype the matmul rate is the faster of that dtype's and fp32's:
        a product with bf16 inputs can be computed exactly in fp32 arithmetic (bf16 widens exactly), and castspec's
        kernels do so on CPUs without bf16 dot products. On such a CPU torch's bf16 matmul is a slow fallback
        that no kernel needs to run, and timing it at this size would take seconds: only fp32 is timed there."""
        device = torch.device(device)
        gemm = gemm_gflops(device, torch.float32, gemm_repeats)
        if dtype != torch.float32 and (device.type != "cpu" or native.cpu_supported()):
            gemm = max(gemm, gemm_gflops(device, dtype, gemm_repeats))
        return cls(read_gbps(device, read_repeats), gemm)

    def best(self, other: "Floors") -> "Floors":
        """The higher of each rate (two readings in one run: the limit is the better one)."""
        return Floors(max(self.read_gbps, other.read_gbps), max(self.gemm_gflops, other.gemm_gflops))

    def floor_ms(self, nbytes: float, flops: float) -> float:
        """The least time for a shape that reads `nbytes` and computes `flops`: max(read time, compute time)."""
        return max(nbytes / (self.read_gbps * 1e9), flops / (self.gemm_gflops * 1e9)) * 1e3


@dataclass(frozen=True)
class Cost:
    """What one forward reads (bytes) and computes (floating-point operations, a multiply-add counted as 2)."""

    nbytes: float
    flops: float

    def floor_ms(self, floors: Floors) -> float:
        return floors.floor_ms(self.nbytes, self.flops)


def _matrices(module: torch.nn.Module) -> list[torch.Tensor]:
    """The weight matrices of `module` (its 2-D parameters): norms and biases are too small to count."""
    return [p for p in module.parameters() if p.dim() == 2]


def _kv_bytes(cfg, dtype, slots: int) -> int:
    """Bytes of `slots` cached positions' keys and values over every layer (caches hold the model's dtype)."""
    item = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * slots * item


def _attention_flops(cfg, rows: int, keys: int, layers: int | None = None) -> int:
    """Scores and weighted values (2 products of head_dim per row and key) in every head of `layers` layers (all)."""
    layers = cfg.num_layers if layers is None else layers
    return 2 * 2 * layers * cfg.num_heads * cfg.head_dim * rows * keys


def verify_cost(target, rows: int, prefix: int, batch: int = 1) -> Cost:
    """One ragged verify forward of `batch` requests, each `rows` packed rows (their mean where they differ) behind
    a `prefix`-token cache, as decoding runs it (logits for every row): every weight matrix of the layers and the
    lm_head read once (the embedding rows it gathers are negligible), every request's cache of prefix + rows keys
    and values read once; the products for all rows and attention over the full prefix + rows keys."""
    mats = _matrices(target.model.layers) + [target.head_weight]
    weight_bytes = sum(w.numel() * w.element_size() for w in mats)
    params = sum(w.numel() for w in mats)
    keys = prefix + rows
    nbytes = weight_bytes + batch * _kv_bytes(target.cfg, target.dtype, keys)
    flops = 2 * params * rows * batch + batch * _attention_flops(target.cfg, rows, keys)
    return Cost(nbytes, flops)


def prefill_cost(target, rows: int) -> Cost:
    """A prompt of `rows` tokens read in one forward from an empty cache, as a round prefills it: every layer's
    matrices read once and multiplied by every row, the lm_head by the last row only (its logits give the first
    token), causal attention (row i over i + 1 keys), and the cache written once."""
    layer_mats = _matrices(target.model.layers)
    head = target.head_weight
    nbytes = (sum(w.numel() * w.element_size() for w in [*layer_mats, head])
              + _kv_bytes(target.cfg, target.dtype, rows))
    flops = (2 * sum(w.numel() for w in layer_mats) * rows + 2 * head.numel()
             + _attention_flops(target.cfg, 1, rows * (rows + 1) // 2))
    return Cost(nbytes, flops)


def draft_cost(drafter, target, prefix: int, batch: int = 1, ctx_rows: int = 0, depth: int | None = None) -> Cost:
    """One drafter pass of `batch` requests, as `propose_batch` runs it: each request's `ctx_rows` new context rows
    fused (fc) and projected to keys and values in every layer, its block of block_size rows through every layer
    but the last attending to its `prefix` cached context positions and the block, and in the last layer every
    block row's queries, keys and values but attention, output projection and MLP only for the `depth` rows the
    trees read (all L drafted positions when None), which then go through the head (the draft vocabulary's rows
    of the target's lm_head when the drafter has one, else the whole lm_head). Reads: every drafter matrix, that
    head and the cached context once. Where the drafter's native pass multiplies by int8 weights
    (native/forward.py), its matrices and head are read as one byte a weight, and its products count half their
    FLOPs: an AMX tile product does twice the int8 multiply-adds of a bf16 one in the same time, so the bf16 GEMM
    rate the floor divides by is half the int8 one."""
    c = drafter.cfg
    code = drafter.backend.built
    int8 = code is not None and code.int8
    block = c.num_draft_positions + 1  # [root, MASK x L]
    finished = c.num_draft_positions if depth is None else depth
    layer_mats = _matrices(drafter.layers)
    last = drafter.layers[-1].self_attn
    last_qkv = sum(w.numel() for w in (last.q_proj.weight, last.k_proj.weight, last.v_proj.weight))
    kv_params = sum(w.numel() for layer in drafter.layers
                    for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight))
    head = target.head_weight
    head_rows = head.shape[0] if drafter.draft_vocab is None else len(drafter.draft_vocab)
    head_params = head_rows * head.shape[1]
    fc = drafter.fc.weight
    matrices = [fc, *layer_mats]
    weight_bytes = (sum(w.numel() for w in matrices) + head_params if int8
                    else sum(w.numel() * w.element_size() for w in matrices) + head_params * head.element_size())
    nbytes = weight_bytes + batch * _kv_bytes(c, drafter.dtype, prefix)
    layers = sum(w.numel() for w in layer_mats)
    last_rest = sum(w.numel() for w in _matrices(drafter.layers[-1])) - last_qkv  # o, gate, up, down
    products = (2 * fc.numel() * ctx_rows + 2 * kv_params * ctx_rows + 2 * (layers - last_rest) * block
                + 2 * last_rest * finished + 2 * head_params * finished)
    keys = prefix + block
    per_request = ((products / 2 if int8 else products) + _attention_flops(c, block, keys, c.num_layers - 1)
                   + _attention_flops(c, finished, keys, 1))
    return Cost(nbytes, batch * per_request)
