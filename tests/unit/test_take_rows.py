"""Executable specs of starting rows from other caches' pages: :meth:`LayerGroup.take_rows`
(through :meth:`VKVCache.take_rows`), :meth:`RowBuffer.adopt`, the store's ``borrow`` and
``insert(give=True)``, and the pool's one-step undo of ``incref``.

Tiny Llama config (2 layers, 2 KV heads of 16 dims, float32), head-major layout with 4 KiB pages:
a sub-row token is 64 bytes, so a page holds 64 tokens of one (layer, K/V, head).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_vkv import PrefixStore, VKVCache
from hf_vkv.cache.cache import RowSource
from hf_vkv.memory import InvariantError, PageId, PagePool

PAGE = 4096
TOKENS_PER_PAGE = 64
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, vocab_size=100)


def _states(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 16, generator=g), torch.randn(1, 2, tokens, 16, generator=g)


def _filled(tokens: int, *, memory: VKVCache | None = None, seed: int = 0) -> VKVCache:
    """A batch-1 cache holding ``tokens`` random tokens in every layer."""
    cache = VKVCache(CONFIG, memory_of=memory, layout="head_major", page_bytes=PAGE)
    for layer in range(2):
        cache.update(*_states(tokens, seed + layer), layer)
    return cache


def _pages(cache: VKVCache, row: int) -> list[tuple[int, ...]]:
    buffer = cache.groups[0].buffer
    return [tuple(int(p) for p in buffer.table.row(t).pages) for t in buffer.table_rows(row)]


def test_an_unpadded_row_shares_the_source_pages_and_a_padded_row_is_copied() -> None:
    root = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    src = _filled(150, memory=root)
    dst = VKVCache(CONFIG, memory_of=root, layout="head_major", page_bytes=PAGE, batch_size=3)
    copied = dst.take_rows([RowSource(src), RowSource(src, offset=5), RowSource(src)], length=130)
    assert copied == 1 and dst.rows == 3 and dst.get_seq_length() == 130
    # row 0: the first ceil(130 / 64) = 3 pages of every sub-row of the source, the same ids
    assert _pages(dst, 0) == [p[:3] for p in _pages(src, 0)]
    assert _pages(dst, 2) == _pages(dst, 0)  # the same source: the same pages
    assert not set(_pages(dst, 1)[0]) & set(_pages(src, 0)[0])  # copied: its own pages
    for layer in range(2):
        want_k, want_v = src.layers[layer].keys, src.layers[layer].values
        got_k, got_v = dst.layers[layer].keys, dst.layers[layer].values
        assert torch.equal(got_k[0], want_k[0, :, :130]) and torch.equal(got_v[2], want_v[0, :, :130])
        assert torch.equal(got_k[1, :, 5:], want_k[0, :, :125]) and torch.equal(got_v[1, :, 5:], want_v[0, :, :125])
        assert not got_k[1, :, :5].any() and not got_v[1, :, :5].any()  # padding: zeros
    dst.check_invariants()
    src.check_invariants()
    # a write into the shared, partly filled last page copies it first: the source is unchanged
    before = src.layers[0].keys.clone()
    dst.update(*(t.expand(3, -1, -1, -1) for t in _states(1, 9)), 0)
    assert torch.equal(src.layers[0].keys, before)
    dst.check_invariants()


def test_rows_taking_all_of_a_source_append_into_its_last_page_one_at_a_time() -> None:
    """A stored prefix's partly written last pages: the first row that takes all of the source
    and writes appends into them in place (no copy, the same page ids), the second copies them,
    and the source's tokens never change."""
    root = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    src = _filled(70, memory=root)  # each sub-row's last page holds 6 of its 64 tokens
    first, second = (VKVCache(CONFIG, memory_of=root, layout="head_major", page_bytes=PAGE) for _ in range(2))
    assert first.take_rows([RowSource(src)], length=70) == 0 and second.take_rows([RowSource(src)], length=70) == 0
    tails = {p[-1] for p in _pages(src, 0)}
    before = [(src.layers[layer].keys.clone(), src.layers[layer].values.clone()) for layer in range(2)]
    new = {name: [_states(3, seed + layer) for layer in range(2)] for name, seed in (("first", 20), ("second", 30))}
    for layer in range(2):
        first.update(*new["first"][layer], layer)
    assert {p[-1] for p in _pages(first, 0)} == tails and first.stats().cow_copies == 0  # in place
    for layer in range(2):
        second.update(*new["second"][layer], layer)
    assert not {p[-1] for p in _pages(second, 0)} & tails and second.stats().cow_copies == len(tails)  # copied
    first.update(*_states(1, 40), 0)  # the next step appends in place again
    assert {p[-1] for p in _pages(first, 0)} == tails and first.stats().cow_copies == 0
    for layer, (keys, values) in enumerate(before):
        assert torch.equal(src.layers[layer].keys, keys) and torch.equal(src.layers[layer].values, values)
        for cache, name in ((first, "first"), (second, "second")):
            k, v = new[name][layer]
            assert torch.equal(cache.layers[layer].keys[:, :, :73], torch.cat([keys, k], dim=2))
            assert torch.equal(cache.layers[layer].values[:, :, :73], torch.cat([values, v], dim=2))
    for cache in (src, first, second):
        cache.check_invariants()


def test_sources_in_another_memory_are_copied() -> None:
    src = _filled(70)  # its own arenas
    dst = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    assert dst.take_rows([RowSource(src, start=10)], length=60) == 1
    assert torch.equal(dst.layers[1].keys[0], src.layers[1].keys[0, :, 10:70])
    dst.check_invariants()


def test_take_rows_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    src = _filled(20)
    dst = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    with pytest.raises(ValueError, match="does not hold"):
        dst.take_rows([RowSource(src)], length=21)
    with pytest.raises(ValueError, match="length >= 1"):
        dst.take_rows([RowSource(src)], length=0)
    with pytest.raises(TypeError, match="VKVCache"):
        dst.take_rows([RowSource(None)], length=3)  # no source, and not all padding
    assert dst.rows == 0 and dst.get_seq_length() == 0
    dst.take_rows([RowSource(src)], length=5)
    with pytest.raises(ValueError, match="empty cache"):
        dst.take_rows([RowSource(src)], length=5)


def test_store_borrow_reads_an_entry_in_place_and_insert_give_keeps_the_cache() -> None:
    store = PrefixStore(CONFIG, cache_config={"layout": "head_major", "page_bytes": PAGE})
    entry = store.new_cache()
    for layer in range(2):
        entry.update(*_states(40, layer), layer)
    assert store.insert(list(range(40)), entry, give=True)
    assert store.stats().entries == 1
    with pytest.raises(ValueError, match="exactly"):
        store.insert(list(range(30)), _filled(40, memory=store.memory()), give=True)
    with store.borrow(list(range(30)) + [99]) as (held, m):
        assert held is entry and m == 30  # the store's own cache, no fork
    with store.borrow([5, 6]) as (held, m):
        assert held is None and m == 0
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.tokens_reused) == (2, 1, 30)
    store.check_invariants()


def test_a_rolled_back_incref_restores_every_count_with_one_undo_step() -> None:
    pool = PagePool(page_bytes=PAGE, budget_pages=8)
    pool.add_segment(8)
    pages, _ = pool.allocate([[], []])
    pool.begin()
    pool.incref([pages[0], pages[1], pages[0]])
    assert (pool.refcount(pages[0]), pool.refcount(pages[1])) == (3, 2)
    with pytest.raises(InvariantError):
        pool.incref([pages[1], PageId(7)])  # 7 is free: a bug; pages[1] was already counted
    pool.rollback()
    assert (pool.refcount(pages[0]), pool.refcount(pages[1])) == (1, 1)
    pool.check_invariants()


# ----------------------------------------------------------------------------- take_over, cut_to, take
def test_take_over_moves_the_row_and_its_reservation_without_touching_a_page() -> None:
    root = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    src = _filled(150, memory=root)
    pages, buffer = _pages(src, 0), src.groups[0].buffer
    keys = [src.layers[layer].keys.clone() for layer in range(2)]
    dst = VKVCache(CONFIG, memory_of=root, layout="head_major", page_bytes=PAGE)
    dst.take_over(src)
    assert dst.groups[0].buffer is buffer and _pages(dst, 0) == pages  # the same reservation, the same pages
    assert dst.get_seq_length() == 150 and src.get_seq_length() == 0 and src.groups[0].buffer is None
    assert all(torch.equal(dst.layers[layer].keys, keys[layer]) for layer in range(2))
    dst.update(*_states(1, 7), 0)  # the row goes on growing where the source stopped
    dst.update(*_states(1, 8), 1)
    assert dst.get_seq_length() == 151
    dst.check_invariants()
    src.check_invariants()
    src.close()  # an emptied source closes without touching the moved pages
    assert _pages(dst, 0)[0][:3] == pages[0][:3]
    assert torch.equal(dst.layers[1].keys[:, :, :150], keys[1])
    dst.check_invariants()


@pytest.mark.parametrize("case", ["two rows", "other memory", "other layout", "not empty", "larger capacity"])
def test_take_over_refuses_what_it_cannot_move_and_changes_nothing(case: str) -> None:
    root = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    src = _filled(40, memory=root)
    dst = VKVCache(CONFIG, memory_of=root, layout="head_major", page_bytes=PAGE)
    if case == "two rows":
        src = VKVCache(CONFIG, memory_of=root, layout="head_major", page_bytes=PAGE, batch_size=2)
        for layer in range(2):
            src.update(*(t.expand(2, -1, -1, -1) for t in _states(40, layer)), layer)
    elif case == "other memory":
        dst = VKVCache(CONFIG, layout="head_major", page_bytes=PAGE)
    elif case == "other layout":
        dst = VKVCache(CONFIG, memory_of=root, layout="token_major", page_bytes=PAGE)
    elif case == "not empty":
        dst = _filled(5, memory=root, seed=3)
    else:
        dst = VKVCache(CONFIG, memory_of=root, layout="head_major", page_bytes=PAGE, max_tokens=1024)
    held, pages = (dst.get_seq_length(), src.get_seq_length()), _pages(src, 0)
    with pytest.raises(ValueError):
        dst.take_over(src)
    assert (dst.get_seq_length(), src.get_seq_length()) == held and _pages(src, 0) == pages
    src.check_invariants()
    dst.check_invariants()


def test_cut_to_evens_out_layers_that_hold_different_counts() -> None:
    """A forward that raised part-way: layer 0 holds 3 more tokens than layer 1; ``cut_to`` keeps
    the first ``n`` of each, ``crop`` would have removed 3 from both."""
    cache = _filled(70)
    cache.update(*_states(3, 5), 0)
    assert [layer.get_seq_length() for layer in cache.layers] == [73, 70]
    before = cache.layers[1].keys.clone()
    cache.cut_to(70)
    assert [layer.get_seq_length() for layer in cache.layers] == [70, 70]
    assert torch.equal(cache.layers[1].keys, before)
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.cut_to(-1)


def test_store_take_cuts_off_a_short_tail_the_prompt_does_not_share() -> None:
    """A prompt that shares all but the entry's last tokens (a chat server's re-encoded answer):
    the entry moves, cut back to the shared tokens, when the tail is at most ``tail_tokens``;
    a longer tail (another conversation's) stays in the store."""
    store = PrefixStore(CONFIG, cache_config={"layout": "head_major", "page_bytes": PAGE})
    entry = store.new_cache(batch_size=1)
    for layer in range(2):
        entry.update(*_states(70, layer), layer)  # 70 tokens: the tail crosses into a second page
    store.insert(list(range(70)), entry, give=True)
    keys = store.lookup(list(range(71))).layers[0].keys[:, :, :67].clone()
    prompt = list(range(67)) + [1, 2, 3]  # shares 67: 3 tokens short of the entry's end
    dst = store.new_cache(batch_size=1)
    assert store.take(prompt, into=dst, tail_tokens=2) == 0 and store.prefixes() == [tuple(range(70))]
    assert store.take(prompt, into=dst, tail_tokens=3) == 67
    assert dst.get_seq_length() == 67 and torch.equal(dst.layers[0].keys, keys)
    assert store.prefixes() == [] and store.stats().bytes_held == 0
    dst.check_invariants()
    # the row goes on from the cut: its next tokens land where the entry's tail was
    more_k, more_v = _states(3, 9)
    dst.update(more_k, more_v, 0)
    assert torch.equal(dst.layers[0].keys[:, :, 67:], more_k) and torch.equal(dst.layers[0].keys[:, :, :67], keys)
    dst.check_invariants()
    pool = dst.groups[0].buffer.store.pool
    dst.close()
    store.check_invariants()
    assert pool.stats().in_use == 0  # the cut tail's pages went back with the rest


def test_store_take_moves_an_entry_the_prompt_continues_and_only_that() -> None:
    store = PrefixStore(CONFIG, cache_config={"layout": "head_major", "page_bytes": PAGE})
    entry = store.new_cache(batch_size=1)
    for layer in range(2):
        entry.update(*_states(50, layer), layer)
    store.insert(list(range(50)), entry, give=True)
    keys = store.lookup(list(range(51))).layers[0].keys.clone()
    # a prompt that stops inside the entry: the entry serves others, nothing moves or counts
    dst = store.new_cache(batch_size=1)
    lookups, hits = store.stats().lookups, store.stats().hits
    assert store.take(list(range(30)), into=dst) == 0 and dst.get_seq_length() == 0
    assert store.stats().lookups == lookups and store.prefixes() == [tuple(range(50))]
    # a prompt that continues it: the entry moves, the store no longer holds it
    assert store.take(list(range(50)) + [7, 8], into=dst) == 50
    assert dst.get_seq_length() == 50 and torch.equal(dst.layers[0].keys, keys)
    assert store.prefixes() == [] and store.stats().bytes_held == 0
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.tokens_reused) == (lookups + 1, hits + 1, 50 + 50)
    store.check_invariants()
    # a cache that cannot hold it (a row already there): nothing moves
    store.insert(list(range(50)), dst)
    other = _filled(5, memory=store.memory("cpu"), seed=4)
    assert store.take(list(range(51)), into=other) == 0 and store.prefixes() == [tuple(range(50))]
    store.check_invariants()
