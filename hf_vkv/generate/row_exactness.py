"""Row exactness: proving, op by op, that a forward on one row per prompt computes DynamicCache's bits.

Prefill once (:mod:`hf_vkv.generate.prefill_once`) runs ``generate``'s prefill on ``B`` prompts where
DynamicCache runs it on ``B*k`` rows (each prompt repeated ``k`` times). A row of a matmul is
bit-identical across batch sizes only when the kernel splits the work the same way, and that
depends on the rows, the operand shapes and strides, the dtype and the number of intra-op threads
(oneDNN / MKL split a small matmul along the reduction at >= 2 threads: with 2 threads an fp32
``F.linear`` on 5, 6, 7 or 9 rows differs from the same rows inside a matmul 8x taller). No fixed
row count proves anything, so :class:`RowExactness` checks every call that reduces (matmuls,
attention, norms, softmax; :func:`probed_functions`) while the forward runs:

* the first time a call's *signature* is seen — the function, every operand's shape, strides,
  storage offset and dtype, the other arguments, ``B``, ``k`` and ``torch.get_num_threads()`` —
  it also runs the call on its operands expanded to ``B*k`` rows as DynamicCache would hold them
  (same strides, each prompt's rows repeated ``k`` times in a row), and compares;
* **exact** (every repeat equals the unique result, ``torch.equal``): the verdict is cached for
  the process and later calls of that signature cost nothing;
* **expanded**: the repeats agree with each other but not with the unique result: this call runs
  on the expanded rows from now on and hands back one repeat per prompt — DynamicCache's bits, at
  the cost of that one call on ``k`` times the rows (counted in :attr:`RowExactness.expanded`);
* **inexact**: the repeats differ among themselves (DynamicCache's own copies of a prompt would
  differ), or the expansion fails: :class:`InexactRows` is raised and the caller prefills every row.

A kernel's split is a function of shapes, strides, dtype and threads, not of the values, so one
comparison on real operands stands for every later call of the signature. Elementwise ops and
gathers compute each element alone and are not checked. A change of ``torch.set_num_threads``
between calls changes the signature: the new thread count is probed afresh, never assumed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["InexactRows", "RowExactness", "Verdict", "expand_operand", "probed_functions", "clear_verdicts"]

Verdict = Literal["exact", "expanded", "inexact"]

#: Signatures kept per process (the oldest forgotten first); a signature includes the prompt's
#: length, so a long-running server sees many.
_MAX_VERDICTS = 4096
_VERDICTS: OrderedDict[tuple, Verdict] = OrderedDict()
_PROBED: frozenset | None = None


class InexactRows(Exception):
    """A call of the forward computes a repeated prompt's copies differently from each other at
    ``B*k`` rows, so no forward on ``B`` rows can give DynamicCache's bits (internal: prefill once
    catches it and prefills every row)."""


def clear_verdicts() -> None:
    """Forget every cached verdict (tests; a process that swaps its BLAS)."""
    _VERDICTS.clear()


#: Elementwise functions whose vectorized body and scalar tail may round differently (so an
#: element's bits depend on where the tensor's size puts it): transcendental math and activations.
_TRANSCENDENTAL = ("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan", "tanh", "sigmoid",
                   "erf", "erfc", "erfinv", "atan", "asin", "acos", "sinh", "cosh", "pow", "rsqrt", "float_power")
_ACTIVATIONS = ("gelu", "silu", "mish", "softplus", "elu", "selu", "celu", "logsigmoid", "tanh", "sigmoid", "glu",
                "normalize")


def probed_functions() -> frozenset:
    """The torch functions whose result for a row may depend on how many rows the call has:
    matmuls (BLAS / oneDNN split them by shape and threads), attention, reductions (norms,
    softmax), and elementwise transcendental math and activations (a vectorized body and a scalar
    tail round differently, and the tensor's size decides which computes an element: BART's GELU
    on 5 rows differed from the same rows among 15)."""
    global _PROBED
    if _PROBED is None:
        F = torch.nn.functional
        T = torch.Tensor
        named = {getattr(owner, f"{name}{suffix}", None) for owner in (torch, T) for name in _TRANSCENDENTAL
                 for suffix in ("", "_")}
        named |= {getattr(F, name, None) for name in _ACTIVATIONS} | {T.__pow__, T.__rpow__}
        named |= {
            F.linear, F.bilinear, F.scaled_dot_product_attention, F.conv1d, F.conv2d, F.conv3d,
            torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm,
            torch.addmm, T.addmm, torch.baddbmm, T.baddbmm, torch.einsum, torch.tensordot,
            F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, T.softmax,
            torch.log_softmax, T.log_softmax, torch.mean, T.mean, torch.sum, T.sum, torch.var, T.var,
            torch.std, T.std, torch.norm, T.norm, torch.logsumexp, T.logsumexp, torch.cumsum, T.cumsum,
            getattr(F, "rms_norm", None),
        }
        _PROBED = frozenset(named - {None})
    return _PROBED


def expand_operand(t: torch.Tensor, prompts: int, k: int) -> torch.Tensor:
    """``t`` (dim 0 = ``prompts * r`` rows, ``r`` rows per prompt) as DynamicCache holds it: dim 0
    ``prompts * k * r``, each prompt's ``r`` rows repeated ``k`` times in a row, with ``t``'s
    strides and storage offset (a stride-0 dim 0 stays a broadcast)."""
    n = t.shape[0]
    size = (n * k, *t.shape[1:])
    if t.stride(0) == 0:
        return t.as_strided(size, t.stride(), t.storage_offset())
    values = t.reshape(prompts, n // prompts, *t.shape[1:]).repeat_interleave(k, dim=0).reshape(size)
    span = 1 + sum((s - 1) * st for s, st in zip(size, t.stride()))  # elements the view reaches
    storage = t.new_empty(t.storage_offset() + span)
    out = storage.as_strided(size, t.stride(), t.storage_offset())
    if out.shape and torch._debug_has_internal_overlap(out) == 1:  # t's strides alias rows at k x the rows
        out = values.contiguous()
    else:
        out.copy_(values)
    return out


def _describe(value: Any) -> Any:
    """A hashable stand-in for an argument: a tensor's layout (not its values), else the value."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride() if value.layout == torch.strided else None,
                value.storage_offset() % 64 if value.layout == torch.strided else None, value.dtype,
                value.device.type, isinstance(value, torch.nn.Parameter))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_describe(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _describe(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass(slots=True)
class _Counts:
    probed: int = 0     # signatures compared in this forward
    expanded: int = 0   # calls that ran on the expanded rows (their signature is not exact)


class RowExactness(TorchFunctionMode):
    """While active (``with RowExactness(prompts=B, repeats=k):`` around a forward on ``B`` rows)
    and :attr:`watching` is set, every probed call (:func:`probed_functions`) is checked against
    its expansion to ``B*k`` rows (module docstring).

    Row-indexed operands are the tensors whose dim 0 is a multiple of ``prompts`` and that are not
    ``nn.Parameter``s (weights and biases are shared by all rows). A call with none, or whose
    result is not indexed by row, is not checked: the base model's activations have their rows
    first; a tensor with its rows elsewhere (multimodal rotary position ids ``[3, B, T]``, used
    in an outer product of one term, exact at any size) is not expanded along them.

    Invariant: a signature's cached verdict was measured on this process with its thread count.
    """

    def __init__(self, *, prompts: int, repeats: int) -> None:
        super().__init__()
        self.prompts = prompts
        self.repeats = repeats
        self.watching = False
        self.base_calls = 0  # forwards of the watched module (the caller switches ``watching``)
        self.counts = _Counts()

    @property
    def expanded(self) -> int:
        """Calls that ran on DynamicCache's rows because their unique-row result differed."""
        return self.counts.expanded

    def _rows(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.dim() > 0
                and value.shape[0] % self.prompts == 0 and value.shape[0] > 0)

    def _expand(self, value: Any) -> Any:
        if self._rows(value):
            return expand_operand(value, self.prompts, self.repeats)
        if isinstance(value, (tuple, list)):
            return type(value)(self._expand(v) for v in value)
        return value

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.watching or func not in probed_functions():
            return func(*args, **kwargs)
        operands = [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (tuple, list)) else (a,))]
        if not any(self._rows(a) for a in operands):
            return func(*args, **kwargs)
        key = (func, _describe(args), _describe(kwargs), self.prompts, self.repeats, torch.get_num_threads())
        verdict = _VERDICTS.get(key)
        if verdict == "exact":
            return func(*args, **kwargs)
        # the expansion first: an in-place function (``exp_``) changes its operand
        big = self._expanded_call(func, args, kwargs)
        if verdict == "expanded":
            self.counts.expanded += 1
            # the unique call still runs, for its output's layout (DynamicCache's call lays its output out
            # the same way, and later calls may take another path for another layout) and an in-place operand
            out = func(*args, **kwargs)
            return out.copy_(self._first_repeats(big))
        out = func(*args, **kwargs)
        if not self._rows(out):  # a result not indexed by row: no row to compare
            return out
        if verdict is None:
            self.counts.probed += 1
            verdict = self._judge(out, big)
            _remember(key, verdict)
            if verdict == "exact":
                return out
        if verdict == "inexact":
            raise InexactRows(f"{_name(func)} computes a prompt's repeats differently from each other at "
                              f"{torch.get_num_threads()} thread(s)")
        self.counts.expanded += 1
        return out.copy_(self._first_repeats(big))  # DynamicCache's bits, in the unique call's layout

    def _expanded_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return func(*self._expand(args), **{name: self._expand(v) for name, v in kwargs.items()})
        except Exception as exc:  # the operands are not laid out as this module assumes
            raise InexactRows(f"{_name(func)} could not be run on the expanded rows ({type(exc).__name__})") from exc

    def _grouped(self, big: torch.Tensor) -> torch.Tensor:
        return big.reshape(self.prompts, self.repeats, -1, *big.shape[1:])

    def _first_repeats(self, big: Any) -> torch.Tensor:
        if not isinstance(big, torch.Tensor):
            raise InexactRows("a probed call did not return one tensor")
        return self._grouped(big)[:, 0].reshape(-1, *big.shape[1:])

    def _judge(self, out: Any, big: Any) -> Verdict:
        if not (isinstance(out, torch.Tensor) and isinstance(big, torch.Tensor) and out.dim() > 0
                and big.shape[1:] == out.shape[1:] and big.shape[0] == out.shape[0] * self.repeats
                and out.shape[0] % self.prompts == 0):
            return "inexact"
        grouped = self._grouped(big)  # [B, k, r, ...]
        if torch.equal(grouped, out.reshape(self.prompts, 1, -1, *out.shape[1:]).expand_as(grouped)):
            return "exact"
        if torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
            return "expanded"
        return "inexact"


def _remember(key: tuple, verdict: Verdict) -> None:
    _VERDICTS[key] = verdict
    while len(_VERDICTS) > _MAX_VERDICTS:
        _VERDICTS.popitem(last=False)


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
