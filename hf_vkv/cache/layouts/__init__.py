"""Layouts: how a layer group's page tables become what attention reads (one object per layout).

====================  ==========================================  ==============================
name                  element order in a row                      attention reads
====================  ==========================================  ==============================
``"token_major"``     ``[tokens, members, (K | V), heads, dim]``  strided views (any attention)
``"head_major"``      ``[members, (K | V), heads][tokens, dim]``  DynamicCache-like views
``"paged"``           blocks of ``block_tokens`` in a pool        block tables (``"vkv_paged"``)
``"static"``          a contiguous layout, full capacity          fixed-address full views
====================  ==========================================  ==============================

:func:`layout_class` is the one place a name becomes a layout; the default on each device comes
from :func:`hf_vkv.devices.policy_for`.
"""

from __future__ import annotations

from ...memory.errors import CacheOptionError
from .base import Layout
from .head_major import HeadMajorLayout
from .paged import PagedLayout
from .static import StaticLayout
from .token_major import TokenMajorLayout

__all__ = [
    "LAYOUTS", "HeadMajorLayout", "Layout", "PagedLayout", "layout_option",
    "StaticLayout", "TokenMajorLayout", "layout_class",
]

#: Every layout by name.
LAYOUTS: dict[str, type[Layout]] = {cls.name: cls for cls in (TokenMajorLayout, HeadMajorLayout, PagedLayout)}


def layout_class(name: str) -> type[Layout]:
    """The layout called ``name`` (``ValueError`` naming the known ones otherwise)."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise CacheOptionError(f"unknown layout {name!r}; known layouts: {sorted(LAYOUTS)} "
                               f"(cache_config['layout'])") from None


def layout_option(class_name: str) -> str:
    """The ``cache_config['layout']`` name of the layout class called ``class_name`` (a saved
    row image records the class), or ``class_name`` itself where no layout has it."""
    return next((name for name, cls in LAYOUTS.items() if cls.__name__ == class_name), class_name)
