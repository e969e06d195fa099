"""`castspec probe`: time the real verify path (packed forward with the tree mask and cache, as decoding runs it)
over packed counts and prefix lengths, plus the drafter pass and host-side overhead h(N); write a CostProfile.
Every measured shape gets its floor (castspec/floor.py) from the read and matmul rates measured in the same run,
and the ratio measured / floor.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from tqdm import tqdm

from .config import DecodeConfig
from .cost import BATCH_DRAFT_DEPTH, DRAFT_CONTEXT_ROWS, CostProfile, profile_key
from .floor import Floors, draft_cost, prefill_cost, verify_cost
from .native import build as native
from .native import forward as native_step
from .native.linear import packing_available
from .pack import pack_tree
from .round import greedy_tokens, run_round, synchronize
from .sequence import Sequence, propose_batch
from .tree import build_tree
from .verify import greedy_walk

DEFAULT_PACKED = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
QUICK_PACKED = (1, 2, 4, 8, 16, 32, 64)
# the batch sizes a scheduler's quick batched probe measures (Engine.cost_profile)
QUICK_BATCHES = (2, 4, 8, 16)
CONTEXT_PROBE_ROWS = 64  # context rows of the wider drafter pass that prices a pending context row
# the fewest repeats of a request's drafter pass: a short call, whose median over 5 moved by a fifth from one
# probe to the next
DRAFT_REPS = 25


def _medians_ms(fns: list[Callable[[], None]], reps: int, warmup: int, device,
                between: Callable[[], None] | None = None) -> list[float]:
    """The median time of each call over `reps` rounds that run every call once, in turn. Interleaved, not one
    shape after another: a shape timed back to back ran faster than it runs in decoding, where the call before it
    is another, which understated what more rows cost (docs/performance.md); and the machine's slow phases land
    on every shape alike instead of on whichever ran then. `between`, untimed, runs before every timed call:
    what precedes it in decoding (a verify forward, which streams the target's weights through the caches,
    before a drafter pass or a round's host work)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            if between is not None:
                between()
            synchronize(device)
            t = time.perf_counter()
            fn()
            synchronize(device)
            out.append((time.perf_counter() - t) * 1e3)
    return [statistics.median(t) for t in times]


def _median_ms(fn, reps: int, warmup: int, device, between: Callable[[], None] | None = None) -> float:
    return _medians_ms([fn], reps, warmup, device, between)[0]


def engine_key(engine) -> dict:
    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu{torch.get_num_threads()}t"
    if dev.type == "cpu" and packing_available(engine.dtype):
        name += "-packed"  # the packed linears changed every cost: profiles measured without them are stale
    if dev.type == "cpu" and native.library() is not None:
        # so did castspec's own kernels and native forwards (target and drafter), and so does every change to
        # their code or build: the library's key
        rows = native_step.max_rows(engine.dtype)  # the drafter's too (profiles of a capped drafter are stale)
        name += (f"-native{native.MAX_ROWS.get(engine.dtype, 0)}-rows{'any' if rows is None else rows}"
                 f"-gemm{'-amx' if native.library().gemm_amx_on() else ''}-{native.library_key()}")
        if native.int8_products():
            name += "-draft-int8"  # a drafter pass on int8 weights reads half the bytes
    if engine.target.graphs is not None:
        name += "-graphs"  # padded, captured forwards cost something else than eager ones (castspec/graphs.py)
    drafter = "none"
    if engine.drafter is not None:
        # the drafter's shape, not only where it came from: a retrained drafter at the same path (a new
        # release's shipped one) costs something else per pass, so its old profile must not be reused
        c = engine.drafter.cfg
        vocab = len(engine.drafter.draft_vocab) if engine.drafter.draft_vocab is not None else "full"
        drafter = (f"{engine.drafter_source}#layers={c.num_layers},block={c.block_size},hidden={c.hidden_size},"
                   f"vocab={vocab}")
    return profile_key(f"{dev.type}:{name}", str(engine.dtype).replace("torch.", ""), str(engine.source), drafter)


def _draft_shape(drafter, vocab: int, seed: int):
    """Block depth, a seeded generator and realistic tree shapes (best-first over peaked random marginals)."""
    L = drafter.cfg.num_draft_positions if drafter is not None else 15
    g = torch.Generator().manual_seed(seed)
    return L, g, torch.log_softmax(torch.randn(L, vocab, generator=g) * 4, dim=-1)


def _prefilled(target, drafter, prompt: list[int], max_nodes: int) -> Sequence:
    """A `cast` request for `prompt` with its prompt read in one round, as a request's first round reads it: the
    prefix the probe's verifies and drafter passes run behind."""
    s = Sequence(target, drafter, prompt, DecodeConfig(method="cast", max_new_tokens=2), max_nodes)
    run_round(target, drafter, [s], None, prefill_budget=len(prompt))
    return s


def _verify_call(target, seqs: list[Sequence], tree,
                 taps: tuple[int, ...] | None = None) -> Callable[[], torch.Tensor | None]:
    """One ragged verify forward of `tree` (or of a list of trees, one per sequence) behind every sequence's root,
    as `run_round` runs it (no commit), tapping `taps` (None: the sequences' own); the call returns the tapped
    features."""
    trees = tree if isinstance(tree, list) else [tree] * len(seqs)
    parts = [s.verify_segment(t) for s, t in zip(seqs, trees)]
    ids = torch.cat([pack.ids for pack, _ in parts], dim=1)
    pos = torch.cat([pack.positions for pack, _ in parts], dim=1)
    segments = [seg for _, seg in parts]
    taps = seqs[0].taps if taps is None else taps

    def verify():
        logits, feats = target.forward_segments(ids, pos, segments, taps=taps)
        greedy_tokens(logits[0])  # the host sync decoding pays too
        return feats

    return verify


def _draft_calls(target, drafter, seqs: list[Sequence], depth: int) -> Callable[[int], Callable[[], None]]:
    """Batched drafter passes as a typical round runs them: the context caches are filled once; the callable
    returned gives, for `keep` new context rows, a pass that drafts after `keep` new committed positions (the
    rest of the context is already cached)."""
    states = [s.draft for s in seqs]
    ctx = [st.pending for st in states]
    ends = [st.cache.length + c.shape[1] for st, c in zip(states, ctx)]
    roots = [s.root for s in seqs]
    propose_batch(target, drafter, states, roots, [depth] * len(seqs))  # fill the context caches once

    def with_context(keep: int = DRAFT_CONTEXT_ROWS) -> Callable[[], None]:
        def draft():
            for st, c, end in zip(states, ctx, ends):
                st.cache.length = end - keep
                st.pending = c[:, -keep:]
            propose_batch(target, drafter, states, roots, [depth] * len(seqs))

        return draft

    return with_context


def _draft_timings(target, drafter, seqs: list[Sequence], depth: int, prefix: int, reps: int,
                   warmup: int, step: Callable[[], None]) -> tuple[float, float, float]:
    """The batched drafter pass of `seqs` as rounds run it, after `step` (the verify that precedes it in
    decoding: its weights then come from memory, not from cache), and what each further pending context row
    adds to it (from the same pass with up to CONTEXT_PROBE_ROWS context rows per request), each timed right after
    a timed `step`: (ms, ms per context row, step ms). The step's median from the same loop prices the pass against
    the verify it follows, free of the machine's drift between two loops."""
    passes, wide = _draft_calls(target, drafter, seqs, depth), min(CONTEXT_PROBE_ROWS, prefix)
    step_ms, ms, _, wide_ms = _medians_ms([step, passes(), step, passes(wide)], reps, warmup, target.device)
    return ms, max(wide_ms - ms, 0.0) / max(len(seqs) * (wide - DRAFT_CONTEXT_ROWS), 1), step_ms


def _top_chain_picks(tree) -> list[int]:
    """The target's token at every pack row of `tree` for a walk down its top chain: each row's first child."""
    picks = [-1] * (len(tree) + 1)
    for token, parent in zip(reversed(tree.tokens), reversed(tree.parents)):
        picks[parent + 1] = token  # reversed: the first child (best-first order) is written last
    return picks


def probe(engine, packed=DEFAULT_PACKED, prefix_lens=(128, 512), reps: int = 5, warmup: int = 2,
          top_k: int = 8, progress: bool = True, seed: int = 0) -> CostProfile:
    target, drafter = engine.target, engine.drafter
    device = target.device
    V = target.cfg.vocab_size
    L, g, logprobs = _draft_shape(drafter, V, seed)
    verify_ms, draft_ms, prefill_ms, context_ms, draft_step_ms = [], [], [], [], []
    bar = tqdm(total=len(prefix_lens) * (len(packed) + 1), desc="probe", disable=not progress)
    with torch.inference_mode():
        floors = Floors.measure(device, target.dtype)
        for P in prefix_lens:
            prompt = torch.randint(0, V, (P,), generator=g).tolist()

            def prefill() -> Sequence:
                return _prefilled(target, drafter, prompt, max(packed))

            prefill_ms.append(_median_ms(prefill, reps, warmup, device))
            seq = prefill()  # the prefix every verify below runs behind
            calls = [_verify_call(target, [seq], build_tree(logprobs, n - 1, top_k)) for n in packed]
            verify_ms.append(_medians_ms(calls, reps, warmup, device))
            bar.update(len(packed))
            step = calls[0]  # a verify (the curve's first shape): what runs before a round's host work and pass
            if seq.draft is None:
                draft_ms.append(0.0)
            else:
                ms, per_row, step_ms = _draft_timings(target, drafter, [seq], L, P, max(reps, DRAFT_REPS), warmup,
                                                      step)
                draft_ms.append(ms)
                context_ms.append(per_row)
                draft_step_ms.append(step_ms)
            bar.update(1)
            del seq  # castspec/graphs.py lends its static cache to one live sequence: the next prefix's
        host = {}
        cache_seq = Sequence(target, None, [0] * 8, DecodeConfig(method="ar", max_new_tokens=2), max(packed))
        # trees from the marginals real rounds build them from: on the device, and over the drafter's draft
        # vocabulary (its columns and their token ids) where it has one
        support = drafter.draft_vocab if drafter is not None else None
        host_lp = (logprobs if support is None else
                   torch.log_softmax(torch.randn(L, len(support), generator=g) * 4, dim=-1)).to(device)
        for n in packed:
            width = n - 1
            picks = _top_chain_picks(build_tree(host_lp, width, top_k, support=support))

            def host_work():  # a round that accepts its tree's top chain: the longest walk, a real compaction
                tree = build_tree(host_lp, width, top_k, support=support)
                pack_tree(tree, 0, 8, device)
                path, _ = greedy_walk(tree, picks)
                cache_seq.cache.keep_rows(8, [0, *path])

            host[str(width)] = _median_ms(host_work, reps, warmup, device, step)
        floors = floors.best(Floors.measure(device, target.dtype))  # read again after the timings: the better
    bar.close()
    profile = CostProfile(engine_key(engine), list(packed), list(prefix_lens), verify_ms, draft_ms, host,
                          prefill_ms=prefill_ms, draft_context_ms=context_ms or None,
                          draft_step_ms=draft_step_ms if drafter is not None and packed[0] == 1 else None)
    profile.floor = _floor_fields(engine, floors, profile)
    return profile


def _floor_fields(engine, floors: Floors, profile: CostProfile) -> dict:
    """The floor and measured / floor of every single-request shape in `profile` (CostProfile.floor)."""
    target, drafter = engine.target, engine.drafter
    verify_floor = [[verify_cost(target, n, P).floor_ms(floors) for n in profile.packed] for P in profile.prefix_lens]
    draft_floor = [draft_cost(drafter, target, P, ctx_rows=DRAFT_CONTEXT_ROWS).floor_ms(floors) if drafter else None
                   for P in profile.prefix_lens]
    prefill_floor = [prefill_cost(target, P).floor_ms(floors) for P in profile.prefix_lens]
    return {"read_gbps": floors.read_gbps, "gemm_gflops": floors.gemm_gflops, "verify_floor_ms": verify_floor,
            "verify_ratio": [_ratios(m, f) for m, f in zip(profile.verify_ms, verify_floor)],
            # verify(n) / verify(1), measured and at the floor: the floor's is the least this machine allows at
            # the rates of this run (above 1 where n rows' FLOPs outlast one row's weight read)
            "verify_over_one_row": [_over_one_row(profile.packed, m) for m in profile.verify_ms],
            "verify_floor_over_one_row": [_over_one_row(profile.packed, f) for f in verify_floor],
            "draft_floor_ms": draft_floor, "draft_ratio": _ratios(profile.draft_ms, draft_floor),
            # the pass over one row's verify: measured against the verify timed before it in the same loop, and at
            # the floor
            "draft_over_one_row": (None if not profile.draft_step_ms else
                                   [d / s for d, s in zip(profile.draft_ms, profile.draft_step_ms)]),
            "draft_floor_over_one_row": (None if drafter is None or 1 not in profile.packed else
                                         [d / v[profile.packed.index(1)] for d, v in zip(draft_floor, verify_floor)]),
            "prefill_floor_ms": prefill_floor, "prefill_ratio": _ratios(profile.prefill_ms, prefill_floor)}


def _over_one_row(packed: list[int], times: list[float]) -> list[float] | None:
    """Each shape's time over the 1-row shape's (None when 1 row was not measured)."""
    if 1 not in packed:
        return None
    one = times[packed.index(1)]
    return [t / one for t in times]


def _ratios(measured: list[float], floors: list[float | None]) -> list[float | None]:
    """measured / floor per shape (None where there is no floor: no drafter pass)."""
    return [None if f is None else m / f for m, f in zip(measured, floors)]


def probe_batch(engine, profile: CostProfile, batch_sizes=(2, 4, 8, 16), per_request=(1, 2, 4, 8, 16, 32),
                prefix: int = 256, reps: int = 3, warmup: int = 1, top_k: int = 8, progress: bool = True,
                seed: int = 0) -> CostProfile:
    """Add batched shapes to `profile`: one ragged verify forward of B requests (prefix `prefix` each) with n
    packed tokens per request, l(B, B*n), and the batched drafter pass, as serving runs them; each with its floor
    at the rates `probe` measured (measured now for a profile without them). Beside the B*n totals, B + 1: one
    request's one-node tree behind the others' roots. A round's first tree node can cost far more than the next
    ones (on AMX a 17th row starts a second tile of 16 rows, which the next 15 rows fill almost free), and
    without that point the profile would spread the step over the nodes up to 2B."""
    target, drafter = engine.target, engine.drafter
    device = target.device
    floors = (Floors(profile.floor["read_gbps"], profile.floor["gemm_gflops"]) if profile.floor
              else Floors.measure(device, target.dtype))
    V = target.cfg.vocab_size
    L, g, logprobs = _draft_shape(drafter, V, seed)
    bar = tqdm(total=len(batch_sizes) * (len(per_request) + 1), desc="probe (batched)", disable=not progress)
    cfg = DecodeConfig(method="cast", max_new_tokens=2)
    with torch.inference_mode():
        for B in batch_sizes:
            seqs = [Sequence(target, drafter, torch.randint(0, V, (prefix,), generator=g).tolist(), cfg,
                             max(per_request)) for _ in range(B)]
            run_round(target, drafter, seqs, None, prefill_budget=prefix * B)
            shapes = [(B * n, build_tree(logprobs, n - 1, top_k)) for n in per_request]
            if 1 in per_request and B > 1:  # a point between B and 2B
                one = [build_tree(logprobs, 1, top_k)] + [build_tree(logprobs, 0, top_k)] * (B - 1)
                shapes.insert(per_request.index(1) + 1, (B + 1, one))
            totals = [total for total, _ in shapes]
            calls = [_verify_call(target, seqs, tree) for _, tree in shapes]
            times = _medians_ms(calls, reps, warmup, device)
            bar.update(len(per_request))
            # the batched pass as the cost policy's rounds under load start out: finishing BATCH_DRAFT_DEPTH rows
            depth = min(L, BATCH_DRAFT_DEPTH)
            draft, context, _ = (_draft_timings(target, drafter, seqs, depth, prefix, reps, warmup, calls[0])
                                 if drafter else (0.0, 0.0, 0.0))
            bar.update(1)
            verify_floor = [verify_cost(target, total / B, prefix, B).floor_ms(floors) for total in totals]
            draft_floor = (draft_cost(drafter, target, prefix, B, DRAFT_CONTEXT_ROWS, depth).floor_ms(floors)
                           if drafter else None)
            profile.batch[str(B)] = {
                "packed": totals, "verify_ms": times, "draft_ms": draft, "draft_depth": depth,
                "draft_context_ms": context, "prefix": prefix,
                "read_gbps": floors.read_gbps, "gemm_gflops": floors.gemm_gflops,
                "verify_floor_ms": verify_floor, "verify_ratio": _ratios(times, verify_floor),
                "draft_floor_ms": draft_floor, "draft_ratio": _ratios([draft], [draft_floor])[0]}
    bar.close()
    return profile


def plot_profile(profile: CostProfile, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    floor_rows = profile.floor["verify_floor_ms"] if profile.floor else [None] * len(profile.prefix_lens)
    for P, row, floor in zip(profile.prefix_lens, profile.verify_ms, floor_rows):
        (line,) = ax.plot(profile.packed, row, marker="o", label=f"verify, prefix {P}")
        if floor is not None:  # the machine's limit for the same shapes, in the same colour
            ax.plot(profile.packed, floor, linestyle="--", color=line.get_color(), label=f"floor, prefix {P}")
    ax.plot(profile.packed, [profile.host_at(n - 1) for n in profile.packed], marker="x", label="host h(N)")
    for B, entry in sorted(profile.batch.items(), key=lambda kv: int(kv[0])):
        ax.plot(entry["packed"], entry["verify_ms"], marker=".", linestyle=":", label=f"verify, batch {B} (total)")
    ax.set_xlabel("packed tokens n = N + 1")
    ax.set_ylabel("ms")
    ax.set_title(f"{profile.key['device']} {profile.key['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
