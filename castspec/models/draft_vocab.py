"""A drafter's draft vocabulary: the target tokens its head scores (frequency-ranked truncation, as in FR-Spec
and EAGLE-3's reduced draft vocabulary).

A small drafter's pass is dominated by the target's lm_head: on SmolLM2-135M it reads 49,152 x 576 weights for
every round, more than the drafter's own layers. Scoring only the tokens the target actually writes (the most
frequent ones in its own responses) cuts that read several-fold. Decoding stays exact: the target verifies
every token, and a proposal q that is zero outside the draft vocabulary is still a valid proposal for
rejection sampling (the residual covers the rest). The cost is acceptance on the rare tokens left out.

The vocabulary lives next to the checkpoint in `draft_vocab.safetensors` (one int64 tensor `token_ids`), so
the public config.json + model.safetensors stay untouched and loaders that do not know the file ignore it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def token_counts(records: list[dict], vocab_size: int) -> np.ndarray:
    """How often the target wrote each token in its responses (make-data records)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for r in records:
        ids = np.asarray(r["response_ids"], dtype=np.int64)
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def top_tokens(counts: np.ndarray, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent tokens (ties by id), plus `always` (e.g. stop tokens), sorted by id."""
    order = np.argsort(-counts, kind="stable")
    keep = set(int(t) for t in always if 0 <= t < len(counts))
    for t in order:
        if len(keep) >= size:
            break
        keep.add(int(t))
    return torch.tensor(sorted(keep), dtype=torch.long)


def coverage(records: list[dict], token_ids: torch.Tensor) -> float:
    """Share of response tokens inside the vocabulary."""
    ids = np.concatenate([np.asarray(r["response_ids"], dtype=np.int64) for r in records]) if records else np.zeros(0)
    return float(np.isin(ids, token_ids.numpy()).mean()) if ids.size else 0.0


def save_draft_vocab(drafter_dir: Path, token_ids: torch.Tensor | None) -> None:
    """Write (or, with None, remove) a drafter directory's draft vocabulary."""
    from safetensors.torch import save_file

    path = Path(drafter_dir) / DRAFT_VOCAB_FILE
    if token_ids is None:
        path.unlink(missing_ok=True)
        return
    save_file({"token_ids": token_ids.to(torch.long).contiguous()}, path, metadata={"format": "pt"})


def read_draft_vocab(drafter_dir: Path, vocab_size: int) -> torch.Tensor | None:
    """The directory's draft vocabulary, or None (score the whole vocabulary). Raises ValueError if malformed."""
    from safetensors.torch import load_file

    path = Path(drafter_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = load_file(path)["token_ids"]
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise ValueError(f"{path}: not a readable draft vocabulary ({type(e).__name__})") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype != torch.long:
        raise ValueError(f"{path}: token_ids must be a non-empty 1-D int64 tensor")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: token ids must be distinct and inside the target vocabulary ({vocab_size})")
    return ids
