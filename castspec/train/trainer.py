"""DFlash-style drafter training on the target's own responses.

Each step takes a few sequences; for each one the frozen target computes the tapped features in one forward,
random anchors over the response pick the blocks, and the drafter learns to predict x_{a+1..a+L} from the
context strictly before the anchor and its own block (bidirectional). Embedding and lm_head are the target's,
frozen. AdamW with warmup + cosine decay, gradient clipping, bf16 autocast on CPUs with native bf16.
Checkpoints hold model, optimizer, scheduler, data cursor and every RNG, so a resumed run continues exactly.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from ..config import DrafterConfig, default_tap_layers
from ..models.decoder import Decoder
from ..models.dflash import DFlashDrafter
from ..models.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
from ..models.load import save_drafter
from .blocks import (block_inputs, block_mask, chain_acceptance, decay_weights, parse_window_schedule, sample_anchors,
    teacher_rows, window_at)
from .distributed import Ranks

log = logging.getLogger("castspec.train")
# a sequence's block rows attend in groups of this many blocks, each group over the context and its own rows
# (DraftSegment.group_rows): the other blocks' keys, which the block mask hides, are then never scored
ATTENTION_GROUP_BLOCKS = 8


class TrainError(RuntimeError):
    """Training cannot start or resume; the message says why."""


@dataclass
class TrainConfig:
    steps: int = 2000
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    block_size: int = 16
    num_layers: int = 3
    num_taps: int = 3
    mask_token_id: int = 16
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 7.0
    max_seq_len: int = 768
    seed: int = 0
    bf16: bool = True
    init_from_target: bool = False  # start drafter layers from the target's last layers (same shapes)
    # final norm at start: "target" copies the target's final norm (the drafter's rows go through the target's
    # lm_head, like its last hidden states); "small" starts near-flat logits (slow: Adam grows it ~lr per step)
    norm_init: str = "target"
    init_from: str | None = None  # warm start: an existing drafter directory (same shapes, or grown: warm_start)
    # fc at start: "scaled" divides each input column by the typical size of that tapped feature (measured on
    # a few training sequences), so the few huge dimensions of the target's hidden states do not drown the rest
    fc_init: str = "plain"
    checkpoint_every: int = 100
    export_every: int = 500
    tap_layers: list[int] = field(default_factory=list)
    # curriculum "W:STEP,...": blocks see only the last W context rows until STEP. With the whole context from
    # step 0, a block row's attention starts spread over hundreds of context rows, so the root and the last
    # rows (what predicts the next tokens) get ~1/T of it and the drafter learns a topic average first
    context_windows: str = ""
    # the loss: (1 - kl_weight) x cross-entropy on the target's tokens + kl_weight x KL(target || drafter) over
    # the whole vocabulary (or the draft vocabulary) at each block position. The target's full distribution says
    # how close the runners-up were, which a tree's siblings and sampled decoding use; one-hot labels do not
    kl_weight: float = 0.0
    # a drafter directory whose draft vocabulary (models/draft_vocab.py) the drafter is trained on: the loss is
    # over those tokens alone, normalized over them as decoding normalizes q (labels outside it are ignored),
    # the head product reads a fraction of the target's lm_head, and the exports carry the vocabulary
    draft_vocab: str | None = None
    # the share of sequences whose blocks are cut to `short_block_rows` rows (root + masks): a block's rows attend to
    # each other both ways, so a drafter trained on whole blocks alone drafts poorly from a cut one, and a batched
    # pass whose trees read only a block's first positions could run cut blocks (a pass for many requests is compute)
    short_blocks: float = 0.0
    short_block_rows: int = 3


def drafter_config_for(target: Decoder, cfg: TrainConfig, rope: dict) -> DrafterConfig:
    t = target.cfg
    taps = cfg.tap_layers or default_tap_layers(t.num_layers, cfg.num_taps)
    return DrafterConfig(hidden_size=t.hidden_size, num_layers=cfg.num_layers, num_heads=t.num_heads,
                         num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                         rms_norm_eps=t.rms_norm_eps, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                         target_layer_ids=taps, num_target_layers=t.num_layers, rope_parameters=dict(rope),
                         max_positions=t.max_positions, vocab_size=t.vocab_size,
                         short_block_rows=cfg.short_block_rows if cfg.short_blocks > 0 else 0)


def init_drafter(target: Decoder, dcfg: DrafterConfig, from_target: bool, seed: int,
                 norm_init: str = "target") -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(dcfg, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
        if from_target:
            src = target.model.layers[-dcfg.num_layers:]
            for dst, s in zip(d.layers, src):
                # Copy the target's last layers into the drafter's: they already map hidden states to
                # next-token-ready states, which cuts the steps needed. (qk norms start at 1, as Qwen3's do.)
                dst.self_attn.qkv_weight.copy_(s.self_attn.qkv_weight.float())
                dst.self_attn.o_proj.weight.copy_(s.self_attn.o_proj.weight.float())
                dst.mlp.gate_up_weight.copy_(s.mlp.gate_up_weight.float())
                dst.mlp.down_proj.weight.copy_(s.mlp.down_proj.weight.float())
                dst.input_layernorm.weight.copy_(s.input_layernorm.weight.float())
                dst.post_attention_layernorm.weight.copy_(s.post_attention_layernorm.weight.float())
        if norm_init == "target":
            # The logit scale is set by this norm alone (what comes before it is RMS-normalized): starting from
            # the target's own final norm gives the drafter the target's confidence range from step 0. A small
            # start (below) caps the logit scale for ~1/lr steps; the first shipped drafter lost most of its
            # 750 steps to that (its norm grew from 0.03 to 0.29; the target's is 1.8).
            d.norm.weight.copy_(target.model.norm.weight.float())
        elif norm_init == "ones":
            pass  # RMSNorm's own default, as the public (SpecForge) recipe starts
        else:
            # At step 0 a block row is little more than its input embedding, which the tied lm_head scores
            # against itself: a small norm keeps the first logits nearly flat (spread ~0.1)
            spread = target.head_weight.float().std().item() * dcfg.hidden_size ** 0.5
            d.norm.weight.fill_(0.1 / max(spread, 1e-6))
    return d


def scale_fc_init(target: Decoder, drafter: DFlashDrafter, records: list[dict], max_len: int) -> None:
    """Divide fc's input columns by the RMS of each tapped feature over `records` (relative to the median).

    The target's hidden states carry a few dimensions hundreds of times larger than the rest (and later taps
    are ~10x larger than early ones); with an isotropic fc, those dimensions dominate every fused context row,
    the rows all look alike after hidden_norm, and the drafter starts blind to the context. Same layout, only
    the starting point changes.
    """
    sq, n = None, 0
    for r in records:
        tokens = torch.tensor((r["prompt_ids"] + r["response_ids"])[:max_len])
        f = target_features(target, tokens, drafter.cfg.target_layer_ids)[0, 1:].float()  # skip the sink row
        sq = f.pow(2).sum(0) if sq is None else sq + f.pow(2).sum(0)
        n += f.shape[0]
    if not n:
        return
    rms = (sq / n).sqrt().clamp_min(1e-6)
    with torch.no_grad():
        drafter.fc.weight.mul_((rms.median() / rms).view(1, -1))


def warm_start(drafter: DFlashDrafter, path: Path) -> None:
    """Copy the weights of an existing drafter with the same configuration (fine-tuning on new data), or with the
    same but fewer layers or fewer taps (growing it). Its layers become the first ones, and every new layer starts
    with its attention and MLP output projections at zero (it adds nothing to the residual stream); its taps keep
    their fc columns, and a new tap's columns start at zero (it adds nothing to the fused context row). So the
    grown drafter computes exactly what the old one did until training moves those weights. The block size may
    differ too (no weight depends on it: a block is the root and L mask rows), which starts a drafter of another
    block size from one trained on blocks of this one."""
    try:
        other = DrafterConfig.from_json(json.loads((path / "config.json").read_text()))
        weights = load_file(path / "model.safetensors")
    except Exception as e:
        raise TrainError(f"cannot warm-start from {path}: {type(e).__name__}: {e}") from None
    mine = drafter.cfg
    other = replace(other, block_size=mine.block_size, short_block_rows=mine.short_block_rows)  # no weight reads them
    slots = tap_slots(other.target_layer_ids, mine.target_layer_ids)
    same_rest = replace(other, num_layers=mine.num_layers,
                        target_layer_ids=list(mine.target_layer_ids)).to_json() == mine.to_json()
    if not (same_rest and other.num_layers <= mine.num_layers and slots is not None):
        raise TrainError(f"cannot warm-start from {path}: its configuration differs from this run's (other than"
                         " by having fewer layers, taps that are a subsequence of this run's, or another block size)")
    if "fc.weight" in weights:  # (without it, the load below names what is missing)
        H, fc = mine.hidden_size, weights["fc.weight"].float()
        grown_fc = fc.new_zeros(fc.shape[0], len(mine.target_layer_ids) * H)
        for i, j in enumerate(slots):
            grown_fc[:, j * H:(j + 1) * H] = fc[:, i * H:(i + 1) * H]
        weights = {**weights, "fc.weight": grown_fc}
    grows = other.num_layers < mine.num_layers
    with torch.no_grad():
        missing, unexpected = drafter.load_state_dict({k: v.float() for k, v in weights.items()}, strict=not grows)
        new = tuple(f"layers.{i}." for i in range(other.num_layers, mine.num_layers))
        if unexpected or not all(k.startswith(new) for k in missing):
            raise TrainError(f"cannot warm-start from {path}: weights missing or unexpected "
                             f"({[k for k in missing if not k.startswith(new)][:3]}, {unexpected[:3]})")
        for layer in drafter.layers[other.num_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def tap_slots(old: list[int], new: list[int]) -> list[int] | None:
    """Where each of `old`'s taps sits in `new` (the first match in order), or None when `old` is not a
    subsequence of `new` (its fc columns would not line up with the features they were trained on)."""
    slots, j = [], 0
    for tap in old:
        while j < len(new) and new[j] != tap:
            j += 1
        if j == len(new):
            return None
        slots.append(j)
        j += 1
    return slots


def draft_vocab_of(path: Path, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary of the drafter directory `path` (TrainConfig.draft_vocab)."""
    try:
        ids = read_draft_vocab(path, vocab_size)
    except ValueError as e:
        raise TrainError(f"--draft-vocab: {e}") from None
    if ids is None:
        raise TrainError(f"--draft-vocab: {path} holds no {DRAFT_VOCAB_FILE} (make one with `castspec draft-vocab`)")
    return ids


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def draw_anchors(record: dict, cfg: TrainConfig, generator: torch.Generator) -> torch.Tensor:
    """The block roots of one sequence (none when its response is too short to hold a block)."""
    T = min(len(record["prompt_ids"]) + len(record["response_ids"]), cfg.max_seq_len)
    return sample_anchors(len(record["prompt_ids"]), T - 2, cfg.anchors_per_seq, generator)


def sequence_loss(target: Decoder, drafter: DFlashDrafter, record: dict, anchors: torch.Tensor, cfg: TrainConfig,
                  weights: torch.Tensor, window: int = 0, model: torch.nn.Module | None = None,
                  block_rows: int | None = None):
    """Weighted block cross-entropy of one sequence at `anchors` (from draw_anchors, not empty); also the chain
    acceptance of each block (for monitoring). `model` runs the forward in place of `drafter` (its DDP wrapper);
    `block_rows` cuts its blocks to that many rows (root included; None: the drafter's block size)."""
    prompt, response = record["prompt_ids"], record["response_ids"]
    tokens = torch.tensor((prompt + response)[:cfg.max_seq_len])
    T, P = tokens.numel(), len(prompt)
    loss_mask = torch.arange(T) >= P
    bs = block_rows or drafter.cfg.block_size
    weights = weights[:bs - 1]
    rows = teacher_rows(anchors, bs, T) if cfg.kl_weight > 0 else None
    with torch.no_grad():
        feats, teacher = target_pass(target, tokens, drafter.cfg.target_layer_ids, rows, drafter.draft_vocab)
    ids, pos, labels = block_inputs(tokens, anchors, bs, drafter.cfg.mask_token_id, loss_mask)
    head = drafter.vocab_head(target)
    if drafter.draft_vocab is not None:
        labels = on_draft_vocab(drafter.draft_vocab, target.cfg.vocab_size, labels)
    mask = block_mask(anchors, T, bs, window).view(1, 1, -1, T + ids.numel())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        emb = target.embed(ids.view(1, -1)).float()
        hidden = (model or drafter)(emb, pos.view(1, -1), feats.float(), torch.arange(T).view(1, -1), mask=mask,
                                    group_rows=ATTENTION_GROUP_BLOCKS * bs)
        hidden = hidden.view(anchors.numel(), bs, -1)[:, 1:]
        logits = F.linear(hidden, head.to(hidden.dtype)).float()
    # one log-softmax for both terms; a position without a label (-100) weighs nothing
    logp = F.log_softmax(logits, dim=-1)
    ce = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    w = weights.view(1, -1) * (labels >= 0)
    if teacher is not None:
        kl = (teacher.exp() * (teacher - logp)).sum(-1)  # KL(target || drafter) from both log-probabilities
        ce = (1 - cfg.kl_weight) * ce + cfg.kl_weight * kl
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    acc = chain_acceptance(logits.argmax(-1), labels)
    return loss, acc.float().mean().item()


def on_draft_vocab(vocab: torch.Tensor, vocab_size: int, labels: torch.Tensor) -> torch.Tensor:
    """The labels as indices into a draft vocabulary (sorted token ids [S]; -100 outside it): the loss's targets
    for the head rows `DFlashDrafter.vocab_head` (the teacher comes over the same vocabulary from target_pass)."""
    vocab = vocab.cpu()
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(vocab.numel())
    return torch.where(labels >= 0, index[labels.clamp(min=0)], labels)


def target_features(target: Decoder, tokens: torch.Tensor, taps: list[int]) -> torch.Tensor:
    """The target's tapped features of the sequence [1, T, taps * hidden]."""
    return target_pass(target, tokens, taps)[0]


def target_pass(target: Decoder, tokens: torch.Tensor, taps: list[int], rows: torch.Tensor | None = None,
                vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's tapped features of the sequence [1, T, taps * hidden] and, for `rows` [nb, L] (teacher_rows),
    its next-token log-probabilities there [nb, L, vocab] (None without rows), over the draft vocabulary `vocab`
    (sorted token ids) where one is given, renormalized over it. The same forward gives both: only the distinct
    rows' logits are computed, and they are cut to the draft vocabulary before they are spread over the rows."""
    T = tokens.numel()
    cache = target.new_cache(T)
    distinct, where = (rows.unique(return_inverse=True) if rows is not None else (None, None))
    with torch.inference_mode():
        logits, feats = target(tokens.view(1, -1).to(target.device), torch.arange(T).view(1, -1), cache, 0,
                               causal=True, logit_rows=distinct if rows is not None else slice(0, 0),
                               taps=tuple(taps))
        teacher = None
        if rows is not None:
            logits = logits.reshape(distinct.numel(), -1)
            if vocab is not None:
                logits = logits.index_select(-1, vocab.to(logits.device))
            teacher = F.log_softmax(logits.float(), dim=-1).cpu()
    # clones leave inference mode: the loss saves the teacher for its backward
    return feats.clone(), None if teacher is None else teacher.clone()[where]


@dataclass
class TrainState:
    step: int = 0
    cursor: int = 0  # position in the shuffled order of records
    epoch: int = 0
    ema_loss: float | None = None
    ema_accept: float | None = None
    history: list = field(default_factory=list)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    idx = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(idx)
    return idx


def save_checkpoint(path: Path, drafter, opt, state: TrainState, gen: torch.Generator, cfg: TrainConfig,
                    world_size: int = 1) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state),
                "generator": gen.get_state(), "torch_rng": torch.get_rng_state(), "config": asdict(cfg),
                "drafter_config": drafter.cfg.to_json(), "world_size": world_size}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path):
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:
        raise TrainError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); "
                         "delete it to start over") from None


def train(target: Decoder, records: list[dict], out_dir: Path, cfg: TrainConfig, rope: dict,
          progress: bool = True, stop_after: int | None = None, on_export=None) -> TrainState:
    """Train (or resume) into out_dir: checkpoint.pt for resuming, drafter/ in the public DFlash layout."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not records:
        raise TrainError("no training records")
    vocab = target.cfg.vocab_size
    for r in records[:50]:
        if max(r["prompt_ids"] + r["response_ids"], default=0) >= vocab:
            raise TrainError(f"data token ids exceed the target vocabulary ({vocab}): data made for another target?")
    if not cfg.gamma > 0:
        raise TrainError(f"--gamma must be positive, not {cfg.gamma}")
    if not 0.0 <= cfg.kl_weight <= 1.0:
        raise TrainError(f"--kl-weight must be between 0 and 1, not {cfg.kl_weight}")
    if not 0.0 <= cfg.short_blocks <= 1.0:
        raise TrainError(f"--short-blocks must be between 0 and 1, not {cfg.short_blocks}")
    if cfg.short_blocks > 0 and not 2 <= cfg.short_block_rows <= cfg.block_size:
        raise TrainError(f"--short-block-rows must be between 2 and the block size ({cfg.block_size}), "
                         f"not {cfg.short_block_rows}")
    ranks = Ranks.current()
    if cfg.seqs_per_step < ranks.world:
        raise TrainError(f"{cfg.seqs_per_step} sequences per step cannot be shared by {ranks.world} ranks: "
                         "give each rank at least one (--seqs-per-step)")
    dcfg = drafter_config_for(target, cfg, rope)
    drafter = init_drafter(target, dcfg, cfg.init_from_target, cfg.seed, cfg.norm_init)
    if cfg.fc_init == "scaled":
        scale_fc_init(target, drafter, records[:16], cfg.max_seq_len)
    if cfg.init_from:
        warm_start(drafter, Path(cfg.init_from))
    if cfg.draft_vocab:
        drafter.set_draft_vocab(draft_vocab_of(Path(cfg.draft_vocab), dcfg.vocab_size))
    trainable = [p for p in drafter.parameters()]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    state = TrainState()
    ckpt = out_dir / "checkpoint.pt"
    if ckpt.exists():
        saved = load_checkpoint(ckpt)
        if saved["drafter_config"] != dcfg.to_json():
            raise TrainError(f"{ckpt} was made with other settings; use another --out or the same options")
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        gen.set_state(saved["generator"])
        torch.set_rng_state(saved["torch_rng"])
        if saved.get("world_size", 1) != ranks.world:  # the batches do not depend on it, only summation order
            log.info("resuming a run of %d rank(s) on %d", saved.get("world_size", 1), ranks.world)
    weights = decay_weights(dcfg.block_size - 1, cfg.gamma)
    schedule = parse_window_schedule(cfg.context_windows)
    feed = BatchFeed(records, cfg, state, gen)
    model = ranks.wrap(drafter)  # under torchrun: DDP, gradients averaged across ranks in backward
    if ranks.main:
        (out_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    bar = tqdm(total=cfg.steps, initial=state.step, desc="train-drafter", disable=not (progress and ranks.main))
    drafter.train()
    t0 = time.time()
    window_sums = [0.0, 0.0, 0.0]  # loss, chain acceptance, sequences since the last history entry
    computed = [0.0, 0.0]  # sequences this rank computed, sequences all ranks computed
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    while state.step < end:  # a rerun of a finished run (or leg) trains nothing more
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step, cfg)
        opt.zero_grad(set_to_none=True)
        batch = feed.next()
        mine = accumulate_gradients(target, drafter, model, batch, cfg, weights, window_at(schedule, state.step),
                                    ranks)
        sums = ranks.sum(mine)
        computed = [computed[0] + mine[2], computed[1] + sums[2]]
        torch.nn.utils.clip_grad_norm_(trainable, cfg.clip)
        opt.step()
        state.step += 1
        if sums[2]:
            l, a = sums[0] / sums[2], sums[1] / sums[2]
            state.ema_loss = l if state.ema_loss is None else 0.98 * state.ema_loss + 0.02 * l
            state.ema_accept = a if state.ema_accept is None else 0.98 * state.ema_accept + 0.02 * a
        bar.update(1)
        bar.set_postfix(loss=f"{state.ema_loss:.3f}", tau=f"{state.ema_accept:.2f}", lr=f"{lr_at(state.step, cfg):.1e}")
        window_sums = [w + v for w, v in zip(window_sums, sums)]
        if state.step % 10 == 0:  # raw means over the last 10 steps (the EMA in the bar lags on short runs)
            n = max(window_sums[2], 1)
            state.history.append({"step": state.step, "loss": window_sums[0] / n, "train_tau": window_sums[1] / n,
                                  "elapsed_s": time.time() - t0})
            window_sums = [0.0, 0.0, 0.0]
        last = state.step == end
        if ranks.main and (state.step % cfg.checkpoint_every == 0 or last):
            save_checkpoint(ckpt, drafter, opt, state, gen, cfg, ranks.world)
        if ranks.main and (state.step % cfg.export_every == 0 or last):
            export(drafter, out_dir / "drafter")
            if on_export is not None:
                on_export(state.step, out_dir / "drafter")
    bar.close()
    log.info("rank %d of %d computed %d of the %d sequences", ranks.rank, ranks.world, *computed)
    ranks.barrier()  # when train() returns on any rank, rank 0's last checkpoint and export are on disk
    drafter.eval()
    return state


class BatchFeed:
    """The global batches: records in a shuffled order per epoch, `seqs_per_step` at a time, with their anchors.

    Every rank draws the whole global batch (anchors included) from the same generator, so the batches and the
    generator's state do not depend on the number of ranks; each rank then computes only its share.
    """

    def __init__(self, records: list[dict], cfg: TrainConfig, state: TrainState, gen: torch.Generator):
        self.records, self.cfg, self.state, self.gen = records, cfg, state, gen
        self.order = _order(len(records), cfg.seed, state.epoch)

    def next(self) -> list[tuple[dict, torch.Tensor, int | None]]:
        """(record, anchors, block rows) of the sequences of the next global batch that hold a block; block rows
        None for whole blocks, else cut (a `short_blocks` share of the sequences, drawn from the same generator
        only when that share is set, so runs without it draw as before)."""
        batch = []
        for _ in range(self.cfg.seqs_per_step):
            if self.state.cursor >= len(self.order):
                self.state.epoch += 1
                self.state.cursor = 0
                self.order = _order(len(self.records), self.cfg.seed, self.state.epoch)
            rec = self.records[self.order[self.state.cursor]]
            self.state.cursor += 1
            anchors = draw_anchors(rec, self.cfg, self.gen)
            cut = None
            if self.cfg.short_blocks > 0 and torch.rand(1, generator=self.gen).item() < self.cfg.short_blocks:
                cut = self.cfg.short_block_rows
            if anchors.numel():
                batch.append((rec, anchors, cut))
        return batch


def accumulate_gradients(target: Decoder, drafter: DFlashDrafter, model: torch.nn.Module,
                         batch: list[tuple[dict, torch.Tensor, int | None]], cfg: TrainConfig, weights: torch.Tensor,
                         window: int, ranks: Ranks) -> list[float]:
    """Backward of this rank's share of a global batch; returns [loss sum, acceptance sum, sequences] of the share.

    The step's gradient is the sum over the global batch of each sequence's gradient / seqs_per_step. DDP
    averages over ranks, so each rank scales its sequences by the world size; a rank whose share is empty
    still joins DDP's all-reduce, with a zero-weighted sequence.
    """
    mine = batch[ranks.rank::ranks.world]
    idle = not mine and bool(batch)
    if idle:
        mine = batch[:1]
    sums = [0.0, 0.0, 0.0]
    for i, (rec, anchors, cut) in enumerate(mine):
        with ranks.local_backward(model, last=i == len(mine) - 1):
            loss, acc = sequence_loss(target, drafter, rec, anchors, cfg, weights, window, model, cut)
            (loss * 0.0 if idle else loss * ranks.world / cfg.seqs_per_step).backward()
        if not idle:
            sums = [sums[0] + loss.item(), sums[1] + acc, sums[2] + 1]
    return sums


def export(drafter: DFlashDrafter, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the drafter in the public layout, in bf16 (what it runs in here; halves the shipped size)."""
    save_drafter(drafter.converted(dtype), out)
