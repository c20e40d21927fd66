"""``PrefixStore``: finished prompts and conversations kept as KV pages, reused by later requests.

A request looks its prompt up; the store answers with a zero-copy fork of the stored cache that
shares the longest prefix with it, and ``generate()`` prefills only the rest::

    store = hf_vkv.PrefixStore(model.config, budget_bytes=512 << 20)
    cache = store.lookup(input_ids)                       # a fork, or an empty cache on a miss
    out = model.generate(input_ids, cache=cache, return_dict_in_generate=True, ...)
    n = out.cache.get_seq_length()
    store.insert(out.sequences[0, :n], out.cache)   # the store keeps its own fork

(``past_key_values=`` and ``out.past_key_values`` with transformers 5.17-5.23.) Entries are batch-1
caches: one prompt (or conversation) per entry, unpadded.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import devices
from ..cache import VKVCache
from ..cache.options import config_dict
from ..memory import PageId, PagePool, SectionLock
from ..memory.errors import ArgumentError, ArgumentTypeError, InvariantError
from ..memory.held_pages import HeldPages, PageCounts
from ..memory.process import ProcessLock
from .errors import (
    PrefixFileCorruptError,
    PrefixFormatError,
    PrefixIsAFolderError,
    PrefixMismatchError,
    PrefixNotAFolderError,
    PrefixNotFoundError,
    path_argument,
)
from .fingerprint import (WEIGHTS_DIFFER, TensorsSeen, config_fingerprint, config_record, describe_config_difference,
                          weights_fingerprint)
from .mapped import (PAGES_FILE, MappedEntry, check_index_text, clean_saves, commit_lock, index_text, map_entries,
                     read_lock, write_pages)
from .page_check import MappedPages
from .persist import _check_model, _load, _save
from .radix import RadixTree
from .tokens import check_unpadded, outside_vocabulary, token_list
from ..version import __version__

__all__ = ["PrefixStore", "PrefixStats", "token_list", "saved_files", "STORE_INDEX"]

#: The index :meth:`PrefixStore.save` writes into its folder: the files it saved, least recently used first.
STORE_INDEX = "prefix_store.json"
STORE_FORMAT = "hf_vkv.prefix_store"
STORE_VERSION = 4  # 2: the entries' pages in one mapped file (prefix_store.kv); 3: its index's checksums and
#                    tables written compactly (hex, runs); 4: page checksums that weigh each word by its place
#                    (page_check.WEIGHTED64). Versions 1 to 3 still load.
_MAPPED_VERSIONS = (2, 3, STORE_VERSION)  # indexes with a digest, model fields and mapped pages


@dataclass(frozen=True, slots=True)
class PrefixStats:
    """Counters of a :class:`PrefixStore` (since it was created) and what it holds now."""

    entries: int  # stored prefixes now
    lookups: int  # lookup() calls
    hits: int  # lookups answered with a stored prefix
    tokens_reused: int  # prefix tokens handed out by hits (not prefilled again)
    inserts: int  # insert() calls that stored a new entry
    evictions: int  # entries dropped to stay under the budget
    bytes_held: int  # physical bytes of the entries' pages, each page once however many entries share it
    budget_bytes: int | None  # the budget (None: unbounded)
    prompt_tokens: int = 0  # prompt tokens of the generate() calls that reused this store (every row)
    prompt_tokens_computed: int = 0  # of those, the tokens their prefills computed (common prefixes included)

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


@dataclass(slots=True, eq=False)
class _Entry:
    id: int
    tokens: tuple[int, ...]  # token ids of the cached positions, exactly
    cache: VKVCache | None  # a batch-1 fork owned by the store; nobody writes into it (None: not installed yet)
    min_reuse: int  # shortest prefix the cache can be cut back to (sliding windows)
    pages: HeldPages | None  # the physical pages it holds (fixed; None: not read yet, _pages_of)
    mapped: tuple[MappedPages, tuple[PageId, ...]] | None = None  # a mapped file's pages, until verified
    pending: MappedEntry | None = None  # a mapped file's entry, until first used: then it fills ``cache``


def _device_type(device: Any) -> str:
    """The type of ``device`` (a ``torch.device``, a name such as ``"cpu"`` or ``"cuda:0"``) as a
    store keeps its memories by, or a typed error: :class:`ArgumentTypeError` for what names no
    device, :class:`~hf_vkv.devices.UnsupportedDeviceError` for a device vkv does not serve."""
    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(f"PrefixStore.memory(device) takes a torch.device or a device name such as 'cpu' or "
                                f"'cuda:0', got {type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise ArgumentTypeError(f"PrefixStore.memory(device): {device!r} names no device ({exc})") from None
    devices.policy_for(device)  # a device no backend serves: refused here, not at a call's first step
    return device.type


# held by every PrefixStore.save of the process (not call state: a file lock's stand-in); unheld in a forked child
_SAVING = ProcessLock()


class PrefixStore:
    """KV caches of finished prompts, keyed by their exact token ids in a radix tree.

    * :meth:`lookup` forks (zero copy) the entry that shares the longest prefix with a prompt,
      cut back to that prefix and to at most ``len(prompt) - 1`` tokens, so ``generate()`` has at
      least one token to prefill. A miss returns a new, empty :class:`VKVCache` (so a caller
      always passes what it gets as ``past_key_values``; ``get_seq_length()`` tells the tokens
      reused).
    * :meth:`take` moves an entry that a prompt continues exactly into the caller's empty cache
      (no mapping): the caller's finished row, inserted afterwards, replaces it.
    * :meth:`insert` keeps a fork of a finished cache; the caller may go on using its own. A new
      entry that extends an entry makes that one redundant (the longer one serves its prefixes
      by cutting back), so a conversation holds one entry, its latest turn.
    * Matching compares token ids exactly. A stored cache is never written: requests write into
      their forks, and a write into a page shared with an entry copies the page first.
    * ``budget_bytes`` bounds :attr:`PrefixStats.bytes_held` (the entries' distinct physical
      pages); least recently used entries go first, and an entry's pages go back to their pool
      unless another entry or a live request still holds them.

    Sliding-window layers drop pages behind their window, so an entry serves a prefix of ``m``
    tokens only if the window before ``m`` is still mapped; a prompt that shares less with it is
    served by another entry or is a miss (never wrong K/V).

    Every cache the store makes (lookups, and the caches ``generate`` builds with
    ``cache_config={"prefix_store": store}``) draws from one memory (:attr:`memory`), so a request's
    rows share pages with the entries it starts from. One store may serve several threads at once:
    its methods hold a lock, and the memory's page operations hold the page store's own.

    ``copy.deepcopy(store)`` is the store itself (``generate`` deep-copies its generation config,
    ``cache_config`` included; a copy would take the inserts away from the user's store).

    Invariants (:meth:`check_invariants`): the radix tree holds exactly the entries' token ids;
    every entry is a batch-1 cache of exactly ``len(tokens)`` tokens (or a mapped entry's page
    tables, holding their pages, until its first use); the running count of bytes held is the sum
    over the entries' distinct pages; after any insert ``bytes_held <= budget_bytes``.
    """

    def __init__(self, config: Any, *, budget_bytes: int | None = None, cache_config: dict[str, Any] | None = None
                 ) -> None:
        if config is None or not hasattr(config, "get_text_config"):
            raise ArgumentTypeError(f"PrefixStore needs the model's config, got {type(config).__name__}: "
                                    f"PrefixStore(model.config, ...)")
        self.config = config
        self._lock = SectionLock()  # held, it holds Ctrl-C too (hf_vkv.memory.interrupts)
        self._budget: int | None = None
        self.budget_bytes = budget_bytes
        self.cache_config = config_dict(cache_config)
        # device type -> an empty cache whose arenas the store draws from (no pages until a first
        # update); the CPU's is made now, which checks the options in cache_config's words
        self._memories: dict[str, VKVCache] = {}
        self._memory_of("cpu")
        self._device_type = "cpu"  # of the last memory asked for: where new_cache() draws from
        self._config_known = config_record(config)  # what files record and are compared with
        self._fingerprint: str = self._config_known["config_fingerprint"]
        self._tree: RadixTree[int] = RadixTree()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        self._dtype: torch.dtype | None = None
        self._weights: str | None = None  # weights fingerprint of the model the entries were computed with
        self._files: list[MappedPages] = []  # the page files opened (load), watched for writes (_check_files)
        self._versions: TensorsSeen | None = None  # its model's tensors and their version counters (weights_identity)
        # the entries' pages, each counted once however many entries hold it (bytes_held): kept as
        # entries come and go; an entry is counted when first needed (a mapped entry's at open costs
        # a pass over its pages that opening does not need)
        self._counts = PageCounts()  # the counted entries' pages; its bytes: bytes_held
        self._uncounted: set[int] = set()  # ids of entries whose pages are not counted yet
        self._leaving: list[HeldPages] = []  # counted pages of entries taken, not discounted yet
        self._lookups = self._hits = self._reused = self._inserts = self._evictions = 0
        self._said_over_budget = False  # whether insert warned of an entry over the budget
        self._prompt_tokens = self._computed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo: dict[int, Any]) -> PrefixStore:
        return self  # a handle on shared memory, as a model is: see the class docstring

    def __copy__(self) -> PrefixStore:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ArgumentTypeError(
            "a PrefixStore holds memory mapped in this process and is not pickled (pickle, torch.save): "
            "store.save(folder, model=model) writes its entries, and PrefixStore(model.config).load(folder, "
            "model=model) maps them in any process")

    def memory(self, device: torch.device | str = "cpu") -> VKVCache:
        """An empty cache whose memory (arenas) every cache of this store on ``device`` draws
        from: ``VKVCache(..., memory_of=store.memory(device))`` makes a cache whose rows can share
        the entries' pages. It holds no pages itself."""
        kind = _device_type(device)
        self._check_process()
        with self._lock:
            self._device_type = kind
            return self._memory_of(kind)

    def _check_process(self) -> None:
        """:class:`~hf_vkv.memory.process.ForkedMemoryError` in a child forked after the store's
        memory was made (its pages are the parent's); checked before the lock, which the fork may
        have copied held."""
        for root in list(self._memories.values()):
            root.check_process("this PrefixStore")

    def _memory_of(self, kind: str) -> VKVCache:
        """The memory of device type ``kind``, made on first use (under the lock)."""
        root = self._memories.get(kind)
        if root is None:
            root = self._memories[kind] = VKVCache.from_cache_config(self.config, self._options(kind))
            root.on_memory_full(_weak_reclaim(self))  # entries go before a call drawing from it fails
        return root

    def _reclaim(self, pages: int, pool: PagePool) -> bool:
        """A call drawing from the store's memory found its budget full: let entries go, least
        recently used first, as many as make room for ``pages``; whether any went.

        First the entries whose pages no one else holds, counting the pages each frees. Where
        those cannot make room, also the entries whose pages live rows share (the call's own
        history, which it borrowed: letting such an entry go frees none of its pages, but a row's
        write into a page it then holds alone needs no copy), counting those pages as the copies
        they may save. None goes where all of them could not make room (the step would fail all
        the same)."""
        with self._lock:
            stats = pool.stats()
            free, going, sharing = stats.budget_pages - stats.in_use, [], []
            for entry in self._entries.values():  # least recently used first
                if free >= pages:
                    break
                counts = [int(pool.refcount(int(p))) for store, (_, ids) in _pages_of(entry).pages.items()
                          if getattr(store, "pool", None) is pool for p in ids]
                alone = sum(c == 1 for c in counts)
                if alone:
                    going.append(entry)
                    free += alone
                elif counts:
                    sharing.append((entry, len(counts)))
            for entry, shared in sharing:  # (least recently used first)
                if free >= pages:
                    break
                going.append(entry)
                free += shared
            if free < pages:
                return False
            for entry in going:
                self._drop(entry)
                self._evictions += 1
            return bool(going)

    def _options(self, kind: str) -> dict[str, Any]:
        options = dict(self.cache_config)
        if kind == "cpu" and options.get("page_bytes") is None:
            options["page_bytes"] = devices.PREFIX_STORE_PAGE_BYTES
        return options

    def new_cache(self, *, device: torch.device | str | None = None, **kwargs: Any) -> VKVCache:
        """An empty cache of the store's model, options and memory on ``device`` (default: the
        device of the last cache the store made; ``kwargs``: ``batch_size``, ...)."""
        kind = torch.device(device).type if device is not None else self._device_type
        return VKVCache(self.config, memory_of=self.memory(kind), **{**self._options(kind), **kwargs})

    @property
    def config_fingerprint(self) -> str:
        """sha256 (hex) of the store's model config (:func:`~hf_vkv.prefix.fingerprint.config_fingerprint`:
        every field but the inert ones): a model whose config fingerprints the same can reuse its entries."""
        return self._fingerprint

    @property
    def budget_bytes(self) -> int | None:
        """Most bytes the entries may hold (``None``: unbounded). Setting it evicts at once."""
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, budget_bytes: int | None) -> None:
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool)):
            raise ArgumentTypeError(f"budget_bytes must be a positive int of bytes (or None for no bound), got "
                                    f"{type(budget_bytes).__name__} {budget_bytes!r}: e.g. budget_bytes=1 << 30 for 1 GiB")
        if budget_bytes is not None and budget_bytes <= 0:
            raise ArgumentError(f"budget_bytes must be a positive int (or None for no bound), got {budget_bytes!r}")
        with self._lock:
            self._budget = budget_bytes
            if hasattr(self, "_entries"):
                self._evict()

    # ----------------------------------------------------------------------------- requests
    def lookup(self, input_ids: Any) -> VKVCache:
        """A cache holding the longest stored prefix of ``input_ids`` (``[T]`` or ``[1, T]``).

        The prefix is at most ``T - 1`` tokens; the cache is a fork that shares the entry's
        pages; pass it as ``past_key_values`` with the whole ``input_ids``. On a miss the cache
        is new and empty.
        """
        with self.borrow(input_ids) as (entry, m):  # which checks the process
            if entry is not None:
                return entry.fork(m)
        return self.new_cache()

    @contextlib.contextmanager
    def borrow(self, input_ids: Any) -> Iterator[tuple[VKVCache | None, int]]:
        """``(the entry holding the longest stored prefix of input_ids, its length m)`` — or
        ``(None, 0)`` on a miss — for reading the entry's first ``m`` tokens (e.g. with
        :meth:`VKVCache.take_rows`) while the store is locked: no fork is made, and no thread can
        evict the entry meanwhile. Counted as a :meth:`lookup`. Never write into the entry."""
        self._check_process()
        tokens = token_list(input_ids, name="input_ids")
        with self._lock:
            self._lookups += 1
            found = self._longest(tokens)
            if found is None:
                yield None, 0
                return
            entry, m = found
            cache = self._cache_of(entry)
            self._verify(entry)
            self._entries.move_to_end(entry.id)
            self._hits += 1
            self._reused += m
            yield cache, m

    def take(self, input_ids: Any, *, into: VKVCache, tail_tokens: int = 0) -> int:
        """Move the entry that holds the longest stored prefix of ``input_ids`` (``[T]`` or
        ``[1, T]``) into the empty cache ``into`` when it holds exactly that prefix (``input_ids``
        continue it) or at most ``tail_tokens`` tokens more (cut off: :meth:`VKVCache.cut_to`),
        and return the prefix's length ``m``: the entry leaves the store and its row moves
        (:meth:`VKVCache.take_over`: no page is mapped or copied). For a caller that continues
        the row and inserts the longer row afterwards, which would have made the entry redundant
        anyway. Returns 0 (nothing moved, nothing counted) where the entry holds more than
        ``tail_tokens`` tokens past the prefix (it serves other prompts: :meth:`borrow`,
        :meth:`lookup`) or ``into`` cannot hold the entry's row. Counted as a :meth:`lookup`
        when it moves."""
        self._check_process()
        if not isinstance(into, VKVCache):
            raise ArgumentTypeError(f"take(into=...) fills a VKVCache (store.new_cache()), got {type(into).__name__}")
        tokens = token_list(input_ids, name="input_ids")
        with self._lock:
            found = self._longest(tokens)
            if found is None or len(found[0].tokens) - found[1] > max(tail_tokens, 0):
                return 0
            entry, m = found
            source = self._cache_of(entry)
            self._verify(entry)
            if entry.id not in self._uncounted:
                _pages_of(entry)  # read from the cache before its row moves
            try:
                into.take_over(source)
            except ValueError:
                return 0
            if m < len(entry.tokens):
                into.cut_to(m)  # (take_over moved only full-attention vkv layers: each can be cut back)
            entry.cache = None
            source.close()
            self._drop(entry, later=True)  # its pages are discounted at the next count, off the caller's time
            self._lookups += 1
            self._hits += 1
            self._reused += m
            return m

    def _longest(self, tokens: list[int]) -> tuple[_Entry, int] | None:
        """The entry serving the longest prefix of ``tokens`` (at most all but the last token) and
        that prefix's length, or ``None``: what :meth:`borrow`, :meth:`take` and
        :meth:`longest_prefix` look up (under the lock)."""
        cap = len(tokens) - 1
        self._check_files()
        for shared, key in self._tree.common_prefixes(tokens[:cap]):
            entry = self._entries[key]
            m = min(shared, cap)
            if m >= max(entry.min_reuse, 1):
                return entry, m
        return None

    def _check_files(self) -> None:
        """Drop every entry holding pages of an opened page file that was written since it was
        opened (:meth:`MappedPages.changed`), with a warning: its pages may hold other bytes than
        were checked, or none (under the lock, before any entry is looked up or saved; an ``fstat``
        a file)."""
        for mapped in [m for m in self._files if m.changed()]:
            self._files.remove(mapped)
            gone = [e for e in self._entries.values() if mapped.holds(_pages_of(e))]
            for entry in gone:
                self._drop(entry)
            warnings.warn(f"PrefixStore: {mapped.path} was written after it was opened (its size or times changed: "
                          f"cp or rsync --inplace over it, a truncation): "
                          + (f"the {len(gone)} entries holding its pages were dropped, and requests compute those "
                             f"tokens again" if gone else "no entry held its pages any more")
                          + f"; save into a folder instead of "
                          f"writing a served page file in place, and load it again", UserWarning, stacklevel=4)

    def _verify(self, entry: _Entry) -> None:
        """Check a mapped entry's pages against their checksums before they are first handed out;
        on a difference drop every entry of that file (the store stays usable) and raise
        :class:`PrefixFileCorruptError`. Called after :meth:`_cache_of`, whose install maps the
        pages and reads none: the background check that the open started goes on meanwhile (its
        sums run without the GIL), so a turn right after an open finds most pages checked."""
        if entry.mapped is None:
            return
        mapped, pages = entry.mapped
        try:
            mapped.verify(pages)
        except PrefixFileCorruptError:
            for other in [e for e in self._entries.values() if e.mapped is not None and e.mapped[0] is mapped]:
                self._drop(other)
            raise
        entry.mapped = None

    def _cache_of(self, entry: _Entry) -> VKVCache:
        """The entry's cache; a mapped entry's is made and its row installed at its first use
        (opening a file makes no cache: :class:`~hf_vkv.prefix.mapped.MappedEntry`)."""
        if entry.cache is None:
            assert entry.pending is not None
            cache = VKVCache.from_cache_config(self.config, self.cache_config, batch_size=1,
                                               memory_of=self.memory("cpu"))
            try:
                entry.pending.install(cache)
            except BaseException:
                cache.close()
                raise
            entry.cache, entry.pending = cache, None
        return entry.cache

    def longest_prefix(self, input_ids: Any) -> int:
        """Tokens of ``input_ids`` :meth:`lookup` would serve now (counting nothing)."""
        tokens = token_list(input_ids, name="input_ids")
        with self._lock:
            found = self._longest(tokens)
        return 0 if found is None else found[1]

    def insert(self, token_ids: Any, cache: VKVCache, *, give: bool = False, weights: str | None = None) -> bool:
        """Keep a fork of ``cache``'s first ``len(token_ids)`` tokens, whose ids are ``token_ids``.

        After ``generate()``, the returned cache holds ``sequences[:, :cache.get_seq_length()]``
        (the last sampled token was never fed back). ``cache`` must be batch 1 and may be used on;
        the store's fork does not change when it is. ``give=True``: the store keeps ``cache``
        itself (no fork; it must hold exactly these tokens) and the caller must not use it again.
        ``weights``: the fingerprint of the weights that computed it
        (:func:`~hf_vkv.prefix.fingerprint.weights_fingerprint`; ``generate`` passes it): a store
        holds one model's weights (:attr:`weights_fingerprint`).

        Returns whether the entry is held afterwards (``False``: it alone is over the budget).
        An identical or longer entry that already serves these tokens is kept instead (and
        counts as used).

        Raises:
            TypeError: ``cache`` is not a :class:`VKVCache`, or ``token_ids`` are not token ids.
            ValueError: ``cache`` holds more than one row, fewer tokens than ``token_ids``, or
                cannot be cut back to them (sliding windows).
            PrefixMismatchError: ``cache`` belongs to another model, its dtype differs from
                the entries', ``weights`` from theirs, or a token id is outside the model's
                vocabulary (``field`` says which).
        """
        self._check_process()
        if weights is not None and not isinstance(weights, str):
            raise ArgumentTypeError(f"weights must be a weights fingerprint (a str: store.fingerprint(model)), got "
                                    f"{type(weights).__name__} {weights!r:.40}")
        tokens = tuple(token_list(token_ids))
        bad = outside_vocabulary(tokens, self.config)
        if bad is not None:  # refused now, not when a saved folder holding it is loaded
            raise PrefixMismatchError("token_ids", f"token id {bad[1]} at position {bad[0]} is outside the model's "
                                      f"vocabulary of {bad[2]} ids: insert the ids the cache was computed from")
        with self._lock:
            if weights is not None:
                self._check_weights(weights)
            inserted = self._insert(tokens, cache, give)
            if weights is not None and self._entries:
                self._weights = weights
            if not inserted and not self._said_over_budget:
                self._said_over_budget = True
                warnings.warn(
                    f"PrefixStore: an entry of {len(tokens):,} tokens needs more than the store's budget of "
                    f"{self._budget:,} bytes, so it was dropped as it was inserted and no later call reuses it "
                    f"(stats().evictions counts such entries; said once per store): raise budget_bytes",
                    UserWarning, stacklevel=2)
            return inserted

    def fingerprint(self, model: torch.nn.Module) -> str:
        """:func:`~hf_vkv.prefix.fingerprint.weights_fingerprint` of ``model`` (taken anew at each
        call: nothing cheaper tells that a parameter did not change)."""
        return weights_fingerprint(model)

    def unwritten_since(self, versions: TensorsSeen) -> bool:
        """Whether a model with the store's weights fingerprint whose tensors are ``versions``
        (:func:`~hf_vkv.prefix.fingerprint.weights_identity`) wrote none of its parameters or
        buffers in place and replaced none since the store's entries were computed, in this
        process (``False``: an optimizer step, ``load_state_dict``, an edit under
        ``torch.no_grad()``, a new pruning mask may have changed values the fingerprint does not
        sample; ``generate`` then steps aside).
        Where the store knows no counters for its entries (it is empty, or they were loaded or
        inserted by hand) it takes these: later writes are seen from here on."""
        with self._lock:
            if not self._entries or self._versions is None:
                self._versions = versions
                return True
            return self._versions == versions

    @property
    def weights_fingerprint(self) -> str | None:
        """The weights fingerprint of the model the entries were computed with (``None``: no
        entry, or entries inserted by hand without one). ``generate`` reuses the store only for
        a model with these weights, and steps aside (``ReuseReport.refusal``) for any other."""
        with self._lock:
            return self._weights if self._entries else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the entries' K/V (``None``: no entry). A store serves one dtype."""
        with self._lock:
            return self._dtype if self._entries else None

    def _insert(self, tokens: tuple[int, ...], cache: VKVCache, give: bool) -> bool:
        self._check_cache(cache, len(tokens))
        if give and cache.get_seq_length() != len(tokens):
            raise ArgumentError(f"insert(give=True) keeps the cache itself: it must hold exactly the {len(tokens)} tokens, "
                                f"not {cache.get_seq_length()}")
        if self._served(tokens):
            if give:
                cache.close()
            return True
        fork = cache if give else cache.fork(len(tokens))
        entry = _Entry(id=next(self._ids), tokens=tokens, cache=fork, min_reuse=fork.min_prefix_length(),
                       pages=fork.held_pages())
        return self._add(entry, _dtype_of(fork))

    def serves(self, token_ids: Any) -> bool:
        """Whether a stored entry already serves all of ``token_ids``: an :meth:`insert` of them
        would keep that entry instead of adding one (counting nothing, using nothing)."""
        tokens = tuple(token_list(token_ids))
        with self._lock:
            return self._served(tokens, use=False)

    def _served(self, tokens: tuple[int, ...], *, use: bool = True) -> bool:
        """Whether a stored entry already serves all of ``tokens`` (``use``: it then counts as used)."""
        for shared, key in self._tree.common_prefixes(tokens):
            if shared < len(tokens):
                break  # longest matches come first: no further entry holds all of tokens
            if self._entries[key].min_reuse <= len(tokens):
                if use:
                    self._entries.move_to_end(key)
                return True
        return False

    def _add(self, entry: _Entry, dtype: torch.dtype | None) -> bool:
        """Store ``entry``: drop the entries it makes redundant, count it, evict to the budget;
        return whether it is held afterwards. An entry alone over the budget is dropped as it goes
        in, before anything else goes (it emptied the store first: a served system prompt too)."""
        tokens = entry.tokens
        if self.budget_bytes is not None and entry.pages is not None and entry.pages.nbytes > self.budget_bytes:
            self._inserts += 1
            self._evictions += 1
            if entry.cache is not None:
                entry.cache.close()
            return False
        for shared, key in self._tree.common_prefixes(tokens):
            old = self._entries[key]
            if len(old.tokens) == shared and entry.min_reuse <= shared:
                self._drop(old)  # a prefix of the new entry, which serves it as well
        if self._tree.insert(tokens, entry.id) is not None:
            raise InvariantError("an entry with the same token ids survived an insert (a bug in PrefixStore)")
        self._entries[entry.id] = entry
        self._dtype = dtype or self._dtype
        self._uncounted.add(entry.id)
        self._inserts += 1
        self._evict()
        return entry.id in self._entries

    # ----------------------------------------------------------------------------- files
    def load(self, path: str | os.PathLike[str], *, model: torch.nn.Module, check_weights: bool = True) -> int:
        """Warm start: insert the prefix saved in ``path`` (:func:`~hf_vkv.save_prefix`), or every
        prefix of a folder :meth:`save` wrote (in the order it lists them, least recently used
        first), with every check :func:`~hf_vkv.load_prefix` does (model, weights, dtype,
        checksums). Returns the tokens the store holds of what it loaded (summed over the entries;
        an entry that its budget cannot hold beside the newer ones is evicted at once, with a
        warning naming ``budget_bytes``). The pages live
        in the store's memory, so requests share them: a folder's ``prefix_store.kv`` is mapped,
        not read (:mod:`hf_vkv.prefix.mapped`: each page is checked against its checksum before
        an entry holding it is first handed out, by a thread the open starts or by that first
        use); prefix files are read by copy.

        All or nothing: every file is read and checked, and checked against the store's entries
        (model, dtype, weights), before any is inserted; a refusal inserts nothing and leaves the
        store as it was. A file saved without a weights fingerprint (``save_prefix`` without
        ``model=``, or :meth:`save` of a store whose weights were never given) is refused with a
        :class:`~hf_vkv.PrefixMismatchError` (``field="weights"``) unless ``check_weights=False``:
        then the caller vouches that it was computed by ``model``, and the store records
        ``model``'s weights fingerprint for it (:attr:`weights_fingerprint`).

        Raises:
            PrefixNotFoundError: nothing at ``path`` (a ``FileNotFoundError``).
            PrefixFileCorruptError: a file is not whole (truncated, a flipped bit), or the folder
                lacks a file its index lists.
            PrefixFormatError: a file is not an hf_vkv prefix (or the folder holds none, or its
                index is not :meth:`save`'s).
            PrefixMismatchError: a file (or the store's entries) belongs to another model,
                other weights or another dtype (``field`` says which).
        """
        self._check_process()
        path = path_argument(path, "PrefixStore.load")
        if path.name in (PAGES_FILE, STORE_INDEX) and path.is_file():
            path = path.parent  # a file of a saved store: its folder says what it holds
        if not path.exists():
            raise PrefixNotFoundError(f"PrefixStore.load: nothing at {path}: pass a folder PrefixStore.save wrote or a "
                                      f"file save_prefix wrote")
        self._check_model(model)
        weights = self.fingerprint(model)
        memory = self.memory(model.device)
        for attempt in itertools.count():
            with read_lock(path) if path.is_dir() else contextlib.nullcontext():  # no save commits meanwhile
                files, index = saved_files(path) if path.is_dir() else ([path], None)
                try:
                    wanted, kept = self._load_saved(path, files, index, model=model, check_weights=check_weights,
                                                    weights=weights, memory=memory)
                    break
                except PrefixFileCorruptError:
                    # a writer that takes no lock (an earlier version's save) replaced the folder's files while they
                    # were read: its new index names them (a folder that stays as it was is damaged)
                    if index is None or attempt >= 2 or saved_files(path)[1] == index:
                        raise
        held = [tokens for tokens in wanted if tokens in kept]
        if len(held) < len(wanted):
            warnings.warn(f"PrefixStore.load({str(path)!r}): {len(wanted) - len(held)} of its {len(wanted)} entries "
                          f"did not fit within the store's budget_bytes ({self.budget_bytes or 0:,}) and were evicted at "
                          f"once; raise budget_bytes to hold them", stacklevel=2)
        return sum(map(len, held))

    def _load_saved(self, path: Path, files: list[Path], index: dict[str, Any] | None, *, model: torch.nn.Module,
                    check_weights: bool, weights: str, memory: VKVCache) -> tuple[list[tuple[int, ...]], set[tuple[int, ...]]]:
        """One try of :meth:`load`: read and check ``files`` and the mapped section of ``index``, then
        insert them all or none; returns the entries wanted and those held afterwards."""
        loaded: list[tuple[VKVCache, list[int]]] = []
        given: list[MappedEntry] = []  # mapped entries, until the store takes them
        mapped = None
        try:
            for file in files:
                loaded.append(_load(file, model=model, cache_config=self.cache_config, check_weights=check_weights,
                                    memory_of=memory, device=model.device, weights=weights))
            section = None if index is None else index.get("mapped")
            if section is not None:
                tokens_of = [t for e in section.get("entries", []) if isinstance(e, dict)
                             for t in (e.get("tokens") or [])] if isinstance(section, dict) else []
                if not set(map(type, tokens_of)) <= {int}:
                    raise PrefixFormatError(f"{path / STORE_INDEX} is not an hf_vkv prefix store index: an entry's "
                                            f"token ids are not integers")
                _check_model(path, {**index, "token_ids": tokens_of}, self.config, model, None,
                             check_weights=check_weights, weights=weights, config_known=self._config_known)
                given, mapped = map_entries(path, section, memory=memory, device=model.device)
            with self._lock:
                for cache, tokens in loaded:  # what insert would refuse, first
                    self._check_cache(cache, len(tokens))
                    self._check_weights(weights)
                for entry in given:
                    self._check_mapped(entry)
                    self._check_weights(weights)
                wanted = [tuple(tokens) for _, tokens in loaded] + [entry.tokens for entry in given]
                for cache, tokens in loaded:
                    self.insert(tokens, cache, weights=weights)
                while given:
                    self._add_mapped(given.pop(0), mapped, weights)
                kept = {entry.tokens for entry in self._entries.values()}
            if mapped is not None:
                with self._lock:
                    # a page file no entry holds a page of is not watched (nor checked, nor kept open): a folder
                    # loaded again whose entries the store already held, files whose entries all went
                    self._files = [m for m in (*self._files, mapped) if self._holds_pages_of(m)]
                if mapped in self._files:
                    mapped.check_in_background()  # its pages are checked by their first use, or then
        finally:
            for cache, _ in loaded:
                cache.close()
            for entry in given:
                entry.release()
        return wanted, kept

    def save(self, directory: str | os.PathLike[str], *, model: torch.nn.Module | None = None) -> list[Path]:
        """Save every entry to ``directory``: the pages of every entry that can be mapped once
        into ``prefix_store.kv`` (:mod:`hf_vkv.prefix.mapped`; a page shared by entries is stored
        once), any other entry (a sliding window, a layer kept by transformers, a GPU store) as a
        prefix file named by a digest of its token ids, and an index (``prefix_store.json``, with
        its own SHA-256) describing them, least recently used first: :meth:`load` of the folder
        gives back exactly these entries (files of earlier saves that the index does not name are
        left alone and not read). The index carries the weights fingerprint of the model that
        computed the entries: the store's (:attr:`weights_fingerprint`, recorded by ``generate``
        and :meth:`load`), or ``model``'s when given. Mapped pages are checked against their
        checksums before they are written again. Returns the data files written (the page file and
        the prefix files; the index that names them is ``prefix_store.json`` beside them).

        Raises:
            PrefixNotAFolderError: ``directory`` (or a folder above it) is a file (a
                ``FileExistsError``); nothing is written.
            PrefixMismatchError: ``model`` is not the store's model (another config, or other
                weights than those that computed the entries).
        """
        self._check_process()
        # one save at a time in the process, whatever the store: two into one folder could pair one's index with
        # the other's pages, and a save's clean-up takes this process's page files it does not name for left-overs
        with _SAVING:
            return self._save_folder(directory, model)

    def _save_folder(self, directory: str | os.PathLike[str], model: torch.nn.Module | None) -> list[Path]:
        out = path_argument(directory, "PrefixStore.save")
        if out.exists() and not out.is_dir():
            raise PrefixNotAFolderError(f"PrefixStore.save writes a folder, and {out} is a file: name a folder (new, "
                                        f"or one PrefixStore.save wrote); save_prefix writes one entry to a file")
        taken = [name for name in (STORE_INDEX, PAGES_FILE) if (out / name).is_dir()]
        if taken:
            raise PrefixIsAFolderError(f"PrefixStore.save writes its {taken[0]} as a file, and {out / taken[0]} is a "
                                       f"folder: remove it, or save to another folder")
        if model is not None:
            self._check_model(model)
        weights = None if model is None else self.fingerprint(model)
        with self._lock:
            self._check_files()  # a page file written since it was opened is never saved again as checked
            if weights is not None:
                self._check_weights(weights, doing="saved with")
            weights = weights or (self._weights if self._entries else None)
            if weights is None and self._entries:
                warnings.warn(
                    f"PrefixStore.save({str(out)!r}): the entries were inserted by hand and no model= was given, so the "
                    f"folder carries no weights fingerprint and PrefixStore.load refuses it unless check_weights=False: "
                    f"save with store.save(folder, model=model) (the model that computed them)", UserWarning, stacklevel=3)
            for entry in list(self._entries.values()):
                self._verify(entry)  # a damaged mapped page is never saved again under a new checksum
            entries = [(e.tokens, self._cache_of(e).fork()) for e in self._entries.values()]
            fits = self._memory_of("cpu")  # the memory load maps the pages into
        paths = []
        mapped: list[tuple[tuple[int, ...], list]] = []
        section = None
        try:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as e:  # a file above it
                raise PrefixNotAFolderError(f"PrefixStore.save cannot make the folder {out}: {e.strerror} "
                                            f"({e.filename}); name a folder whose parents are folders") from None
            # the mapped file holds one arena's pages, the first mappable entry's: an entry in another (a cache
            # inserted by hand draws from its own memory) is saved as a prefix file
            arena = None
            for tokens, cache in entries:
                images = _mappable_images(cache, fits=fits)
                if images is not None and arena is None:
                    arena = images[0].store
                if images is not None and all(img.store is arena for img in images):
                    mapped.append((tokens, images))
                    continue
                digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:20]
                paths.append(_save(out / f"prefix-{digest}.safetensors", cache, list(tokens), model=model,
                                   weights=weights))
            if mapped:
                section = write_pages(out, mapped)
        finally:
            for _, cache in entries:
                cache.close()
        index = {"format": STORE_FORMAT, "version": STORE_VERSION, "writer": f"hf_vkv {__version__}",
                 "files": [p.name for p in paths],
                 **self._config_known,
                 "weights_fingerprint": weights, "dtype": None if self._dtype is None else str(self._dtype).removeprefix("torch."),
                 "mapped": section}
        # The index is the commit: written after the files it names, each under a name of its own, so
        # a save stopped at any point leaves the last save's folder or this one, both whole. Then the
        # page file takes its usual name (an index that names the other finds it there: pages_path).
        # Saves from other processes commit one at a time: one's rename between another's and that one's last
        # index would leave an index naming prefix_store.kv over the other's pages.
        with commit_lock(out):
            try:
                _write_index(out, index)
            except BaseException:
                if section is not None:  # never committed: its page file goes (the last save's stays whole)
                    (out / section["file"]).unlink(missing_ok=True)
                raise
            if section is not None:
                os.replace(out / section["file"], out / PAGES_FILE)
                _write_index(out, {**index, "mapped": {**section, "file": PAGES_FILE}})
                paths.append(out / PAGES_FILE)
            clean_saves(out, keep=PAGES_FILE)
        return paths

    def _check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model of another config than the store's (``PrefixMismatchError``), and what is
        not a model (``ArgumentTypeError``)."""
        if not isinstance(model, torch.nn.Module):
            raise ArgumentTypeError(f"model= takes the model (a torch.nn.Module, e.g. the one from_pretrained returned), "
                                    f"got {type(model).__name__}")
        self._check_config(model.config, "model", "the model is not this store's ({}): use a store per model")

    def _check_config(self, config: Any, name: str, message: str) -> None:
        """Refuse another config than the store's: ``PrefixMismatchError("config", message)`` with
        ``{}`` in ``message`` filled by what differs (``name``: what the config belongs to)."""
        if config_fingerprint(config) != self._fingerprint:
            detail = describe_config_difference(config, self.config, a_name=name, b_name="store")
            raise PrefixMismatchError("config", message.format(detail))

    def _check_weights(self, weights: str, *, doing: str = "inserted with") -> None:
        """Refuse other weights than those that computed the entries (``PrefixMismatchError``)."""
        if self._entries and self._weights not in (None, weights):
            raise PrefixMismatchError("weights", f"the store's entries were computed with other weights than the model "
                                                 f"they are {doing} (same config; {WEIGHTS_DIFFER}): a store serves one "
                                                 f"model's weights; use a store per model, adapter or attention")

    # ----------------------------------------------------------------------------- accounting
    def bytes_held(self) -> int:
        """Physical bytes of every page the entries hold, a page shared by entries counted once."""
        with self._lock:
            self._count()
            return self._counts.bytes

    def _count(self) -> None:
        """Discount the pages of entries taken (:meth:`take`), count those of entries not counted yet."""
        while self._leaving:
            self._counts.remove(self._leaving.pop())
        for key in self._uncounted:
            self._counts.add(_pages_of(self._entries[key]))
        self._uncounted.clear()

    def stats(self) -> PrefixStats:
        """Hits, tokens reused, bytes held, ... (see :class:`PrefixStats`)."""
        with self._lock:
            return PrefixStats(entries=len(self._entries), lookups=self._lookups, hits=self._hits,
                               tokens_reused=self._reused, inserts=self._inserts, evictions=self._evictions,
                               bytes_held=self.bytes_held(), budget_bytes=self.budget_bytes,
                               prompt_tokens=self._prompt_tokens, prompt_tokens_computed=self._computed)

    def count_prefill(self, *, prompt_tokens: int, computed: int) -> None:
        """A ``generate`` prefill brought ``prompt_tokens`` prompt tokens and computed ``computed``
        of them (:mod:`hf_vkv.generate.reuse` calls it; :meth:`stats` sums them)."""
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._computed += computed

    def prefixes(self) -> list[tuple[int, ...]]:
        """The stored token-id sequences, least recently used first."""
        with self._lock:
            return [e.tokens for e in self._entries.values()]

    def clear(self) -> None:
        """Drop every entry (pages go back unless live requests still hold them; a mapped page
        file is let go once none of its pages is held)."""
        with self._lock:
            for entry in list(self._entries.values()):
                self._drop(entry)
            for mapped in self._files:
                close = getattr(mapped.arena, "close_retired_files", None)
                if close is not None:
                    close()
            self._files.clear()

    def _holds_pages_of(self, mapped: MappedPages) -> bool:
        """Whether an entry holds a page of the opened page file ``mapped`` (under the lock). An
        entry not used yet holds pages of its own file only, told by its first id: its pages are
        not listed (a 2k-token SmolLM2 entry's ~24k ids took a millisecond of the open)."""
        return any((bool(entry.pending.held) and mapped.holds_from(entry.pending.arena, entry.pending.base))
                   if entry.pending is not None else mapped.holds(_pages_of(entry)) for entry in self._entries.values())

    close = clear

    def check_invariants(self) -> None:
        """Check the radix tree, that it holds exactly the entries, each entry's shape and cache
        invariants, and the budget (raises :class:`~hf_vkv.InvariantError`)."""
        self._check_process()
        with self._lock:
            self._check_invariants()

    def _check_invariants(self) -> None:
        self._tree.check_invariants()
        listed = {key: tokens for tokens, key in self._tree.items()}
        if listed != {e.id: e.tokens for e in self._entries.values()}:
            raise InvariantError("the prefix tree and the entries disagree")
        for entry in self._entries.values():
            if entry.pending is not None:  # a mapped entry not used yet: its tables and its hold on their pages
                pending = entry.pending
                if entry.cache is not None or any(length != len(entry.tokens) for img in pending.shapes
                                                  for length in img.lengths):
                    raise InvariantError(f"mapped entry {entry.id} does not describe its {len(entry.tokens)} tokens")
                pending.check_invariants()
                continue
            if entry.cache is None or entry.cache.rows != 1 or entry.cache.get_seq_length() != len(entry.tokens):
                raise InvariantError(f"entry {entry.id} holds no batch-1 cache of {len(entry.tokens)} tokens")
            entry.cache.check_invariants()
        counts = PageCounts()
        for entry in self._entries.values():
            counts.add(_pages_of(entry))
        self._count()
        if not self._counts.same_as(counts):
            raise InvariantError(f"the store counts {self._counts.bytes:,} bytes held, its entries hold {counts.bytes:,}")
        if self.budget_bytes is not None and self.bytes_held() > self.budget_bytes:
            raise InvariantError(f"the store holds {self.bytes_held():,} bytes over its {self.budget_bytes:,} budget")

    # ----------------------------------------------------------------------------- internals
    def _check_cache(self, cache: Any, length: int) -> None:
        if not isinstance(cache, VKVCache):
            raise ArgumentTypeError(
                f"insert needs a hf_vkv.VKVCache, got {type(cache).__name__}: generate with "
                f"cache_implementation='vkv' or cache=store.lookup(...) (past_key_values= before transformers 5.24)"
            )
        self._check_config(cache.config, "cache", "the cache belongs to another model than this store's ({})")
        dtype = _dtype_of(cache)
        if self._entries and dtype is not None and self._dtype is not None and dtype != self._dtype:
            raise PrefixMismatchError("dtype", f"the cache holds {dtype} K/V but the store's entries are "
                                      f"{self._dtype}; use one store per dtype")
        n = cache.get_seq_length()
        if not 0 < length <= n:
            raise ArgumentError(
                f"token_ids has {length} ids but the cache holds {n} tokens; pass the ids of the cached "
                f"positions: out.sequences[0, :cache.get_seq_length()]"
            )
        n_rows = cache.rows
        if n_rows != 1:
            raise ArgumentError(f"insert stores batch-1 caches, this one holds {n_rows} rows; keep one row first "
                                f"(cache.batch_select_indices(torch.tensor([row])) on a fork)")
        check_unpadded(cache, "insert")

    def _check_mapped(self, entry: MappedEntry) -> None:
        """What :meth:`_check_cache` refuses, for a mapped entry (its dtype; its length)."""
        dtype = entry.shapes[0].geometry.dtype if entry.shapes else None
        if self._entries and dtype is not None and self._dtype is not None and dtype != self._dtype:
            raise PrefixMismatchError("dtype", f"the file holds {dtype} K/V but the store's entries are "
                                      f"{self._dtype}; use one store per dtype")
        if not entry.tokens or any(n != len(entry.tokens) for img in entry.shapes for n in img.lengths):
            raise PrefixFormatError(f"a mapped entry of {len(entry.tokens)} token ids does not hold that many tokens")

    def _add_mapped(self, mapped: MappedEntry, pages: MappedPages | None, weights: str | None) -> None:
        """Store a mapped entry as it is (no cache until its first use: :meth:`_cache_of`)."""
        if self._served(mapped.tokens):
            mapped.release()
            return
        entry = _Entry(id=next(self._ids), tokens=mapped.tokens, cache=None, min_reuse=0, pages=None,
                       mapped=None if pages is None else (pages, tuple(mapped.held)), pending=mapped)
        if self._add(entry, mapped.shapes[0].geometry.dtype if mapped.shapes else None) and weights is not None:
            self._weights = weights

    def _drop(self, entry: _Entry, *, later: bool = False) -> None:
        """Remove ``entry`` and let its pages go; ``later``: discount them at the next :meth:`_count`."""
        del self._entries[entry.id]
        self._tree.remove(entry.id)
        if entry.id in self._uncounted:
            self._uncounted.discard(entry.id)
        elif later:
            self._leaving.append(_pages_of(entry))
        else:
            self._counts.remove(_pages_of(entry))
        if entry.cache is not None:
            entry.cache.close()
        if entry.pending is not None:
            entry.pending.release()

    def _evict(self) -> None:
        if self.budget_bytes is None:
            return
        self._count()
        while self._counts.bytes > self.budget_bytes and self._entries:
            self._drop(next(iter(self._entries.values())))  # the least recently used
            self._evictions += 1


def _pages_of(entry: _Entry) -> HeldPages:
    """The entry's pages, as :meth:`VKVCache.held_pages` gives them (a mapped entry's are read when
    first needed: opening a file counts nothing)."""
    if entry.pages is None:
        if entry.cache is not None:
            entry.pages = entry.cache.held_pages()
        else:
            assert entry.pending is not None
            arena = entry.pending.arena
            entry.pages = HeldPages.of([(arena, arena.page_bytes, entry.pending.held)])
    return entry.pages


def _dtype_of(cache: VKVCache) -> torch.dtype | None:
    for layer in cache.layers:
        dtype = getattr(layer, "dtype", None)
        if dtype is not None:
            return dtype
    return None


def _mappable_images(cache: VKVCache, *, fits: VKVCache) -> list | None:
    """``cache``'s row images if its pages can be written as a mapped file (host memory, every
    layer a full-attention vkv layer) that a store's memory like ``fits`` maps back (same layout,
    page size: a cache inserted by hand may have others), else None (it is saved as a prefix file
    of its own)."""
    try:
        images = cache.row_images()
        fits.arena_for_images(images)
    except ValueError:
        return None
    ok = all(getattr(img.store, "backend", None) is not None and hasattr(img.store.backend, "map_file") for img in images)
    return images if ok and images else None


def _write_index(folder: Path, index: dict[str, Any]) -> None:
    """Replace ``folder``'s index by ``index`` at once (a temporary file, then renamed)."""
    tmp = folder / f".{STORE_INDEX}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        tmp.write_text(index_text(index))
        os.replace(tmp, folder / STORE_INDEX)
    finally:
        tmp.unlink(missing_ok=True)


def _weak_reclaim(store: PrefixStore) -> Callable[[int, PagePool], bool]:
    """``store._reclaim`` for its memory to call, holding the store weakly: the memory is the
    store's, and a bound method would make a cycle that keeps a dropped store, its pages and its
    mapped files until a pass of the garbage collector reaches them, instead of freeing them at once.
    Called after the store went, it lets nothing go (``False``)."""
    method = weakref.WeakMethod(store._reclaim)

    def reclaim(pages: int, pool: PagePool) -> bool:
        bound = method()
        return False if bound is None else bound(pages, pool)
    return reclaim


def saved_files(folder: Path) -> tuple[list[Path], dict[str, Any] | None]:
    """The prefix files of a folder — those its :data:`STORE_INDEX` lists, in its order, or without
    an index every ``*.safetensors`` file in it, by name — and the index (version 2: with its
    mapped pages' section and the model checks; ``None`` without an index or for version 1).
    A folder (or its index) removed while it is read is :class:`PrefixNotFoundError`."""
    try:
        return _saved_files(folder)
    except FileNotFoundError as e:
        if isinstance(e, PrefixNotFoundError):
            raise
        raise PrefixNotFoundError(f"{folder} was removed while it was read ({e.strerror}: {e.filename}): load it once "
                                  f"it is saved again") from None


def _saved_files(folder: Path) -> tuple[list[Path], dict[str, Any] | None]:
    index = folder / STORE_INDEX
    for name in (STORE_INDEX, PAGES_FILE):
        if (folder / name).is_dir():
            raise PrefixFileCorruptError(f"{folder} is not whole: its {name} is a folder, where PrefixStore.save "
                                         f"writes a file")
    if not index.exists():
        files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
        if not files:
            raise PrefixFormatError(f"{folder} holds no hf_vkv prefix: no {STORE_INDEX} (written by PrefixStore.save) "
                                    f"and no .safetensors file")
        return files, None
    try:
        text = index.read_text()
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PrefixFileCorruptError(f"{index} is not whole: it is not JSON ({e})") from None
    mapped = isinstance(data, dict) and data.get("version") in _MAPPED_VERSIONS
    if mapped:
        check_index_text(index, text)
    names = data.get("files") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != STORE_FORMAT or data.get("version") not in (1, *_MAPPED_VERSIONS)
            or not isinstance(names, list)
            or not all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..") for n in names)):
        raise PrefixFormatError(f"{index} is not an hf_vkv prefix store index of version 1 to {STORE_VERSION} (format "
                                f"{STORE_FORMAT!r}, a list of file names)")
    if mapped and (
            not isinstance(data.get("config_fingerprint"), str) or not isinstance(data.get("config_fields"), dict)
            or not isinstance(data.get("dtype"), (str, type(None)))
            or not isinstance(data.get("weights_fingerprint"), (str, type(None)))):
        raise PrefixFormatError(f"{index} is not an hf_vkv prefix store index: its model fields are malformed")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise PrefixFileCorruptError(f"{folder} is not whole: its {STORE_INDEX} lists {missing[:3]}, which it lacks")
    return [folder / n for n in names], (data if mapped else None)
