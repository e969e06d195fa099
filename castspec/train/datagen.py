"""Training data = the target's own responses to many prompts, stored as token ids with a response mask.

Generation is batched (continuous batching over the decoding rounds), sharded and resumable: each shard is
written atomically once its batch is done, and a rerun skips the shards that exist.
"""
from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import DecodeConfig
from ..decode import raise_error
from ..models.decoder import Decoder
from ..prompts import SELF_WRITTEN, Prompt, prompt_family
from ..round import run_round
from ..sampling import mix_seed
from ..sequence import Sequence


@dataclass
class DataGenConfig:
    max_new_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0  # 0 = greedy (what decoding serves); > 0 samples for diversity
    seed: int = 0
    dtype: str = "bf16"
    prompts: str = "training"  # the prompt family (prompts.PROMPT_FAMILIES) drawn with `seed`
    # shards decoded together: a finished row's place goes to the next shard's prompts, so the batch stays full
    # (one shard alone drains to its longest response); an interruption loses at most this many shards' work
    shards_per_call: int = 8


def batched_generate(target: Decoder, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                     temperature: float = 0.0, seeds: list[int] | None = None, batch_size: int = 0,
                     prefill_budget: int = 512) -> list[list[int]]:
    """The target's continuations of several prompts: greedy, or sampled with seed `seeds[i]` (default i) for
    prompt i; each ends at its first stop id (kept) or after `max_new_tokens`.

    Continuous batching over `run_round`, as the server's `ar` does: the same ragged rounds and native forwards,
    so the tokens are the ones castspec decoding serves: each prompt's are those of its own `ar` decode, alone or
    in any batch. At most `batch_size` sequences (0: all) decode at once; a finished one's place goes to the next
    prompt, whose prompt is read in chunks of the round's `prefill_budget` beside the others' steps.
    """
    stops = tuple(sorted(stop_ids))
    out: list[list[int]] = [[] for _ in prompts]
    waiting = deque(range(len(prompts)))
    live: list[tuple[int, Sequence]] = []
    limit = batch_size or len(prompts)
    with torch.inference_mode():
        while waiting or live:
            while waiting and len(live) < limit:
                i = waiting.popleft()
                cfg = DecodeConfig(method="ar", max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=(seeds[i] if seeds is not None else i) if temperature > 0 else None,
                                   stop_token_ids=stops)
                live.append((i, Sequence(target, None, prompts[i], cfg)))
            result = run_round(target, None, [s for _, s in live], None, prefill_budget)
            for (i, _), o in zip(live, result.sequences):
                raise_error(o)
                out[i].extend(o.emitted)
            live = [(i, s) for i, s in live if not s.done]
    return out


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation through the tokenizer's chat template, ready for the assistant's next answer."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def encode_chat(tokenizer, text: str) -> list[int]:
    """A single user turn through the tokenizer's chat template, ready for the assistant's answer."""
    return encode_messages(tokenizer, [{"role": "user", "content": text}])


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """A training prompt ready for the target's answer: its earlier turns, each followed by the answer the
    dataset already holds, then its own text."""
    if len(prompt.earlier_answers) != len(prompt.earlier_turns):
        raise ValueError(f"prompt {prompt.id}: training data needs the answers to its earlier turns")
    messages = []
    for turn, answer in zip(prompt.earlier_turns, prompt.earlier_answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return encode_messages(tokenizer, messages + [{"role": "user", "content": prompt.text}])


# the sentinel a chat template is applied to, to find where a user's text begins
_USER_TEXT = "\x00user text\x00"
PROMPTS_FILE = "prompts.jsonl"  # the prompts a dataset of self-written ones was made from


def self_written_prompts(target: Decoder, tokenizer, count: int, seed: int, stop_ids: set[int],
                         temperature: float = 0.8, max_tokens: int = 96, batch_size: int = 24,
                         leads: tuple[str, ...] = ("",)) -> list[Prompt]:
    """Chat prompts the target writes itself: given only its chat template up to where a user's text begins, an
    instruction-tuned model writes a user's turn like those of the conversations it was tuned on (the Magpie
    recipe, Xu et al. 2024), so the prompts follow the kinds of request its users make rather than our templates.
    `leads`: a turn's first words, given, draw k taking leads[k % len(leads)] (e.g. "Write a letter": requests
    to write prose, which free draws seldom make; "Write" alone draws mostly code); each prompt is its lead and
    what the target wrote after it.
    `count` draws sampled at `temperature` (seeded by `seed` and the draw); kept: the distinct ones (case aside)
    that end their turn at a stop id within `max_tokens` and have at least three words, each where first drawn."""
    template = tokenizer.apply_chat_template([{"role": "user", "content": _USER_TEXT}], tokenize=False)
    head = template[:template.index(_USER_TEXT)]
    starts = [tokenizer(head + lead, add_special_tokens=False)["input_ids"] for lead in leads]
    turns = batched_generate(target, [list(starts[k % len(leads)]) for k in range(count)], max_tokens, stop_ids,
                             temperature, seeds=[mix_seed(seed, k) for k in range(count)], batch_size=batch_size)
    out, seen = [], set()
    for k, ids in enumerate(turns):
        if not ids or ids[-1] not in stop_ids:
            continue  # cut off at max_tokens: not a whole turn
        text = (leads[k % len(leads)] + tokenizer.decode(ids, skip_special_tokens=True)).strip()
        if len(text.split()) >= 3 and text.lower() not in seen:
            seen.add(text.lower())
            out.append(Prompt("chat", SELF_WRITTEN, text, f"{SELF_WRITTEN}/{seed}/{k}"))
    return out


def save_prompts(path: Path, prompts: list[Prompt]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))
    os.replace(tmp, path)


def load_prompts(path: Path) -> list[Prompt]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [Prompt(**{**r, "earlier_turns": tuple(r["earlier_turns"]), "earlier_answers": tuple(r["earlier_answers"])})
            for r in rows]


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
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    batches = [list(range(i, min(i + cfg.batch_size, len(prompts)))) for i in range(0, len(prompts), cfg.batch_size)]
    todo = [b for b in range(len(batches)) if b % part[1] == part[0] and not shard_path(out_dir, b).exists()]
    summary = dataset_summary(out_dir)
    bar = tqdm(total=len(batches), desc="make-data", unit="batch", initial=summary["shards"])
    for g in range(0, len(todo), cfg.shards_per_call):
        if limit_tokens is not None and summary["response_tokens"] >= limit_tokens:
            break
        group = todo[g:g + cfg.shards_per_call]
        rows = [i for b in group for i in batches[b]]
        # prompt i's seed depends on i alone, so a shard's records do not depend on the grouping or the part
        responses = dict(zip(rows, batched_generate(target, [encoded[i] for i in rows], cfg.max_new_tokens, stop_ids,
                                                    cfg.temperature, seeds=[cfg.seed * 100003 + i for i in rows],
                                                    batch_size=cfg.batch_size)))
        for b in group:
            records = [{"prompt_ids": encoded[i], "response_ids": responses[i], "domain": prompts[i].domain,
                        "source": prompts[i].source, "id": prompts[i].id} for i in batches[b]]
            path = shard_path(out_dir, b)
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


def answered_prompts(data_dir: Path, tokenizer, prompts: list[Prompt] | None = None) -> list[tuple[Prompt, str]]:
    """The prompts a make-data dataset answered, each with the target's answer as text, in the dataset's order.
    `prompts` holds them (default: the prompt family and seed in the dataset's datagen.json, or for self-written
    prompts the dataset's PROMPTS_FILE)."""
    data_dir = Path(data_dir)
    if prompts is None:
        config = json.loads((data_dir / "datagen.json").read_text())["config"]
        family = config.get("prompts", "training")
        prompts = load_prompts(data_dir / PROMPTS_FILE) if family == SELF_WRITTEN else \
            prompt_family(family, config["seed"])
    by_id = {p.id: p for p in prompts}
    out = []
    for r in load_records(data_dir):
        if r["id"] not in by_id:
            raise ValueError(f"{data_dir}: record {r['id']!r} is none of the training prompts it was made from")
        out.append((by_id[r["id"]], tokenizer.decode(r["response_ids"], skip_special_tokens=True)))
    return out
