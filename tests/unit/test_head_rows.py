"""The base model's output repeated for the head, written only where the head reads it
(``hf_vkv.generate.head_rows``): what is admitted unwritten, and what fills the rest first."""

from __future__ import annotations

import pytest
import torch

from hf_vkv.generate.head_rows import HeadReads, RepeatedRows, repeat_for_head

B, K, T, H = 2, 3, 10, 4


def _hidden() -> torch.Tensor:
    return torch.randn(B, T, H, generator=torch.Generator().manual_seed(0))


def _rows(keep: int = 1) -> tuple[torch.Tensor, RepeatedRows]:
    hidden = _hidden()
    rows = repeat_for_head(hidden, K, keep)
    assert rows is not None
    return hidden, rows


def test_only_the_kept_positions_are_written_with_the_full_strides() -> None:
    hidden, rows = _rows(keep=2)
    full = rows.full
    assert full.shape == (B * K, T, H) and full.is_contiguous()
    assert rows.first == T - 2 and not rows.whole
    assert torch.equal(full[:, -2:], hidden.repeat_interleave(K, dim=0)[:, -2:])
    rows.fill()
    assert rows.whole and torch.equal(full, hidden.repeat_interleave(K, dim=0))


@pytest.mark.parametrize("keep", [None, 0, T, T + 1, 1.0, torch.tensor(1)])
def test_no_record_where_keep_does_not_name_positions_to_keep(keep) -> None:
    assert repeat_for_head(_hidden(), K, keep) is None


def test_a_slice_of_written_positions_runs_unfilled_and_equals_the_full_repeat() -> None:
    hidden, rows = _rows(keep=1)
    expected = hidden.repeat_interleave(K, dim=0)
    reads = HeadReads()
    reads.add(rows)  # the guard is on from here
    assert rows.full.shape[1] == T and rows.full.dim() == 3  # metadata reads nothing
    head_input = rows.full[:, -1:, :]
    last = rows.full[:, -1]
    narrowed = rows.full.narrow(1, T - 1, 1)
    out = torch.nn.functional.linear(head_input, torch.eye(H))
    assert not rows.whole
    held = rows.full
    reads.close()
    assert rows.whole  # still held (here, by `held`) when the guard went: filled
    assert head_input.stride() == expected[:, -1:, :].stride()  # DynamicCache's layout: the same kernel path
    assert torch.equal(out, expected[:, -1:, :]) and torch.equal(last, expected[:, -1]) \
        and torch.equal(narrowed, expected[:, -1:])


@pytest.mark.parametrize("read", [
    lambda t: t * 1.0,  # a transform of the whole state
    lambda t: t[:, -2:, :],  # a slice reaching an unwritten position
    lambda t: t[:, torch.tensor([T - 1]), :],  # advanced indexing: a copy, not a view
    lambda t: t.transpose(0, 1),  # a view of everything
    lambda t: torch.cat([t, t]),  # inside a list operand
    lambda t: t.sum(),
])
def test_any_other_read_fills_first_and_sees_the_full_repeat(read) -> None:
    hidden, rows = _rows(keep=1)
    reads = HeadReads()
    reads.add(rows)
    try:
        got = read(rows.full)
    finally:
        reads.close()
    assert rows.whole
    assert torch.equal(got, read(hidden.repeat_interleave(K, dim=0)))


def test_close_leaves_the_mode_fills_a_tensor_still_held_and_lets_go() -> None:
    _, held = _rows(keep=1)
    kept_elsewhere = held.full  # e.g. an output that kept the base model's hidden state
    _, dropped = _rows(keep=1)
    reads = HeadReads()
    reads.add(held)
    reads.add(dropped)
    reads.close()
    assert held.whole and kept_elsewhere is held.full
    assert not dropped.whole  # nothing else held it: it is never read again
    assert not reads.pending
    twice = dropped.full * 1.0  # the mode is gone: nothing fills any more
    assert not dropped.whole and twice.shape == dropped.full.shape
