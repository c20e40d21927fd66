"""Prefix reuse across generate() calls: ``PrefixStore`` and prefix files (the radix tree on its
own: ``tests/unit/test_radix.py``).

The oracle is a full prefill with ``DynamicCache``: a generation that starts from a stored prefix
must give the very same tokens (greedy and seeded sampling) as one that prefills the whole prompt.
Tiny models use 4 KiB pages (8 tokens of a group per page), so sliding-window layers really drop
pages behind their window and the store has to refuse prefixes whose window is gone.
"""

from __future__ import annotations

import json
import warnings
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from models import PAGED_BLOCK_TOKENS, SMALL_PAGE, LayoutRun, assert_same_tokens, prompts, tiny
from safetensors.torch import save_file
from transformers.cache_utils import DynamicCache

import hf_vkv
from hf_vkv.generate import cache_kwarg
from hf_vkv import (
    PrefixFileCorruptError,
    PrefixFileError,
    PrefixFormatError,
    PrefixMismatchError,
    PrefixStore,
    VKVCache,
    load_prefix,
    save_prefix,
)

pytestmark = pytest.mark.integration

SMALL = {"page_bytes": SMALL_PAGE}
PAGED = LayoutRun("paged")
PROMPT = 20  # tokens of the first request
NEW = 12  # tokens generated per request: the windows (8 and 6) are passed


def _ids(length: int, seed: int) -> torch.Tensor:
    return prompts(1, length, seed=seed)["input_ids"]


def _generate(model: Any, ids: torch.Tensor, cache: Any = None, *, sample: bool = False, new: int = NEW,
              seed: int = 0) -> Any:
    """``generate`` on ``ids`` ([1, T]) with ``cache`` (None: a fresh DynamicCache, full prefill)."""
    torch.manual_seed(seed)
    extra = {"do_sample": True, "top_k": 0} if sample else {"do_sample": False}
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): cache}, max_new_tokens=new,
                          return_dict_in_generate=True, **extra)


def _cached(out: Any) -> tuple[torch.Tensor, Any]:
    """The token ids of the positions a generate() output's cache holds, and the cache."""
    cache = out.past_key_values
    return out.sequences[0, : cache.get_seq_length()], cache


def _kv(cache: VKVCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _in_use_bytes(store: PrefixStore, probe: torch.Tensor) -> int:
    """Bytes in use in the page pool of the entry that ``probe`` ([1, T]) hits (the store's
    entries share one arena in the tests that call this). The probe's fork is closed at once: a
    fork dropped without ``close()`` holds its pages until the garbage collector finds it."""
    fork = store.lookup(probe)
    try:
        assert fork.get_seq_length() > 0
        pools = {id(g.buffer.store.pool): g.buffer.store.pool for g in fork.groups if g.buffer is not None}
        assert len(pools) == 1
        return next(iter(pools.values())).stats().in_use_bytes
    finally:
        fork.close()


# ------------------------------------------------------------------------------------ reuse == full prefill
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_reuse_is_token_identical(arch: str, sample: bool) -> None:
    """Prompts sharing 5, 15, 25 or all tokens with a stored entry: same tokens as a full prefill.
    Sliding-window models must refuse short prefixes whose window pages are gone."""
    model = tiny(arch)
    # token-major: 8 tokens a page, so the window really drops pages (head-major holds 64 a page here)
    store = PrefixStore(model.config, cache_config={**SMALL, "layout": "token_major"})
    first = _ids(PROMPT, seed=0)
    miss = store.lookup(first)
    assert isinstance(miss, VKVCache) and miss.get_seq_length() == 0
    out = _generate(model, first, miss, sample=sample)
    tokens, cache = _cached(out)
    assert store.insert(tokens, cache)
    n = len(tokens)
    reused = {}
    shares = (15, n + 1) if sample else (5, 15, 25, n - 1, n, n + 1)
    for shared in shares:
        query = torch.cat([out.sequences[:, :shared], _ids(6, seed=shared)], dim=1)
        fork = store.lookup(query)
        reused[shared] = fork.get_seq_length()
        got = _generate(model, query, fork, sample=sample, seed=shared)
        ref = _generate(model, query, None, sample=sample, seed=shared)
        assert isinstance(ref.past_key_values, DynamicCache)
        assert_same_tokens(ref.sequences, got.sequences)
        fork.check_invariants()
    store.check_invariants()
    for shared, r in reused.items():
        assert r in (0, min(shared, n)), (shared, r)  # all of the shared prefix, or a miss
    assert reused[n + 1] == n  # the whole entry (the query's last cached-position token is new)
    if arch in ("llama", "qwen2"):
        assert all(r == min(s, n) for s, r in reused.items())
    elif not sample:
        assert reused[5] == 0  # the window before token 5 was dropped: refused, not served wrong
        assert reused[n - 1] == n - 1  # cut back inside the pages the window kept
        if arch == "mistral":
            assert reused[25] == 25
    stats = store.stats()
    assert stats.hits == sum(1 for r in reused.values() if r) and stats.tokens_reused == sum(reused.values())


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_reuse_in_the_paged_layout(arch: str) -> None:
    """The store holds paged caches when the model reads the paged layout ("vkv_paged"); reuse is
    token-identical to a full DynamicCache prefill with the model's own sdpa attention."""
    model = tiny(arch)
    first = _ids(PROMPT, seed=0)
    with PAGED.attention(model):
        store = PrefixStore(model.config, cache_config={**SMALL, "block_tokens": PAGED_BLOCK_TOKENS})
        out = _generate(model, first, store.lookup(first))
        assert out.past_key_values.layout == "paged"
        assert store.insert(*_cached(out))
    n = out.past_key_values.get_seq_length()
    for shared in (15, n - 1, n + 1):
        query = torch.cat([out.sequences[:, :shared], _ids(6, seed=shared)], dim=1)
        ref = _generate(model, query, None, seed=shared)
        with PAGED.attention(model):
            fork = store.lookup(query)
            reused = fork.get_seq_length()
            assert fork.layout == "paged" and reused in (0, min(shared, n))  # sliding windows may refuse
            assert reused == min(shared, n) or (arch != "llama" and shared < n + 1)
            got = _generate(model, query, fork, seed=shared)
        assert_same_tokens(ref.sequences, got.sequences)
        fork.check_invariants()
    store.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_stored_prefix_is_never_changed(arch: str) -> None:
    """Copy-on-write: requests that reuse an entry (and the caller's own cache, going on after
    insert) write into their pages, never into the store's."""
    model = tiny(arch)
    store = PrefixStore(model.config, cache_config=SMALL)
    out = _generate(model, _ids(PROMPT, seed=1), store.lookup(_ids(PROMPT, seed=1)))
    tokens, cache = _cached(out)
    store.insert(tokens, cache)
    probe = torch.cat([tokens[None], torch.tensor([[7]])], dim=1)
    before = _kv(store.lookup(probe))
    cut = store.lookup(torch.cat([tokens[None, :-3], _ids(4, seed=5)], dim=1))  # shares a partial page
    assert cut.get_seq_length() == len(tokens) - 3
    _generate(model, torch.cat([tokens[None, :-3], _ids(4, seed=5)], dim=1), cut)
    _generate(model, torch.cat([out.sequences, _ids(3, seed=6)], dim=1), store.lookup(probe))
    _generate(model, torch.cat([out.sequences, _ids(3, seed=7)], dim=1), cache)  # the caller goes on
    after = _kv(store.lookup(probe))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert sum(g.cow_copies for g in cache.stats().groups) + sum(g.cow_copies for g in cut.stats().groups) > 0
    store.check_invariants()


# ------------------------------------------------------------------------------------ conversations
def test_five_turn_chat_reuses_every_earlier_turn() -> None:
    model = tiny("llama")
    store = PrefixStore(model.config, cache_config=SMALL)
    history = torch.empty(1, 0, dtype=torch.long)
    expected_reuse = []
    for turn in range(5):
        ids = torch.cat([history, _ids(7, seed=100 + turn)], dim=1)  # earlier turns + a new user message
        cache = store.lookup(ids)
        assert cache.get_seq_length() == (expected_reuse[-1] if turn else 0)
        out = _generate(model, ids, cache, new=8)
        assert_same_tokens(_generate(model, ids, None, new=8).sequences, out.sequences)
        tokens, cache = _cached(out)
        store.insert(tokens, cache)
        cache.close()
        expected_reuse.append(len(tokens))
        history = out.sequences
        stats = store.stats()
        assert stats.entries == 1  # each turn supersedes the one before
        assert stats.bytes_held == _in_use_bytes(store, torch.cat([tokens, tokens[:1]])[None])
    stats = store.stats()
    assert (stats.lookups, stats.hits, stats.misses) == (10, 4 + 5, 1)  # 5 turns + 5 probes; only turn 1 misses
    assert stats.tokens_reused == 2 * sum(expected_reuse[:4]) + expected_reuse[4]  # turns 2-5, probes 1-5
    store.check_invariants()


def test_eviction_keeps_the_newest_and_frees_the_rest() -> None:
    """Requests sharing a system prompt (one arena); a budget of 1.6 entries keeps the newest ones,
    and the pool holds exactly the pages the store reports once the requests are done."""
    model = tiny("llama")
    system = _ids(24, seed=50)  # 24 tokens x 512 bytes = three whole 4 KiB pages
    store = PrefixStore(model.config, cache_config=SMALL)
    inserted = []
    for i in range(4):
        ids = torch.cat([system, _ids(8, seed=60 + i)], dim=1)
        fork = store.lookup(ids)
        assert fork.get_seq_length() == (0 if i == 0 else 24)
        tokens, cache = _cached(_generate(model, ids, fork, new=8))
        if i == 0:
            one = cache.stats().resident_bytes
            store.budget_bytes = int(one * 1.6)  # applies from now on
        assert store.insert(tokens, cache)
        cache.close()
        inserted.append(tuple(tokens.tolist()))
        stats = store.stats()
        assert stats.bytes_held <= store.budget_bytes
        assert store.prefixes() == inserted[-stats.entries:]  # the newest entries, oldest first
        assert _in_use_bytes(store, torch.cat([system, system], dim=1)) == stats.bytes_held
        store.check_invariants()
    stats = store.stats()
    assert stats.evictions >= 2 and stats.entries == 4 - stats.evictions
    # an evicted request is a prefix hit on the system prompt only (its own pages are gone)
    assert store.lookup(torch.tensor([inserted[0]])).get_seq_length() == 24
    # an entry over the whole budget is not kept
    tiny_store = PrefixStore(model.config, budget_bytes=SMALL_PAGE, cache_config=SMALL)
    tokens, cache = _cached(_generate(model, system, tiny_store.lookup(system), new=4))
    with pytest.warns(UserWarning, match="needs more than the store's budget of 4,096 bytes.*raise budget_bytes"):
        assert not tiny_store.insert(tokens, cache)  # said: a store that reuses nothing, silently, looks broken
    assert tiny_store.stats().entries == 0 and tiny_store.stats().bytes_held == 0
    assert cache.get_seq_length() == len(tokens)  # the caller's cache is untouched
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per store
        out = model.generate(system, attention_mask=torch.ones_like(system), max_new_tokens=2,
                             cache_implementation="vkv", cache_config={"prefix_store": tiny_store})
    assert out.shape[1] == system.shape[1] + 2 and tiny_store.stats().evictions == 2


def test_bad_input_is_rejected_and_the_store_stays_usable() -> None:
    model = tiny("llama")
    store = PrefixStore(model.config, cache_config=SMALL)
    out = _generate(model, _ids(10, seed=3), store.lookup(_ids(10, seed=3)), new=4)
    tokens, cache = _cached(out)
    with pytest.raises(TypeError, match="VKVCache"):
        store.insert(tokens, DynamicCache())
    with pytest.raises(ValueError, match="token_ids has"):
        store.insert(out.sequences[0], cache)  # one id more than the cache holds
    with pytest.raises(TypeError, match="integer token ids"):
        store.insert(tokens.float(), cache)
    two = model.generate(**prompts(2, 6), cache_implementation="vkv", max_new_tokens=2, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="batch-1"):
        store.insert(two.sequences[0, :7], two.past_key_values)
    with pytest.raises(TypeError, match="one sequence"):
        store.lookup(prompts(2, 6)["input_ids"])
    qwen = PrefixStore(tiny("qwen2").config).lookup(_ids(4, seed=1))
    _generate(tiny("qwen2"), _ids(10, seed=3), qwen, new=2)
    with pytest.raises(PrefixMismatchError, match="another model") as err:
        store.insert(_ids(5, seed=3)[0], qwen)
    assert err.value.field == "config"
    for bad in (model.config.vocab_size, -1):  # once held, then saved, and the saved folder refused as a whole on load
        ids = tokens.clone()
        ids[2] = bad
        with pytest.raises(PrefixMismatchError, match=f"token id {bad} at position 2 is outside") as err:
            store.insert(ids, cache)
        assert err.value.field == "token_ids"
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixStore(model.config, budget_bytes=0)
    with pytest.raises(ValueError, match="cache_config"):
        PrefixStore(model.config, cache_config={"page_size": 1})
    assert store.stats().entries == 0
    assert store.insert(tokens, cache) and store.lookup(out.sequences).get_seq_length() == len(tokens)
    store.check_invariants()


# ------------------------------------------------------------------------------------ prefix files
_CHILD = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from models import tiny, SMALL_PAGE
    import hf_vkv
    from hf_vkv.generate import cache_kwarg
    model = tiny("gemma3")
    query = torch.tensor([{query}])
    out = {{}}
    for mode, extra in (("greedy", {{"do_sample": False}}), ("sampled", {{"do_sample": True, "top_k": 0}})):
        cache, tokens = hf_vkv.load_prefix({path!r}, model=model, cache_config={{"page_bytes": SMALL_PAGE}})
        assert tokens == query[0, :len(tokens)].tolist()
        torch.manual_seed(0)
        seq = model.generate(query, attention_mask=torch.ones_like(query), **{{cache_kwarg(): cache}},
                             max_new_tokens={new}, **extra)
        out[mode] = seq[0].tolist()
    print(json.dumps(out))
""")


def test_save_then_load_in_a_new_process_generates_the_same(tmp_path: Path) -> None:
    """gemma3: a full-attention layer and sliding layers past their window (saved as windows)."""
    model = tiny("gemma3")
    out = _generate(model, _ids(PROMPT, seed=8), VKVCache(model.config, **SMALL))
    tokens, cache = _cached(out)
    path = save_prefix(tmp_path / "prefix.safetensors", cache, tokens, model=model)
    query = torch.cat([out.sequences, _ids(5, seed=9)], dim=1)
    child = _CHILD.format(tests=str(Path(__file__).parents[1]), query=query[0].tolist(), path=str(path), new=NEW)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for mode, sample in (("greedy", False), ("sampled", True)):
        ref = _generate(model, query, None, sample=sample, seed=0)
        assert_same_tokens(ref.sequences, torch.tensor([got[mode]]))


def test_loaded_sliding_prefix_serves_only_what_it_has(tmp_path: Path) -> None:
    """A loaded mistral prefix kept only its window: the store serves it whole, never cut back
    (its earlier positions are placeholders), and a reused load gives the same tokens."""
    model = tiny("mistral")
    tokens, cache = _cached(_generate(model, _ids(PROMPT, seed=11), VKVCache(model.config, **SMALL)))
    path = save_prefix(tmp_path / "m.safetensors", cache, tokens.tolist(), model=model)
    loaded, ids = load_prefix(path, model=model, cache_config=SMALL)
    assert ids == tokens.tolist() and loaded.get_seq_length() == len(ids)
    store = PrefixStore(model.config, cache_config=SMALL)
    assert store.insert(ids, loaded)
    assert store.lookup(ids[:-2] + [5, 6]).get_seq_length() == 0  # would need dropped positions: a miss
    query = torch.tensor([ids + [9, 10, 11]])
    fork = store.lookup(query)
    assert fork.get_seq_length() == len(ids)
    assert_same_tokens(_generate(model, query, None).sequences, _generate(model, query, fork).sequences)


def test_prefix_files_are_checked_on_load(tmp_path: Path) -> None:
    model = tiny("llama")
    tokens, cache = _cached(_generate(model, _ids(12, seed=4), VKVCache(model.config, **SMALL), new=4))
    path = save_prefix(tmp_path / "p.safetensors", cache, tokens, model=model)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(PrefixFileCorruptError, match="truncated"):
        load_prefix(tmp_path / "cut.safetensors", model=model)
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    with pytest.raises(PrefixFileCorruptError):
        load_prefix(tmp_path / "head.safetensors", model=model)
    with pytest.raises(PrefixMismatchError, match="another model.*num_hidden_layers") as err:
        load_prefix(path, model=tiny("llama", layers=3))
    assert err.value.field == "config"
    with pytest.raises(PrefixMismatchError, match="holds float32 K/V but the model runs in bfloat16") as err:
        load_prefix(path, config=model.config, dtype=torch.bfloat16)
    assert err.value.field == "dtype"
    with pytest.raises(PrefixMismatchError, match="other weights") as err:
        load_prefix(path, model=tiny("llama", seed=1))
    assert err.value.field == "weights"
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(PrefixFormatError, match="not an hf_vkv prefix"):
        load_prefix(tmp_path / "plain.safetensors", model=model)
    with pytest.raises(FileNotFoundError):
        load_prefix(tmp_path / "missing.safetensors", model=model)
    with pytest.raises(TypeError, match="exactly one"):
        load_prefix(path)
    with pytest.raises(ValueError, match="token_ids has"):
        save_prefix(tmp_path / "x.safetensors", cache, tokens[:-1])
    assert issubclass(PrefixFileCorruptError, PrefixFileError) and issubclass(PrefixFormatError, PrefixFileError)
    loaded, ids = load_prefix(path, config=model.config)  # config only: weights are not checked
    assert all(torch.equal(a, b) for a, b in zip(_kv(loaded), _kv(cache))) and ids == tokens.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_load_onto_cuda(tmp_path: Path) -> None:
    model = tiny("llama")
    tokens, cache = _cached(_generate(model, _ids(12, seed=4), VKVCache(model.config), new=2))
    path = save_prefix(tmp_path / "p.safetensors", cache, tokens)
    loaded, _ = load_prefix(path, config=model.config, device="cuda")  # the CUDA backend (hf_vkv[cuda])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(_kv(loaded), _kv(cache)))


# ------------------------------------------------------------------------------------ the real model
def _smollm2() -> Any:
    from hf_vkv.default_model import find_smollm2_gguf, is_converted, load_default_model

    try:
        if not is_converted():
            find_smollm2_gguf()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(f"SmolLM2 is not installed: {e}")
    return load_default_model()


def test_smollm2_two_turn_chat_matches_a_full_prefill() -> None:
    model, tok = _smollm2()
    store = PrefixStore(model.config)
    chat = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a prime number."}]
    previous_prompt = 0
    for turn, sample in enumerate((False, True)):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        fork = store.lookup(ids)
        reused = fork.get_seq_length()
        assert reused == 0 if turn == 0 else reused >= previous_prompt  # at least the whole earlier prompt
        previous_prompt = ids.shape[1]
        out = _generate(model, ids, fork, sample=sample, new=10, seed=turn)
        ref = _generate(model, ids, None, sample=sample, new=10, seed=turn)
        assert_same_tokens(ref.sequences, out.sequences)
        tokens, cache = _cached(out)
        store.insert(tokens, cache)
        answer = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one?"}]
    assert store.stats().hits == 1


def test_smollm2_prefix_files_and_store_folders(tmp_path: Path) -> None:
    """What a new user hit on the embedded SmolLM2: ``store.save(folder,
    model=model)`` and ``save_prefix(..., model=model)`` work (its 28M-value embedding once broke
    the weights fingerprint), a file saved with ``model=`` loads with ``model=``, a folder loads
    with ``store.load(folder)``, a file saved without ``model=`` is refused naming
    ``check_weights=False`` and loads with it, and a copy with other k/v weights is refused."""
    import copy

    model, tok = _smollm2()
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    store = PrefixStore(model.config)
    first = _generate(model, ids, store.lookup(ids), new=4)
    tokens, cache = _cached(first)
    store.insert(tokens, cache, weights=store.fingerprint(model))
    paths = store.save(tmp_path / "prefixes", model=model)
    file = save_prefix(tmp_path / "p.safetensors", cache, tokens, model=model)
    assert len(paths) == 1
    loaded, got = load_prefix(file, model=model)
    assert got == tokens.tolist() and all(torch.equal(a, b) for a, b in zip(_kv(loaded), _kv(cache)))
    loaded.close()
    warm = PrefixStore(model.config)
    assert warm.load(tmp_path / "prefixes", model=model) == len(tokens)
    assert warm.weights_fingerprint == store.fingerprint(model)
    query = torch.cat([first.sequences, tok(" and that of Italy is", return_tensors="pt")["input_ids"]], dim=1)
    fork = warm.lookup(query)
    assert fork.get_seq_length() == len(tokens)
    assert_same_tokens(_generate(model, query, None, new=4).sequences, _generate(model, query, fork, new=4).sequences)
    warm.check_invariants()
    # a file saved without model=: refused, naming the way on; accepted with check_weights=False
    bare = save_prefix(tmp_path / "bare.safetensors", cache, tokens)
    cold = PrefixStore(model.config)
    with pytest.raises(PrefixMismatchError, match="check_weights=False") as err:
        cold.load(bare, model=model)
    assert err.value.field == "weights" and len(cold) == 0
    with pytest.raises(PrefixMismatchError, match="check_weights=False"):
        load_prefix(bare, model=model)
    assert cold.load(bare, model=model, check_weights=False) == len(tokens)
    assert cold.weights_fingerprint == store.fingerprint(model)  # the caller vouched for this model
    cold.check_invariants()
    # the same config with other k/v weights: every file and the folder are refused
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    for source in (tmp_path / "prefixes", paths[0], file):
        fresh = PrefixStore(other.config)
        with pytest.raises(PrefixMismatchError, match="other weights") as err:
            fresh.load(source, model=other)
        assert err.value.field == "weights" and len(fresh) == 0
        fresh.check_invariants()
    with pytest.raises(PrefixMismatchError, match="other weights") as err:
        warm.save(tmp_path / "mislabelled", model=other)  # its entries are SmolLM2's, not the copy's
    assert err.value.field == "weights" and not (tmp_path / "mislabelled").exists()
    assert len(warm) == 1


def test_error_types_match_the_api_table(tmp_path: Path) -> None:
    """docs/api.md: ``PrefixFileCorruptError`` is a prefix file that is not whole (a flipped bit in
    its tensor data, a truncation), ``PrefixFormatError`` a file that is not an hf_vkv prefix (a
    text file): so say ``load_prefix`` and ``PrefixStore.load``, and the store stays usable."""
    table = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    assert re.search(r"^\| `PrefixFileCorruptError` \|[^\n]*not whole", table, re.M)
    assert re.search(r"^\| `PrefixFormatError` \|[^\n]*not an hf_vkv prefix", table, re.M)
    model = tiny("llama")
    tokens, cache = _cached(_generate(model, _ids(12, seed=4), VKVCache(model.config, **SMALL), new=4))
    path = save_prefix(tmp_path / "p.safetensors", cache, tokens, model=model)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    flipped = bytearray(data)
    flipped[8 + n + 5] ^= 0x10  # a bit of the first tensor's data
    (tmp_path / "flip.safetensors").write_bytes(bytes(flipped))
    (tmp_path / "cut.safetensors").write_bytes(data[:-7])
    (tmp_path / "notes.txt").write_text("You are a helpful assistant. Answer briefly.\n")
    store = PrefixStore(model.config, cache_config=SMALL)
    for name, error, words in (("flip.safetensors", PrefixFileCorruptError, "not whole.*checksum"),
                               ("cut.safetensors", PrefixFileCorruptError, "not whole.*truncated"),
                               ("notes.txt", PrefixFormatError, "not an hf_vkv prefix")):
        with pytest.raises(error, match=words):
            load_prefix(tmp_path / name, model=model)
        with pytest.raises(error, match=words):
            store.load(tmp_path / name, model=model)
        assert len(store) == 0
        store.check_invariants()
    with pytest.raises(IsADirectoryError, match="PrefixStore.load"):
        load_prefix(tmp_path, model=model)
    assert store.load(path, model=model) == len(tokens)
    store.check_invariants()


def test_entries_that_fill_the_memory_budget_make_room_for_a_call() -> None:
    """A store without an entry budget (the default) whose entries filled its memory's budget
    made every later call fail with ``KVCacheOutOfMemory`` (whose advice, a larger budget in the
    call's cache_config, is refused beside a store): the least recently used entries go, as the
    call's step needs their pages, and the call gives DynamicCache's tokens."""
    model = tiny("llama")
    store = PrefixStore(model.config, cache_config={"budget_bytes": 3 * 131072})  # 3 entries of 8 x 16 KiB pages
    for i in range(1, 6):
        ids = prompts(1, 40, seed=i)["input_ids"]
        mask = torch.ones_like(ids)
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, cache_implementation="vkv",
                             cache_config={"prefix_store": store})
        assert_same_tokens(ref, got)
        stats = store.stats()
        assert stats.entries == min(i, 3) and stats.evictions == max(0, i - 3), stats
        assert stats.bytes_held == stats.entries * 131072
        store.check_invariants()
    assert store.prefixes()[0][:40] == tuple(prompts(1, 40, seed=3)["input_ids"][0].tolist())  # the oldest kept
    # a memory too small for one call, entries or none: the advice names the store's budget, and following it works
    from hf_vkv import KVCacheOutOfMemory

    small = PrefixStore(model.config, cache_config={"budget_bytes": 65536})
    ids = prompts(1, 40, seed=1)["input_ids"]
    call = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, cache_implementation="vkv")
    with pytest.raises(KVCacheOutOfMemory, match=r"raise the prefix store's memory budget, PrefixStore") as full:
        model.generate(input_ids=ids, cache_config={"prefix_store": small}, **call)
    small.check_invariants()
    fits = PrefixStore(model.config, cache_config={"budget_bytes": full.value.fits_bytes})
    model.generate(input_ids=ids, cache_config={"prefix_store": fits}, **call)


def test_arguments_of_the_wrong_type_are_typed_refusals_and_saves_do_not_cross(tmp_path: Path) -> None:
    """Wrong types reached raw ``TypeError``/``ValueError``/``AttributeError`` from inside (a
    weights fingerprint that was an int was kept, and the folder saved with it could not be
    loaded); two threads saving one store into one folder wrote one temporary file name and one
    failed with ``FileNotFoundError``."""
    import threading

    from hf_vkv import ArgumentTypeError, CacheOptionTypeError

    model = tiny("llama")
    store = PrefixStore(model.config)
    ids = _ids(20, seed=90)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, cache_implementation="vkv",
                   cache_config={"prefix_store": store})
    tokens, cache = _cached(_generate(model, _ids(12, seed=91), store.lookup(_ids(12, seed=91)), new=2))
    for call in (lambda: store.insert(tokens, cache, weights=12345), lambda: VKVCache(model.config, batch_size="2"),
                 lambda: VKVCache(model.config, prompt_repeats=1.5), lambda: store.load(tmp_path, model=None),
                 lambda: store.save(tmp_path / "x", model=model.config),
                 lambda: store.take(ids, into=DynamicCache())):
        with pytest.raises(ArgumentTypeError):
            call()
    with pytest.raises(CacheOptionTypeError):
        PrefixStore(model.config, cache_config=["token_major"])
    store.check_invariants()
    failures: list[BaseException] = []

    def saver() -> None:
        try:
            for _ in range(10):
                store.save(tmp_path / "both")
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=saver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert PrefixStore(model.config).load(tmp_path / "both", model=model) > 0


def test_a_model_whose_generation_config_holds_a_store_saves_without_it(tmp_path: Path) -> None:
    """``save_pretrained`` of a model whose generation config keeps a store (set once, as the
    server keeps it) raised ``TypeError`` from transformers' JSON writer and left a folder without
    weights. It is written without the store, saying so; the model keeps its store, and the
    folder loads and generates with vkv."""
    import copy

    from transformers import AutoModelForCausalLM

    model = copy.deepcopy(tiny("llama"))  # tiny's models are shared: this one's generation config is changed
    store = hf_vkv.PrefixStore(model.config)
    model.generation_config.cache_implementation = "vkv"
    model.generation_config.cache_config = {"prefix_store": store, "prefill_once": False}
    inputs = prompts(1, 12)
    first = model.generate(**inputs, max_new_tokens=4)
    with pytest.warns(UserWarning, match=r"PrefixStore.*store.save"):
        model.save_pretrained(tmp_path / "saved")
    assert model.generation_config.cache_config["prefix_store"] is store
    written = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert written["cache_implementation"] == "vkv" and written["cache_config"] == {"prefill_once": False}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    out = loaded.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True)
    assert isinstance(out[cache_kwarg()], hf_vkv.VKVCache)
    assert torch.equal(out.sequences, first)


def test_a_generation_config_holding_a_store_is_compared_and_shown_by_it_without_a_warning() -> None:
    """``repr``, ``==`` and ``hash`` of a generation config (transformers builds them from its JSON
    string) warned "it is written without it" with nothing written, and took two configs holding
    other stores for equal. They now name the store by its identity, silently; writing the JSON
    still leaves it out, with the warning."""
    from transformers import GenerationConfig

    config = tiny("llama").config
    a, b = (GenerationConfig(cache_implementation="vkv", cache_config={"prefix_store": hf_vkv.PrefixStore(config)})
            for _ in range(2))
    same = GenerationConfig(cache_implementation="vkv", cache_config=dict(a.cache_config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning from any of these
        assert "PrefixStore at" in repr(a) and a != b and hash(a) != hash(b)
        assert a == same and hash(a) == hash(same)
    with pytest.warns(UserWarning, match=r"PrefixStore.*written without it"):
        assert "prefix_store" not in json.loads(a.to_json_string())["cache_config"]


def test_a_cache_whose_rows_hold_masked_columns_is_no_prefix_by_hand(tmp_path: Path) -> None:
    """A batch-1 cache generated from a left-padded prompt holds the padding's columns and positions
    counted from the first real token: saved with ``save_prefix`` (or inserted by hand) as a prefix
    of its ids, pad ids included, it was loaded and reused, and SmolLM2 gave other tokens (logits
    22.8 apart). Refused now with a typed error naming the ways that work; the cache stays usable,
    ``reset`` clears the mark, and generate's own store still keeps a padded batch's rows, each
    without its padding."""
    model = tiny("llama")
    inputs = prompts(1, 12, left_pad=[3])
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, cache_implementation="vkv",
                         return_dict_in_generate=True)
    cache = out[cache_kwarg()]
    ids = out.sequences[0, :cache.get_seq_length()]
    assert cache.padded
    with pytest.raises(hf_vkv.ArgumentError, match="hold columns an attention mask hid"):
        hf_vkv.save_prefix(tmp_path / "p.safetensors", cache, ids, model=model)
    store = hf_vkv.PrefixStore(model.config)
    with pytest.raises(hf_vkv.ArgumentError, match="insert: the cache's rows hold columns"):
        store.insert(ids, cache)
    assert not (tmp_path / "p.safetensors").exists() and len(store) == 0
    cache.check_invariants()
    more = torch.cat([out.sequences, torch.tensor([[5, 6]])], 1)
    mask = torch.cat([inputs["attention_mask"], torch.ones(1, more.shape[1] - inputs["attention_mask"].shape[1],
                                                           dtype=torch.long)], 1)
    ref = model.generate(more, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(model.generate(more, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                      **{cache_kwarg(): cache}), ref)
    cache.reset()
    assert not cache.padded
    batch = prompts(2, 12, left_pad=[0, 3])
    model.generate(**batch, max_new_tokens=3, do_sample=False, cache_implementation="vkv",
                   cache_config={"prefix_store": store})
    assert len(store) == 2
    store.check_invariants()
    # rows taken from the store beside a padded row: the call's cache still says so (take_rows kept the mark)
    stored = batch["input_ids"][0].tolist() + [7, 8, 9, 10]
    mixed = {"input_ids": torch.tensor([stored, [0] * 10 + [5, 6, 7, 8, 9, 10]]),
             "attention_mask": torch.tensor([[1] * 16, [0] * 10 + [1] * 6])}
    out = model.generate(**mixed, max_new_tokens=2, do_sample=False, cache_implementation="vkv",
                         cache_config={"prefix_store": store}, return_dict_in_generate=True)
    assert hf_vkv.reuse_report(out).reused_tokens > 0 and out[cache_kwarg()].padded
    # every decoding mode marks it: prompt lookup runs assisted decoding, whose loop has no prefill hook
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, cache_implementation="vkv",
                         prompt_lookup_num_tokens=2, return_dict_in_generate=True)
    assert out[cache_kwarg()].padded
