"""One decoding round for any number of sequences: the single round loop behind `decode`, the scheduler and
the server.

A round (1) drafts, in one batched drafter pass, for every sequence that has a pending root, (2) lets the
allocation policy turn the drafted marginals into one tree per sequence, (3) runs ONE ragged target forward
over every sequence's rows — prompt chunks of newcomers and the packs [root, tree] of running sequences, each
against its own cache with its own mask — and (4) walks and commits every sequence. With one sequence this
is exactly the paper's round; `ar` is the round with an empty tree and `chain` the top-1 tree.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .allocate import Policy
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter
from .sequence import Sequence, propose_batch
from .tree import Tree


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RoundOutput:
    emitted: dict[int, list[int]] = field(default_factory=dict)  # id(sequence) -> tokens committed this round
    accepted: dict[int, int] = field(default_factory=dict)  # id(sequence) -> accepted drafted tokens (verified only)
    trees: dict[int, Tree] = field(default_factory=dict)
    logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    paths: dict[int, list[int]] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)  # id(sequence) -> its own failure after the forward
    token_logprobs: dict[int, list] = field(default_factory=dict)  # id(sequence) -> TokenLogprob per emitted token
    packed: int = 0  # rows in the target forward
    prefill_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    host_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.host_ms


def run_round(target: Decoder, drafter: DFlashDrafter | None, seqs: list[Sequence], policy: Policy | None,
              prefill_budget: int = 512) -> RoundOutput:
    """Advance every sequence in `seqs` by one round. Sequences still reading their prompt get up to
    `prefill_budget` prompt tokens in all (first come first served); the others verify a tree. The policy
    decides whether this round drafts at all (`Policy.should_draft`); without one nobody drafts."""
    out = RoundOutput()
    device = target.device
    clock = time.perf_counter
    running = [s for s in seqs if s.decoding]
    drafting = [s for s in running if s.wants_draft()] if policy is not None else []
    if drafting and not policy.should_draft():
        drafting = []
    trees: dict[int, Tree] = {}
    t = clock()
    if drafting:
        L = drafter.cfg.num_draft_positions
        lps = propose_batch(target, drafter, [s.draft for s in drafting], [s.root for s in drafting],
                            [min(L, s.remaining - 1) for s in drafting])
        synchronize(device)
        out.draft_ms = (clock() - t) * 1e3
        th = clock()
        for s, lp, tree in zip(drafting, lps, policy.allocate(lps, [s.prefix_len for s in drafting])):
            trees[id(s)] = tree
            out.logprobs[id(s)] = lp
        out.host_ms += (clock() - th) * 1e3

    th = clock()
    ids, positions, segments, logit_rows = [], [], [], []
    work = []  # (sequence, kind, rows in the forward, extra)
    row = 0
    budget = prefill_budget
    for s in seqs:
        if s.done:
            continue
        if s.root is None:  # still reading the prompt
            if budget <= 0:
                continue
            chunk_ids, chunk_pos, seg = s.prefill_segment(budget)
            budget -= seg.length
            last = s.prefilled + seg.length == len(s.prompt)
            if last:
                logit_rows.append(row + seg.length - 1)
            work.append((s, "prefill", row, seg.length, last))
            out.prefill_tokens += seg.length
        else:
            tree = trees.get(id(s), Tree.empty())
            pack, seg = s.verify_segment(tree)
            chunk_ids, chunk_pos = pack.ids[0].tolist(), pack.positions[0].tolist()
            logit_rows.extend(range(row, row + seg.length))
            work.append((s, "verify", row, seg.length, tree))
        ids.extend(chunk_ids)
        positions.extend(chunk_pos)
        segments.append(seg)
        row += seg.length
    if not segments:
        return out
    out.packed = row
    taps = next((s.taps for s, *_ in work if s.taps), ())  # the drafter's tapped layers, when anyone drafts
    ids_t = torch.tensor([ids], dtype=torch.long, device=device)
    pos_t = torch.tensor([positions], dtype=torch.long, device=device)
    # every row needs logits in pure verify rounds: skip the gather then
    rows_t = None if len(logit_rows) == row else torch.tensor(logit_rows, dtype=torch.long, device=device)
    out.host_ms += (clock() - th) * 1e3

    tv = clock()
    logits, feats = target.forward_segments(ids_t, pos_t, segments, rows_t, taps)
    logits = logits[0]
    greedy = logits.argmax(dim=-1).tolist()  # the one device->host sync of the verify step
    out.verify_ms = (clock() - tv) * 1e3

    th = clock()
    lrow = 0  # index into the logits rows
    for s, kind, start, n, extra in work:
        f = feats[:, start:start + n] if feats is not None and s.draft is not None else None
        rows = 1 if kind == "prefill" and extra else (n if kind == "verify" else 0)
        try:  # one sequence's failure after the shared forward must not lose the others' committed tokens
            if kind == "prefill":
                last = extra
                out.emitted[id(s)] = s.finish_prefill_chunk(n, logits[lrow] if last else None,
                                                            greedy[lrow] if last else None, f)
            else:
                tree = extra
                emitted, path = s.commit(tree, logits[lrow:lrow + n], greedy[lrow:lrow + n], f,
                                         out.logprobs.get(id(s)))
                out.emitted[id(s)] = emitted
                out.accepted[id(s)] = len(path)
                out.trees[id(s)] = tree
                out.paths[id(s)] = path
                if policy is not None and len(tree):
                    policy.observe(tree, path)
            if s.cfg.logprobs is not None:
                out.token_logprobs[id(s)] = s.new_logprobs
        except Exception as e:  # noqa: BLE001 - reported per sequence
            s.done = True
            out.errors[id(s)] = e
        lrow += rows
    synchronize(device)
    out.host_ms += (clock() - th) * 1e3
    if policy is not None and out.accepted:
        policy.update(sum(out.accepted.values()) + len(out.accepted), out.total_ms, drafted=bool(drafting))
    return out
