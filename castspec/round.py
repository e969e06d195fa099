"""One decoding round for any number of sequences: the single round loop behind `decode`, the scheduler and
the server.

`run_round` is four steps:
  draft    one batched drafter pass for every sequence that drafts; the policy turns the marginals into trees
           (over the drafter's draft vocabulary where it has one: the trees read its support, sampling the full
           vocabulary)
  lay out  the rows of ONE ragged target forward: prompt chunks of newcomers and the packs [root, tree] of
           running sequences, each against its own cache with its own mask
  forward  that target forward
  commit   every sequence walks its rows and keeps what the target accepts
With one sequence this is exactly the paper's round; `ar` is the round with an empty tree and `chain` the top-1
tree. The result holds one SequenceOutput per input sequence, in the input's order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .allocate import Policy
from .config import DecodeConfig
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter
from .models.kvcache import Segment
from .native import build as native
from .sequence import Sequence, propose_batch
from .tree import Marginals, Tree


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SequenceOutput:
    """One sequence's part of a round."""

    emitted: list[int] = field(default_factory=list)  # tokens committed this round (after stop handling)
    accepted: int | None = None  # drafted tokens accepted; None when the sequence verified nothing this round
    tree: Tree | None = None  # the verified tree (empty in a round without a draft)
    path: list[int] = field(default_factory=list)  # the accepted pack rows
    draft_marginals: Marginals | None = None  # the drafter's marginals when it drafted
    token_logprobs: list = field(default_factory=list)  # sampling.TokenLogprob per emitted token (cfg.logprobs)
    error: Exception | None = None  # its own failure after the shared forward (the sequence is then done)

    @property
    def verified(self) -> bool:
        return self.accepted is not None

    @property
    def draft_logprobs(self) -> torch.Tensor | None:
        """The drafter's marginals over the whole vocabulary [depth, V] when it drafted (made on first use)."""
        return None if self.draft_marginals is None else self.draft_marginals.full


@dataclass
class RoundOutput:
    sequences: list[SequenceOutput]  # one per input sequence, in order
    packed: int = 0  # rows in the target forward
    prefill_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    host_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.draft_ms + self.verify_ms + self.host_ms


@dataclass
class Part:
    """One sequence's rows in the forward: a prompt chunk (tree None) or a pack [root, tree]."""

    index: int  # of the sequence in the round's input
    start: int  # its first row
    length: int
    tree: Tree | None
    last_chunk: bool = False  # a prompt chunk that completes the prompt: its last row's logits are read

    @property
    def logit_rows(self) -> int:
        """How many of its rows, the last ones, have their logits read."""
        return self.length if self.tree is not None else int(self.last_chunk)


@dataclass
class Rows:
    """The input of the round's one target forward."""

    ids: torch.Tensor  # [1, rows]
    positions: torch.Tensor  # [1, rows]
    segments: list[Segment]  # one per part, in row order
    logit_rows: torch.Tensor | None  # the rows whose logits are read (None: all of them)
    parts: list[Part]
    taps: tuple[int, ...]  # the drafter's tapped target layers (empty when nobody drafts)
    prefill_tokens: int

    def __len__(self) -> int:
        return self.ids.shape[1]


def run_round(target: Decoder, drafter: DFlashDrafter | None, seqs: list[Sequence], policy: Policy | None,
              prefill_budget: int = 512) -> RoundOutput:
    """Advance every sequence in `seqs` by one round. Sequences still reading their prompt get up to
    `prefill_budget` prompt tokens in all (first come first served); the others verify a tree. The policy
    decides whether this round drafts at all (`Policy.should_draft`); without one nobody drafts."""
    out = RoundOutput([SequenceOutput() for _ in seqs])
    clock = time.perf_counter
    t = clock()
    marginals = draft(target, drafter, seqs, policy)
    drafted = any(m is not None for m in marginals)
    if drafted:
        out.draft_ms = (clock() - t) * 1e3
    for o, m in zip(out.sequences, marginals):
        o.draft_marginals = m

    t = clock()
    trees = plan_trees(policy, seqs, marginals)
    rows = lay_out(target.device, seqs, trees, prefill_budget)
    out.host_ms += (clock() - t) * 1e3
    if rows is None:
        return out
    out.packed, out.prefill_tokens = len(rows), rows.prefill_tokens

    t = clock()
    logits, feats, greedy = forward(target, rows)
    out.verify_ms = (clock() - t) * 1e3

    t = clock()
    commit(seqs, rows, logits, feats, greedy, out.sequences, policy)
    synchronize(target.device)
    out.host_ms += (clock() - t) * 1e3
    verified = [o.accepted for o in out.sequences if o.verified]
    # a round that also reads a newcomer's prompt says little about drafting: its time is mostly that prompt's
    if policy is not None and verified and not out.prefill_tokens:
        policy.update(sum(verified) + len(verified), out.total_ms, drafted=drafted, requests=len(verified))
    return out


def draft(target: Decoder, drafter: DFlashDrafter | None, seqs: list[Sequence],
          policy: Policy | None) -> list[Marginals | None]:
    """Step 1: one batched drafter pass for the running sequences that draft this round. Returns each
    sequence's marginals [depth, V] with their support (None for those that do not draft)."""
    marginals: list[Marginals | None] = [None] * len(seqs)
    drafting = [i for i, s in enumerate(seqs) if s.decoding and s.wants_draft()] if policy is not None else []
    if not drafting or not policy.should_draft(len(drafting), sum(seqs[i].draft.pending_rows for i in drafting),
                                               prefilling=any(s.reading_prompt for s in seqs),
                                               horizon=sum(seqs[i].remaining for i in drafting)):
        return marginals
    chosen = [seqs[i] for i in drafting]
    L = drafter.cfg.num_draft_positions
    depth = L if len(chosen) == 1 else policy.draft_depth(len(chosen), L)
    drafts = propose_batch(target, drafter, [s.draft for s in chosen], [s.root for s in chosen],
                           [min(depth, s.remaining - 1) for s in chosen])
    synchronize(target.device)
    for i, m in zip(drafting, drafts):
        marginals[i] = m
    return marginals


def plan_trees(policy: Policy | None, seqs: list[Sequence], marginals: list[Marginals | None]) -> list[Tree]:
    """Step 1 (cont.): the policy's tree for every sequence that drafted; an empty tree for the others. Trees
    read the marginals on their support (the top K of a draft vocabulary's columns, not of the whole vocabulary)."""
    trees = [Tree.empty() for _ in seqs]
    drafted = [i for i, m in enumerate(marginals) if m is not None]
    if drafted:
        planned = policy.allocate([marginals[i].on_support for i in drafted], [seqs[i].prefix_len for i in drafted],
                                  [marginals[i].support for i in drafted])
        for i, tree in zip(drafted, planned):
            trees[i] = tree
    return trees


def lay_out(device: torch.device, seqs: list[Sequence], trees: list[Tree], prefill_budget: int) -> Rows | None:
    """Step 2: every unfinished sequence's rows, one after the other: the next prompt chunk of a sequence still
    reading its prompt (while `prefill_budget` lasts), else its pack [root, tree]. None when no row is left."""
    ids, positions, segments, logit_rows, parts = [], [], [], [], []
    row, budget = 0, prefill_budget
    for i, (s, tree) in enumerate(zip(seqs, trees)):
        if s.done:
            continue
        if s.reading_prompt:
            if budget <= 0:
                continue
            chunk_ids, chunk_pos, seg = s.prefill_segment(budget)
            budget -= seg.length
            part = Part(i, row, seg.length, None, last_chunk=s.prefilled + seg.length == len(s.prompt))
        else:
            pack, seg = s.verify_segment(tree)
            chunk_ids, chunk_pos = pack.id_list, pack.position_list
            part = Part(i, row, seg.length, tree)
        logit_rows.extend(range(row + part.length - part.logit_rows, row + part.length))
        ids.extend(chunk_ids)
        positions.extend(chunk_pos)
        segments.append(seg)
        parts.append(part)
        row += seg.length
    if not parts:
        return None
    taps = next((seqs[p.index].taps for p in parts if seqs[p.index].taps), ())
    ids_positions = torch.tensor([ids, positions], dtype=torch.long, device=device)  # one tensor made, not two
    return Rows(ids=ids_positions[:1], positions=ids_positions[1:],
                segments=segments,
                # every row needs logits in pure verify rounds: skip the gather then
                logit_rows=None if len(logit_rows) == row else torch.tensor(logit_rows, dtype=torch.long,
                                                                             device=device),
                parts=parts, taps=taps,
                prefill_tokens=sum(p.length for p in parts if p.tree is None))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of logits [rows, V] (the first of tied maxima, as torch's): for fp32 rows on the
    CPU through castspec's C library (one pass a row, rows over both threads), else numpy's, whose argmax over a
    49k-token row took a tenth of torch's (docs/performance.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        fast = native.argmax_rows(logits)
        return fast if fast is not None else logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def forward(target: Decoder, rows: Rows) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Step 3: the one target forward. Returns the logits of the read rows [rows read, V], the tapped hidden
    states of every row (None without taps) and the greedy token of each read row."""
    logits, feats = target.forward_segments(rows.ids, rows.positions, rows.segments, rows.logit_rows, rows.taps)
    logits = logits[0]
    greedy = greedy_tokens(logits)  # the one device->host sync of the verify step
    return logits, feats, greedy


def commit(seqs: list[Sequence], rows: Rows, logits: torch.Tensor, feats: torch.Tensor | None, greedy: list[int],
           outs: list[SequenceOutput], policy: Policy | None) -> None:
    """Step 4: each sequence reads its rows: a prompt chunk is accounted (the last one yields the first token),
    a pack is walked and its accepted path kept in the caches. Fills `outs` (aligned with `seqs`)."""
    lrow = 0  # index into the read logits rows
    for part in rows.parts:
        s, o, n = seqs[part.index], outs[part.index], part.length
        f = feats[:, part.start:part.start + n] if feats is not None and s.draft is not None else None
        try:  # one sequence's failure after the shared forward must not lose the others' committed tokens
            if part.tree is None:
                last = part.last_chunk
                o.emitted = s.finish_prefill_chunk(n, logits[lrow] if last else None, greedy[lrow] if last else None,
                                                   f)
            else:
                o.emitted, o.path = s.commit(part.tree, logits[lrow:lrow + n], greedy[lrow:lrow + n], f,
                                             o.draft_marginals)
                o.accepted, o.tree = len(o.path), part.tree
                if policy is not None and len(part.tree):
                    policy.observe(part.tree, o.path)
            if s.cfg.logprobs is not None:
                o.token_logprobs = s.new_logprobs
        except Exception as e:  # noqa: BLE001 - reported per sequence
            s.done = True
            o.error = e
        lrow += part.logit_rows


def warm_up(target: Decoder, drafter: DFlashDrafter | None) -> None:
    """A scratch round on a few tokens, and a drafter pass where there is a drafter, on caches of their own:
    what the first request of this thread would otherwise pay once (the drafter's native code built, this
    thread's OpenMP workers started; the first drafter pass costs tens of times a later one)."""
    with torch.inference_mode():
        seq = Sequence(target, drafter, [0] * 8, DecodeConfig(method="cast" if drafter else "ar", max_new_tokens=2),
                       1)
        run_round(target, drafter, [seq], None, prefill_budget=8)
        if drafter is not None:
            propose_batch(target, drafter, [seq.draft], [seq.root], [1])
    synchronize(target.device)
