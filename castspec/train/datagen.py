"""Training data = the target's own responses to many prompts, stored as token ids with a response mask.

Generation is batched (left-padded rows in one static cache), sharded and resumable: each shard is written
atomically once its batch is done, and a rerun skips the shards that exist. Rows are sorted by prompt length
within a shard window so that padding stays small.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.decoder import Decoder
from ..prompts import Prompt


@dataclass
class DataGenConfig:
    max_new_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0  # 0 = greedy (what decoding serves); > 0 samples for diversity
    seed: int = 0
    dtype: str = "bf16"


def batched_generate(target: Decoder, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                     temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Greedy (or sampled) continuations of several prompts at once; each stops at its first stop id."""
    device = target.device
    B, T = len(prompts), max(len(p) for p in prompts)
    pad = [T - len(p) for p in prompts]
    ids = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T + max_new_tokens, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, pad[r]:] = torch.tensor(p)
        valid[r, pad[r]:T] = True
    pos = (torch.arange(T).view(1, -1) - torch.tensor(pad).view(-1, 1)).clamp(min=0)
    # padded rows see themselves so that no softmax row is empty (their outputs are never read)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (causal & valid[:, None, :T]) | torch.eye(T, dtype=torch.bool)
    cache = target.new_cache(T + max_new_tokens, batch=B)
    out: list[list[int]] = [[] for _ in range(B)]
    live = list(range(B))  # original row of each batch row still generating
    with torch.inference_mode():
        logits, _ = target(ids.to(device), pos.to(device), cache, 0, mask=mask[:, None].to(device),
                           logit_rows=slice(-1, None))
        next_pos = torch.tensor([len(p) for p in prompts]).view(-1, 1)
        for step in range(max_new_tokens):
            last = logits[:, -1]
            if temperature > 0:
                tok = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator).view(-1)
            else:
                tok = last.argmax(-1)
            tok = tok.cpu()
            keep = []
            for b, r in enumerate(live):
                t = int(tok[b])
                out[r].append(t)
                if t not in stop_ids:
                    keep.append(b)
            if not keep or step == max_new_tokens - 1:
                break
            if len(keep) < len(live):  # drop finished rows so they stop costing compute
                idx = torch.tensor(keep)
                cache.k, cache.v = cache.k[:, idx.to(device)], cache.v[:, idx.to(device)]
                valid, next_pos, tok = valid[idx], next_pos[idx], tok[idx]
                live = [live[b] for b in keep]
            slot = T + step
            valid[:, slot] = True
            logits, _ = target(tok.view(-1, 1).to(device), next_pos.to(device), cache, slot,
                               mask=valid[:, None, None, :slot + 1].to(device))
            next_pos += 1
    return out


def encode_chat(tokenizer, text: str) -> list[int]:
    """A single user turn through the tokenizer's chat template, ready for the assistant's answer."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / "shards" / f"shard-{index:05d}.pt"


def generate_dataset(target: Decoder, tokenizer, prompts: list[Prompt], out_dir: Path, cfg: DataGenConfig,
                     stop_ids: set[int], limit_tokens: int | None = None, part: tuple[int, int] = (0, 1)) -> dict:
    """Write shards of {prompt_ids, response_ids, domain, source, id}; return a summary of everything on disk.

    part=(i, n) makes this process write only batches b with b % n == i, so n processes can share one dataset.
    """
    out_dir = Path(out_dir)
    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    meta = {"config": asdict(cfg), "num_prompts": len(prompts)}
    tmp = out_dir / f"datagen.json.{part[0]}.tmp"  # several workers write the same file: each one whole
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out_dir / "datagen.json")
    encoded = [encode_chat(tokenizer, p.text) for p in prompts]
    batches = [list(range(i, min(i + cfg.batch_size, len(prompts)))) for i in range(0, len(prompts), cfg.batch_size)]
    summary = dataset_summary(out_dir)
    bar = tqdm(total=len(batches), desc="make-data", unit="batch", initial=summary["shards"])
    for b, rows in enumerate(batches):
        path = shard_path(out_dir, b)
        if path.exists() or b % part[1] != part[0]:
            continue
        if limit_tokens is not None and summary["response_tokens"] >= limit_tokens:
            break
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + b)
        responses = batched_generate(target, [encoded[i] for i in rows], cfg.max_new_tokens, stop_ids,
                                     cfg.temperature, gen)
        records = [{"prompt_ids": encoded[i], "response_ids": resp, "domain": prompts[i].domain,
                    "source": prompts[i].source, "id": prompts[i].id} for i, resp in zip(rows, responses)]
        tmp = path.with_suffix(".tmp")
        torch.save(records, tmp)
        os.replace(tmp, path)
        summary["shards"] += 1
        summary["response_tokens"] += sum(len(r["response_ids"]) for r in records)
        summary["examples"] += len(records)
        bar.update(1)
        bar.set_postfix(tokens=summary["response_tokens"])
    bar.close()
    return dataset_summary(out_dir)


def shard_files(data_dir: Path) -> list[Path]:
    """A make-data dataset's shards, in order (none when `data_dir` is not one)."""
    return sorted((Path(data_dir) / "shards").glob("shard-*.pt"))


def load_records(data_dir: Path) -> list[dict]:
    records = []
    for f in shard_files(data_dir):
        records.extend(torch.load(f, weights_only=True))
    return records


def dataset_summary(data_dir: Path) -> dict:
    files = shard_files(data_dir)
    tokens = examples = 0
    for f in files:
        recs = torch.load(f, weights_only=True)
        examples += len(recs)
        tokens += sum(len(r["response_ids"]) for r in recs)
    return {"shards": len(files), "examples": examples, "response_tokens": tokens}
