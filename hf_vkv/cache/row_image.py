"""What one row of a layer group holds, as page tables: the record a prefix file maps back.

A :class:`GroupImage` names everything a group needs to hold a row again without writing a byte:
its members and geometry, its layout and buffer shape, its members' lengths and, per part of the
row (a head-major row has one per (layer, K/V, head)), the :class:`~hf_vkv.memory.Row` table of
pages. :meth:`LayerGroup.row_image` makes one; :meth:`LayerGroup.install_row` takes one whose
tables hold pages of the group's arena (a saved prefix's pages, mapped from its file).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory import PageStore, Row
from .geometry import GroupGeometry

__all__ = ["GroupImage"]


@dataclass(frozen=True, slots=True)
class GroupImage:
    """Row 0 of a layer group (a batch-1 cache's), as page tables.

    ``layout`` is the layout's class name; ``item_bytes``, ``parts`` and ``page_bytes`` its
    buffer's shape; ``tables[k]`` the table of part ``k`` (pages of ``store``: the arena the group
    draws from); ``lengths[m]`` the tokens member ``m`` holds."""

    name: str
    members: tuple[int, ...]
    geometry: GroupGeometry
    layout: str
    item_bytes: int
    parts: int
    page_bytes: int
    lengths: tuple[int, ...]
    tables: tuple[Row, ...]
    store: PageStore | None = None  # where the pages live (None in a record read from a file)

    def pages(self) -> list:
        """Every page the tables hold, each once, in first-seen order."""
        return list(dict.fromkeys(p for table in self.tables for p in table.pages))
