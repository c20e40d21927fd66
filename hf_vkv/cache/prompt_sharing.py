"""Prompt sharing: a layer group's prefill of repeated prompts stores each prompt's pages once.

``generate`` repeats every prompt ``k`` times before its prefill (rows ``r*k .. r*k+k-1`` hold one
prompt). At a group's first write of a prefill, the first row of each ``k`` (its *leader*) takes
pages and the other rows (its *followers*) point at the leader's pages (a page-table share,
nothing copied). A follower keeps sharing only while its states equal its leader's, layer after
layer; the first that differs gets its own pages (copies of the leader's, right for the layers
written so far, which all compared equal) and is written on its own from then on. When the
prefill's writes are over (the group's next step or row operation), the rows still following
count as sharing their prompt.

This object holds which rows follow whom and the count; the row buffer does the page-table work
and the group decides when.

Invariants: a follower ``f`` follows the leader ``f - f % k``; followers exist only between a
prefill's first write and the next step or row operation (:meth:`PromptSharing.settle`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..memory import RowBuffer

__all__ = ["PromptSharing"]


class PromptSharing:
    """The prompt sharing of one layer group (see the module docstring).

    ``repeats``: rows per prompt (``k``); ``enabled``: ``cache_config['share_prompts']``.
    ``shared_rows``: rows that took their prompt from another row's pages so far.
    """

    def __init__(self, *, repeats: int, enabled: bool) -> None:
        self.repeats = repeats
        self.enabled = enabled
        self.shared_rows = 0
        self._followers: dict[int, int] = {}  # during a prefill: row -> the leader row whose pages it shares

    @property
    def rows(self) -> int:
        """Rows that took their prompt from another row's pages (a prefill in progress included)."""
        return self.shared_rows + len(self._followers)

    @property
    def following(self) -> bool:
        """Whether a prefill's followers still share their leaders' pages."""
        return bool(self._followers)

    def applies(self, *, batch: int, start: int, end: int) -> bool:
        """Whether a write of tokens ``[start, end)`` to ``batch`` rows is a prefill whose rows
        repeat prompts (only each prompt's first row is written; the others share its pages)."""
        k = self.repeats
        return self.enabled and start == 0 and end > 0 and k > 1 and batch % k == 0

    def start(self, buffer: RowBuffer, *, batch: int, start: int, end: int) -> bool:
        """Before a write of tokens ``[start, end)`` to ``batch`` rows: where :meth:`applies`,
        make the leaders' pages writable, share them with their followers and return ``True``;
        else do nothing and return ``False`` (the group prepares every row)."""
        k = self.repeats
        if not self.applies(batch=batch, start=start, end=end):
            return False
        leaders = range(0, batch, k)
        buffer.truncate(range(batch), 0)
        buffer.prepare_write(leaders, 0, end)
        for leader in leaders:
            buffer.share(leader, range(leader + 1, leader + k), length=end)
            self._followers.update({r: leader for r in range(leader + 1, leader + k)})
        return True

    def leavers(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
        """The followers whose ``[B, H, q, D]`` states differ from their leader's: they stop
        following (the group gives them pages of their own and writes them)."""
        out = [row for row, leader in self._followers.items()
               if not (torch.equal(key_states[row], key_states[leader])
                       and torch.equal(value_states[row], value_states[leader]))]
        for row in out:
            del self._followers[row]
        return out

    def writes(self, batch: int) -> list[int]:
        """The rows of ``batch`` a member writes itself (the followers' tokens are their leader's)."""
        return [r for r in range(batch) if r not in self._followers]

    def settle(self) -> None:
        """The prefill's writes are over: the rows still following share their leader's prompt."""
        self.shared_rows += len(self._followers)
        self._followers = {}

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Inside, a prefill's rows are distinct prompts (no sharing among them)."""
        saved, self.repeats = self.repeats, 1
        try:
            yield
        finally:
            self.repeats = saved
