"""`castspec probe`: time the real verify path (packed forward with the tree mask and cache, as decoding runs it)
over packed counts and prefix lengths, plus the drafter pass and host-side overhead h(N); write a CostProfile.
"""
from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from .cost import CostProfile, profile_key
from .batch import run_round, synchronize
from .config import DecodeConfig
from .sequence import Sequence, propose_batch
from .pack import pack_tree
from .tree import build_tree
from .verify import greedy_walk

DEFAULT_PACKED = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
QUICK_PACKED = (1, 2, 4, 8, 16, 32, 64)


def _median_ms(fn, reps: int, warmup: int, device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def engine_key(engine) -> dict:
    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu{torch.get_num_threads()}t"
    drafter = engine.drafter_source or "none"
    return profile_key(f"{dev.type}:{name}", str(engine.dtype).replace("torch.", ""), str(engine.source), drafter)


def _draft_shape(drafter, vocab: int, seed: int):
    """Block depth, a seeded generator and realistic tree shapes (best-first over peaked random marginals)."""
    L = drafter.cfg.num_draft_positions if drafter is not None else 15
    g = torch.Generator().manual_seed(seed)
    return L, g, torch.log_softmax(torch.randn(L, vocab, generator=g) * 4, dim=-1)


def probe(engine, packed=DEFAULT_PACKED, prefix_lens=(128, 512), reps: int = 5, warmup: int = 2,
          top_k: int = 8, progress: bool = True, seed: int = 0) -> CostProfile:
    target, drafter = engine.target, engine.drafter
    device = target.device
    V = target.cfg.vocab_size
    L, g, logprobs = _draft_shape(drafter, V, seed)
    verify_ms, draft_ms = [], []
    bar = tqdm(total=len(prefix_lens) * (len(packed) + 1), desc="probe", disable=not progress)
    with torch.inference_mode():
        for P in prefix_lens:
            prompt = torch.randint(0, V, (P,), generator=g).tolist()
            seq = Sequence(target, drafter, prompt, DecodeConfig(method="cast", max_new_tokens=2), max(packed))
            run_round(target, drafter, [seq], None, prefill_budget=P)
            taps = seq.taps
            row = []
            for n in packed:
                tree = build_tree(logprobs, n - 1, top_k)
                pack = pack_tree(tree, seq.root, P, device)

                def verify():
                    logits, _ = target(pack.ids, pack.positions, seq.cache, P, mask=pack.mask, taps=taps)
                    logits[0].argmax(-1).tolist()  # the host sync decoding pays too

                row.append(_median_ms(verify, reps, warmup, device))
                bar.update(1)
            verify_ms.append(row)
            if seq.draft is not None:
                ctx = seq.draft.pending
                keep = 3  # a typical round appends a few committed positions to the drafter's context

                def draft():
                    seq.draft.cache.length = P - keep
                    seq.draft.pending = ctx[:, -keep:]
                    seq.draft.propose(target, seq.root, L)

                seq.draft.propose(target, seq.root, L)  # fill the context cache once
                draft_ms.append(_median_ms(draft, reps, warmup, device))
            else:
                draft_ms.append(0.0)
            bar.update(1)
        host = {}
        cache_seq = Sequence(target, None, [0] * 8, DecodeConfig(method="ar", max_new_tokens=2), max(packed))
        for n in packed:
            width = n - 1

            def host_work():
                tree = build_tree(logprobs, width, top_k)
                pack_tree(tree, 0, 8, device)
                greedy_walk(tree, [0] * (width + 1))
                cache_seq.cache.compact(torch.arange(8, 8 + min(width, L) + 1, device=device), 8)

            host[str(width)] = _median_ms(host_work, reps, warmup, device)
    bar.close()
    return CostProfile(engine_key(engine), list(packed), list(prefix_lens), verify_ms, draft_ms, host)


def probe_batch(engine, profile: CostProfile, batch_sizes=(2, 4, 8, 16), per_request=(1, 2, 4, 8, 16, 32),
                prefix: int = 256, reps: int = 3, warmup: int = 1, top_k: int = 8, progress: bool = True,
                seed: int = 0) -> CostProfile:
    """Add batched shapes to `profile`: one ragged verify forward of B requests (prefix `prefix` each) with n
    packed tokens per request, l(B, B*n), and the batched drafter pass, as serving runs them."""
    target, drafter = engine.target, engine.drafter
    device = target.device
    V = target.cfg.vocab_size
    L, g, logprobs = _draft_shape(drafter, V, seed)
    bar = tqdm(total=len(batch_sizes) * (len(per_request) + 1), desc="probe (batched)", disable=not progress)
    cfg = DecodeConfig(method="cast", max_new_tokens=2)
    with torch.inference_mode():
        for B in batch_sizes:
            seqs = [Sequence(target, drafter, torch.randint(0, V, (prefix,), generator=g).tolist(), cfg,
                             max(per_request)) for _ in range(B)]
            run_round(target, drafter, seqs, None, prefill_budget=prefix * B)
            taps = seqs[0].taps
            totals, times = [], []
            for n in per_request:
                tree = build_tree(logprobs, n - 1, top_k)
                parts = [s.verify_segment(tree) for s in seqs]
                ids = torch.cat([pk.ids for pk, _ in parts], dim=1)
                pos = torch.cat([pk.positions for pk, _ in parts], dim=1)
                segs = [seg for _, seg in parts]

                def verify():
                    logits, _ = target.forward_segments(ids, pos, segs, taps=taps)
                    logits[0].argmax(-1).tolist()

                totals.append(B * n)
                times.append(_median_ms(verify, reps, warmup, device))
                bar.update(1)
            draft = 0.0
            if drafter is not None:
                states = [s.draft for s in seqs]
                ctx = [st.pending for st in states]
                keep = 3

                def draft_pass():
                    for st, c in zip(states, ctx):
                        st.cache.length = prefix - keep
                        st.pending = c[:, -keep:]
                    propose_batch(target, drafter, states, [s.root for s in seqs], [L] * B)

                draft = _median_ms(draft_pass, reps, warmup, device)
            bar.update(1)
            profile.batch[str(B)] = {"packed": totals, "verify_ms": times, "draft_ms": draft, "prefix": prefix}
    bar.close()
    return profile


def plot_profile(profile: CostProfile, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for P, row in zip(profile.prefix_lens, profile.verify_ms):
        ax.plot(profile.packed, row, marker="o", label=f"verify, prefix {P}")
    ax.plot(profile.packed, [profile.host_at(n - 1) for n in profile.packed], marker="x", label="host h(N)")
    for B, entry in sorted(profile.batch.items(), key=lambda kv: int(kv[0])):
        ax.plot(entry["packed"], entry["verify_ms"], marker=".", linestyle="--", label=f"verify, batch {B} (total)")
    ax.set_xlabel("packed tokens n = N + 1")
    ax.set_ylabel("ms")
    ax.set_title(f"{profile.key['device']} {profile.key['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
