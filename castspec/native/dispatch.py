"""Native or torch: the one place that decides which code runs a model's forward.

Each model (models/decoder.py, models/dflash.py) owns a NativeSwitch and calls it with its torch forward as the
fallback; the switch runs the native forward (native/forward.py) where it applies, and the torch forward
otherwise. Everything native-specific lives here: whether the C code takes the call (its row limits, layouts),
the lazily built native code of the model, the check it passes when built, and dropping the native code when the
model's weights move.

When the native code is built (at the first forward it would take), a few synthetic forwards (the kind's
`selftest`: prefill, tree and decode rows, or drafter passes) run through it and through torch, each on a scratch
cache of its own, and are compared; a disagreement, which only a platform or shape the C code mishandles can
cause, is logged and leaves the model on torch. The check touches no request's cache and returns nothing to a
caller, so the first call after loading computes exactly what every later call computes.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .. import env
from . import build as native
from .forward import NativeDraft, NativeStep, max_rows

log = logging.getLogger("castspec")


def agrees(native_out, torch_out, dtype: torch.dtype, tol: float | None = None) -> bool:
    """A native forward's outputs (a tensor or a tuple of tensors and Nones) equal the torch forward's up to
    rounding (`tol`, else the dtype's), relative to the largest value: logits and hidden states have no fixed
    scale."""
    if isinstance(torch_out, torch.Tensor):
        native_out, torch_out = (native_out,), (torch_out,)
    if tol is None:
        tol = 1e-3 if dtype == torch.float32 else 5e-2
    return all(torch.allclose(a.float(), b.float(), rtol=0, atol=tol * max(b.abs().max().item(), 1.0))
               for a, b in zip(native_out, torch_out) if b is not None)


def passes_selftest(kind, code, model: nn.Module, torch_forward, call: tuple) -> bool:
    """The kind's self-test forwards (built for `call`, the forward that asked for the code) through the native
    code and through torch, each on a scratch cache of its own: every output agrees, and so do the caches after."""
    on_native, on_torch = kind.selftest(model, *call), kind.selftest(model, *call)
    for a, b in zip(on_native.calls, on_torch.calls):
        if not agrees(code.run(*a), torch_forward(*b), model.dtype, code.tolerance):
            return False
    return agrees(on_native.kv(), on_torch.kv(), model.dtype, code.tolerance)


class NativeSwitch(nn.Module):
    """Runs one model's forwards natively where the C code applies, through torch otherwise.

    An nn.Module child of its model (with no parameters, so state dicts are unchanged) for one reason: moving
    or converting the model (`.to()`, `.float()`, ...) reaches it through `_apply`, which drops the native code,
    whose pointers would then be stale; it is built again at the next forward."""

    def __init__(self, kind: type[NativeStep] | type[NativeDraft]):
        super().__init__()
        self._kind = kind
        self._reset()

    def _reset(self) -> None:
        self._looked_up = False  # whether _code was built (or found not to apply) for the model's weights
        self._code: NativeStep | NativeDraft | None = None  # None: does not apply, or turned off
        self._checked = False  # whether the native code passed the build-time comparison with the torch forward

    @classmethod
    def for_decoder(cls) -> "NativeSwitch":
        return cls(NativeStep)

    @classmethod
    def for_drafter(cls) -> "NativeSwitch":
        return cls(NativeDraft)

    def run(self, model: nn.Module, torch_forward, *args):
        """`torch_forward(*args)`, or the same call through the native code where it applies."""
        if torch.is_grad_enabled() or not self._kind.accepts(model, *args):
            return torch_forward(*args)
        if self._stale():
            self._reset()
        if not self._looked_up:
            self._build(model, torch_forward, args)
        return torch_forward(*args) if self._code is None else self._code.run(*args)

    def code_for(self, model: nn.Module, *args) -> NativeStep | NativeDraft | None:
        """The native code that `run(model, ..., *args)` would use, where it is already built and checked (it is
        built by a `run`), for callers with a fused entry of their own (NativeDraft.marginals); else None."""
        if self._code is None or self._stale() or torch.is_grad_enabled() or not self._kind.accepts(model, *args):
            return None
        return self._code

    def _stale(self) -> bool:
        """Whether the native code's weights are packed in another layout than the library's products now read
        (the library chooses AMX, and with it the bf16 panels' grouping, each time it is loaded: tests reload it
        with CASTSPEC_AMX=0): built again at the next forward."""
        return self._code is not None and self._code.panel_group != native.panel_group()

    def _build(self, model: nn.Module, torch_forward, call: tuple) -> None:
        """The model's native code: the first of its kind's candidates whose self-test agrees with the torch
        forward, else none (torch)."""
        self._looked_up = True
        tried = False
        for code in self._kind.candidates(model):
            if passes_selftest(self._kind, code, model, torch_forward, call):
                self._code, self._checked = code, True
                return
            tried = True
            log.warning("castspec: the native %s disagrees with the torch forward on this model", code.what)
        if tried:
            log.warning("castspec: no native %s passed its check on this model; using torch", self._kind.what)

    @property
    def built(self) -> NativeStep | NativeDraft | None:
        """The native code, where it is built, checked and on (after a forward it took); else None."""
        return self._code

    @property
    def active(self) -> bool:
        """Whether the native code is built, checked and on (after a forward it took)."""
        return self._code is not None

    @property
    def checked(self) -> bool:
        """Whether the native code passed the comparison with the torch forward made when it was built."""
        return self._checked

    def guarantee(self, model: nn.Module) -> tuple[str, str]:
        """Which exactness a decoder's forwards give, and why: ("bit-exact", ...) when every forward runs the
        native code, whose per-row arithmetic is independent of the other rows of a forward (so greedy tokens are a
        function of the prompt alone, whatever the method, width, batch or prefill chunking), else ("near-ties",
        ...): torch's kernels round a row differently with other rows beside it, so greedy tokens equal `ar`'s
        except where two candidates' logits are within that rounding (rare in fp32, occasional in bf16).
        Meaningful once the native code was looked up (after a forward)."""
        rounding = "whose rounding of a row can depend on the other rows of its forward"
        if self._code is not None:
            limit = max_rows(model.dtype)
            if limit is None:
                return "bit-exact", "every forward runs castspec's native code, row-invariant by construction"
            return "near-ties", (f"castspec's native code takes forwards of at most {limit} row(s) here "
                                 f"(CASTSPEC_NATIVE={env.native_mode()}, CASTSPEC_NATIVE_ROWS); wider ones (trees, "
                                 f"prompt chunks, batches) run on torch's kernels, {rounding}")
        if model.device.type != "cpu":
            why = f"on {model.device.type}"
        elif env.native_mode() == "off":
            why = "CASTSPEC_NATIVE=0"
        elif native.library() is None:
            why = "no AVX-512 BF16 or AVX2 here for castspec's native code, or no C compiler to build it"
        else:
            why = "castspec's native code does not apply to this model (dtype, head size) or was turned off"
        return "near-ties", f"torch's kernels ({why}), {rounding}"

    def use_torch(self) -> None:
        """Every later forward of this model runs through torch (a reference to compare the native one with)."""
        self._code, self._looked_up = None, True

    def _apply(self, fn, *args, **kwargs):
        self._reset()  # the model's weights moved or changed dtype
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        # pickles and deep copies (a copied model has its own weights) carry no pointers: built again on use
        state = self.__dict__.copy()
        state.update(_looked_up=False, _code=None, _checked=False)
        return state

    def extra_repr(self) -> str:
        return f"{self._kind.__name__}, {'on' if self.active else 'off' if self._looked_up else 'not built yet'}"
