"""Prefix reuse across ``generate()`` calls: a radix-tree store of finished prompts' KV pages
(:class:`PrefixStore`) and prefix files (:func:`save_prefix` / :func:`load_prefix`).

Decisions, in one place:

* **Entries are batch 1**: one unpadded prompt or conversation per entry, a 1-row fork of the
  cache that generated it plus the exact token ids of its cached positions.
* **Exact matching**: the radix tree (``radix.py``) compares token ids; no hash is ever trusted.
  ``lookup`` serves the longest common prefix with any entry (a fork, cut back with ``crop``),
  capped at ``len(input_ids) - 1`` so ``generate()`` always prefills at least one token.
* **A miss returns a new empty** :class:`~hf_vkv.VKVCache` (not ``None``): whatever ``lookup``
  returns goes straight into ``past_key_values``; ``get_seq_length()`` is the reuse.
* **Copy-on-write**: entries are forks nobody writes into; a request writing into a page it
  shares with an entry copies that page first. ``insert`` forks too, so the caller keeps its cache.
* **Sliding windows**: a layer drops pages wholly behind its window, so an entry serves a prefix of
  ``m`` tokens only if tokens ``[m - window + 1, m)`` are still held (``VKVCache.min_prefix_length``); other
  prompts are served by another entry or miss. Cutting such a fork back turns on
  ``activate_past_recording()`` on it (transformers' rule for ``crop``).
* **Bytes held** are the union of the entries' physical pages (``(arena, page id)`` pairs read
  from their page tables) times the page size: a page shared by entries counts once. Pages a live
  request shares with an entry are counted (they are held for the store too).
* **Eviction**: least recently used entries (``lookup`` hits and ``insert`` count as use) are
  dropped until the bytes held fit the budget; a dropped entry's cache is closed at once, so its
  pages go back to the pool unless another entry or a request still holds them. An entry that
  extends another makes the shorter one redundant: it is dropped at insert.
* **Files** (``persist.py``): safetensors, per-layer K/V plus JSON metadata (format version,
  layout ``"contiguous"``, dtype, token ids, config fingerprint and fields, optional weights
  fingerprint: the store's when it saves its entries). ``PrefixStore.save(folder)`` writes one file
  per entry and an index (``prefix_store.json``, least recently used first) that
  ``PrefixStore(config).load(folder, model=model)`` reads back, all or nothing. A file loads onto any device the
  cache has a backend for: the host (CPU) backend, or the CUDA backend on a CUDA device
  (``hf_vkv[cuda]``; not yet run on a GPU).
"""

from .errors import (
    PrefixFileCorruptError,
    PrefixFileError,
    PrefixFormatError,
    PrefixIsAFolderError,
    PrefixMismatchError,
    PrefixNotAFolderError,
    PrefixNotFoundError,
    PrefixPathError,
)
from .persist import load_prefix, save_prefix
from .radix import RadixTree
from .store import PrefixStats, PrefixStore

__all__ = [
    "PrefixFileCorruptError", "PrefixFileError", "PrefixFormatError", "PrefixMismatchError", "PrefixPathError",
    "PrefixNotFoundError", "PrefixIsAFolderError", "PrefixNotAFolderError", "PrefixStats",
    "PrefixStore", "RadixTree", "load_prefix", "save_prefix",
]
