"""The base model's last hidden state, repeated for the head, written only where the head reads it.

Prefill once (:mod:`hf_vkv.generate.prefill_once`) runs the base model on one row per prompt and
repeats its output rows ``k`` times before the head reads them, so that the head computes exactly
what it computes over DynamicCache's ``B*k`` rows. A head that honours generate's
``logits_to_keep`` reads only the last positions of each row, yet a full repeat writes every
position: ``[64, 8000, 576]`` float32 is 1.2 GB and ~0.45 s at 8,000 tokens and 64 rows, of which
the head reads one position a row.

:func:`repeat_for_head` writes only those positions into a tensor of the full shape and strides
(the rest is memory the allocator hands out unwritten: a large one is mapped lazily), so the
head's slice has DynamicCache's layout and runs the same kernel. :class:`HeadReads` (a torch
function mode around the forward) keeps that exact by construction: a call that takes the tensor
and is a slice lying in the written positions, or a read of its metadata, runs as it is; any other
call on it (a transform of the whole state, a view reaching unwritten positions) first fills the
rest (:meth:`RepeatedRows.fill`), so it reads what a full repeat holds.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode

from ..memory import section

__all__ = ["HeadReads", "RepeatedRows", "repeat_for_head"]


class RepeatedRows:
    """``full`` (``[B*k, T, H]``, contiguous): ``hidden`` (``[B, T, H]``) repeated ``k`` times per
    row, written from position :attr:`first` on (all of it once :attr:`whole`).

    Invariant: every element of ``full`` that a call has read is its repeat's value (a call on
    ``full`` itself; an admitted slice is not followed further: a head that re-strides its own slice
    past it, ``as_strided``, would not be guarded)."""

    __slots__ = ("full", "hidden", "k", "first")

    def __init__(self, hidden: torch.Tensor, k: int, keep: int) -> None:
        tokens = hidden.shape[1]
        self.hidden, self.k, self.first = hidden, k, tokens - keep
        self.full = torch.empty((hidden.shape[0] * k, *hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
        self.full[:, self.first:].copy_(hidden[:, self.first:].repeat_interleave(k, dim=0))

    @property
    def whole(self) -> bool:
        return self.first == 0

    def fill(self) -> None:
        """Write the positions before :attr:`first` too: ``full`` is then the full repeat."""
        if self.first:
            self.full[:, :self.first].copy_(self.hidden[:, :self.first].repeat_interleave(self.k, dim=0))
            self.first = 0

    def holds(self, view: Any) -> bool:
        """Whether ``view`` is a view of ``full`` that reaches written positions only: every row's
        part of it (at ``full``'s row stride) lies in that row's positions ``first ..``."""
        full = self.full
        if not isinstance(view, torch.Tensor) or view.dim() < 1 or view.dtype != full.dtype \
                or view.device != full.device \
                or view.untyped_storage().data_ptr() != full.untyped_storage().data_ptr() \
                or view.shape[0] != full.shape[0] or view.stride(0) != full.stride(0) or min(view.stride()) < 0:
            return False
        start = view.storage_offset() - full.storage_offset()  # row 0's first element
        span = sum((n - 1) * s for n, s in zip(view.shape[1:], view.stride()[1:]))
        return self.first * full.stride(1) <= start and start + span < full.stride(0)


def repeat_for_head(hidden: torch.Tensor, k: int, keep: Any) -> RepeatedRows | None:
    """``hidden`` repeated for a head that reads its last ``keep`` positions (generate's
    ``logits_to_keep``: a positive int below the token count), or ``None`` where ``keep`` does not
    say that (the caller repeats it whole)."""
    if type(keep) is not int or hidden.dim() != 3 or not 0 < keep < hidden.shape[1]:
        return None
    return RepeatedRows(hidden, k, keep)


#: Calls that read a tensor's metadata, never its elements.
_METADATA = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.numel,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.__len__, torch.Tensor.is_floating_point,
    torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__, torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_quantized.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_meta.__get__, torch.Tensor.is_nested.__get__,  # type: ignore[attr-defined]
})
#: Calls that may return a view of their first operand (checked with :meth:`RepeatedRows.holds`).
_SLICES = frozenset({torch.Tensor.__getitem__, torch.Tensor.narrow, torch.narrow, torch.Tensor.select,
                     torch.select})


def leave_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack with every mode above it (pushed while it was
    on, and left there by an interrupt); nothing if it is not on it (an interrupt in torch's own
    ``_pop_mode_temporarily`` can drop a mode from the stack). Call with Ctrl-C held."""
    stack = _get_current_function_mode_stack()
    if not any(m is mode for m in stack):
        return
    for m in reversed(stack):
        _pop_mode()
        if m is mode:
            return


class HeadReads(TorchFunctionMode):
    """While active, guards the :class:`RepeatedRows` in :attr:`pending` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[RepeatedRows] = []
        self._active = False

    def add(self, rows: RepeatedRows) -> None:
        """Guard ``rows`` from now on (the first one enters this mode: it stays active, on top of
        the modes entered before, until :meth:`close`)."""
        with section():  # entered and recorded as one (a Ctrl-C between would leave the mode on for good)
            if not self._active:
                self.__enter__()
                self._active = True
            self.pending.append(rows)

    def close(self) -> None:
        """At the forward's end: leave the mode (if :meth:`add` entered it), fill any tensor that
        something beyond its record still holds (so nothing reads unwritten positions later), and
        let go of all of them."""
        with section():
            if self._active:
                self._active = False
                leave_mode(self)
        for rows in self.pending:
            if not rows.whole and sys.getrefcount(rows.full) > 2:  # the record's reference and the call's
                rows.fill()
        self.pending.clear()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        taken = [rows for rows in self.pending if not rows.whole and _takes(rows.full, args, kwargs)]
        if not taken or func in _METADATA:
            return func(*args, **kwargs)
        if func in _SLICES and len(taken) == 1 and args and args[0] is taken[0].full:
            out = func(*args, **kwargs)
            if taken[0].holds(out):
                return out
        for rows in taken:
            rows.fill()
        return func(*args, **kwargs)


def _takes(full: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``full`` is an operand (top level, or in a list or tuple operand)."""
    for value in (*args, *kwargs.values()):
        if value is full or (isinstance(value, (list, tuple)) and any(v is full for v in value)):
            return True
    return False
