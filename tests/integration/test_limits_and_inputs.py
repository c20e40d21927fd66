"""Bounds and bad input: page sizes in a documented range, a CPU budget by default, a
budget smaller than a page refused when the cache is built, and typed errors naming the argument
for a string ``cache_config``, float beam indices, wrong-shaped states and a cache reused with
another model. Copy-on-write of a partly written page copies the written part only."""

from __future__ import annotations

import copy

import pytest
import torch
from models import prompts, tiny

import hf_vkv  # noqa: F401
from hf_vkv import LayerMismatchError, VKVCache
from hf_vkv.devices import arena_for_device, policy_for
from hf_vkv.memory import Arena, HostBackend, VirtualBuffer
from hf_vkv.devices import HOST_BUDGET_FRACTION
from hf_vkv.memory.limits import MAX_HOST_PAGE_BYTES, PageSizeError, mem_available
from hf_vkv.generate import cache_kwarg


def test_a_huge_page_is_refused_when_the_cache_is_built_naming_the_option():
    model = tiny("llama")
    with pytest.raises(PageSizeError, match=r"cache_config\['page_bytes'\]=1,099,511,627,776 is outside.*4,096"):
        model.generate(**prompts(2, 12), num_beams=2, max_new_tokens=2, cache_implementation="vkv",
                       cache_config={"page_bytes": 1 << 40})
    with pytest.raises(PageSizeError, match="page_bytes"):
        VKVCache(model.config, page_bytes=1 << 40)  # at build: no update needed


def test_the_host_refuses_pages_above_its_range():
    with pytest.raises(PageSizeError, match=r"host.*2,097,152"):
        HostBackend(page_bytes=2 * MAX_HOST_PAGE_BYTES)
    HostBackend(page_bytes=MAX_HOST_PAGE_BYTES).close()  # the top of the range is fine


def test_the_cpu_has_a_default_budget_of_half_the_available_memory():
    assert policy_for("cpu").budget == "mem-available"
    arena = arena_for_device(torch.device("cpu"), page_bytes=None, budget_bytes=None)
    budget = arena.pool.budget_pages * arena.page_bytes
    expected = HOST_BUDGET_FRACTION * mem_available()
    assert abs(budget - expected) <= 0.1 * expected + arena.page_bytes  # MemAvailable moves a little
    given = arena_for_device(torch.device("cpu"), page_bytes=None, budget_bytes=1 << 20)
    assert given.pool.budget_pages * given.page_bytes == 1 << 20


def test_a_budget_smaller_than_a_page_is_refused_at_build():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"budget_bytes'\]=100 is smaller than one page"):
        VKVCache(model.config, budget_bytes=100)
    with pytest.raises(ValueError, match=r"budget_bytes'\]=8,192 is smaller than one page \(65,536"):
        VKVCache(model.config, budget_bytes=8192, page_bytes=65536)


def test_a_string_cache_config_is_a_type_error_naming_it():
    model = tiny("llama")
    with pytest.raises(TypeError, match=r"cache_config must be a dict such as \{'page_bytes': 4096\}, got str"):
        model.generate(**prompts(1, 8), max_new_tokens=2, cache_implementation="vkv",
                       cache_config="page_bytes=4096")


def test_reorder_cache_refuses_float_indices():
    model = tiny("llama")
    cache = VKVCache(model.config)
    with torch.no_grad():
        model(**prompts(2, 6), **{cache_kwarg(): cache}, use_cache=True)
    before = [tuple(t.clone() for t in layer) for layer in ((lay.keys, lay.values) for lay in cache.layers)]
    for bad in (torch.tensor([1.0, 0.0]), torch.tensor([True, False]), torch.tensor([[1, 0]])):
        with pytest.raises(TypeError, match="integer tensor"):
            cache.reorder_cache(bad)
    for (k, v), layer in zip(before, cache.layers):  # nothing moved
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    cache.reorder_cache(torch.tensor([1, 0], dtype=torch.int32))  # what generate passes


def test_wrong_shaped_states_and_another_models_cache_are_layer_mismatches():
    model = tiny("llama")
    cache = VKVCache(model.config)
    with torch.no_grad():
        model(**prompts(2, 6), **{cache_kwarg(): cache}, use_cache=True)
    k = cache.layers[0].keys
    with pytest.raises(LayerMismatchError, match="layer 0"):
        cache.update(torch.zeros(2, k.shape[1] + 1, 1, k.shape[3]), torch.zeros(2, k.shape[1] + 1, 1, k.shape[3]), 0)
    with pytest.raises(LayerMismatchError):
        cache.update(torch.zeros(2, k.shape[1], 1, k.shape[3], dtype=torch.float64),
                     torch.zeros(2, k.shape[1], 1, k.shape[3], dtype=torch.float64), 0)
    other = tiny("llama", kv_heads=4)  # 4 key/value heads instead of 2
    with pytest.raises(LayerMismatchError, match="create a new one for another model"):
        with torch.no_grad():
            other(**prompts(2, 1), **{cache_kwarg(): cache}, use_cache=True)
    cache.check_invariants()


def test_copy_on_write_copies_the_written_part_of_a_page():
    backend = HostBackend(page_bytes=65536, name="hf_vkv-test-cow")
    copied: list = []
    real = backend.copy
    backend.copy = lambda pairs, nbytes=None: (copied.append((list(pairs), nbytes)), real(pairs, nbytes))[1]
    buf = VirtualBuffer(Arena(backend), rows=2, capacity=1000, item_bytes=100)
    buf.prepare_write([0], 0, 10)
    buf.view(range(0, 1), 0, 10)[0] = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    buf.share(0, [1])
    buf.prepare_write([1], 10, 11)  # row 1 writes after 1000 bytes of a shared 64 KiB page
    assert [n for _, n in copied] == [[1000]]
    assert torch.equal(buf.view(range(1, 2), 0, 10), buf.view(range(0, 1), 0, 10))
    assert buf.table.row(0).pages != buf.table.row(1).pages
    buf.check_invariants()
    buf.close()


def test_an_unbounded_max_new_tokens_reserves_what_the_budget_can_hold():
    """``max_new_tokens=10**12`` with ``max_time`` generates until the time is up, as with
    DynamicCache (the reservation was 10**12 tokens: a raw mmap error), and a small budget ends
    in the typed out-of-memory error, with the cache consistent."""
    model = tiny("llama")
    inputs = prompts(1, 4)
    out = model.generate(**inputs, max_new_tokens=10**12, max_time=0.5, cache_implementation="vkv",
                         do_sample=False, return_dict_in_generate=True)
    new = out.sequences.shape[1] - 4
    assert new > 1
    ref = model.generate(**inputs, max_new_tokens=new, do_sample=False)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K/V x kv heads x head dim x fp32
    assert new < cache.groups[0].capacity <= mem_available() // per_token + 1  # a range this machine can reserve
    budget = 16 * 4096  # 16 pages: 2 per (layer, K/V, head) sub-row of 64 tokens
    with pytest.raises(hf_vkv.KVCacheOutOfMemory):
        model.generate(**inputs, max_new_tokens=10**12, cache_implementation="vkv", do_sample=False,
                       cache_config={"budget_bytes": budget, "layout": "head_major", "page_bytes": 4096})
    small = VKVCache(model.config, budget_bytes=budget, layout="head_major", page_bytes=4096)
    with torch.no_grad():
        model(**inputs, **{cache_kwarg(): small})
    assert small.groups[0].capacity == budget // per_token + 1


def test_an_unbounded_max_new_tokens_continuing_a_stored_prefix_reserves_within_the_budget():
    """A call that continues a prefix store's entry with ``max_new_tokens=10**9`` builds its rows
    from the entry (``take_rows``), where the reservation was 10**9 tokens a row, not bounded by the
    budget as a first update's is: ~90 TB of address space for SmolLM2, kept by the store's entry
    for that row, after which the store's page counts (dense over the page ids) took tens of GB
    and further calls could not reserve at all. Each reservation is now within the arena's budget,
    and many such calls run one after another with the store consistent."""
    from hf_vkv import PrefixStore

    model = tiny("llama")
    store = PrefixStore(model.config)
    ids = prompts(1, 20)["input_ids"]
    first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    eos = int(first[0, 22])  # ends the huge calls at their third token, as a chat's answer ends
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K/V x kv heads x head dim x fp32
    for turn in range(3):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10**9, do_sample=False,
                             eos_token_id=eos, return_dict_in_generate=True, cache_implementation="vkv",
                             cache_config={"prefix_store": store})
        assert torch.equal(out.sequences, first[:, :ids.shape[1] + 3])
        group = out.past_key_values.groups[0]
        assert group.capacity <= group.buffer.store.budget_bytes // per_token + 1
        store.check_invariants()
        ids = torch.cat([out.sequences, prompts(1, 3, seed=turn)["input_ids"]], dim=1)
        first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        eos = int(first[0, ids.shape[1] + 2])


def test_a_cache_passed_to_generate_without_room_is_refused_before_any_step():
    """A conversation continued with the cache of its last turn, or a cache made by hand, whose
    rows have no room for what the call may cache raised ``CapacityError`` at the step that passed
    its reservation, dozens of decode steps in, the cache left holding half a turn: refused before
    anything is computed now, the cache as it was (and it still continues a call that fits)."""
    from transformers import DynamicCache

    from hf_vkv import CapacityError

    model = tiny("llama")  # 256 positions: vkv reserves room for the model's context
    first = model.generate(**prompts(1, 100), max_new_tokens=100, cache_implementation="vkv",
                           return_dict_in_generate=True)
    cache = first[cache_kwarg()]
    held = cache.get_seq_length()
    ids = torch.cat([first.sequences, torch.tensor([[5, 6, 7]])], 1)
    with pytest.raises(CapacityError, match="has room for 256 tokens a row and this call may cache 302.*nothing was "
                                            "computed"):
        model.generate(input_ids=ids, max_new_tokens=100, **{cache_kwarg(): cache})
    assert cache.get_seq_length() == held
    cache.check_invariants()
    ref_cache = DynamicCache(config=model.config)
    model.generate(**prompts(1, 100), max_new_tokens=100, **{cache_kwarg(): ref_cache})
    ref = model.generate(input_ids=ids, max_new_tokens=20, **{cache_kwarg(): ref_cache})
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=20, **{cache_kwarg(): cache}), ref)
    with pytest.raises(CapacityError, match="room for 20 tokens a row and this call may cache 39"):
        model.generate(**prompts(1, 10), max_new_tokens=30, **{cache_kwarg(): VKVCache(model.config, max_tokens=20)})


def test_a_sliding_model_s_cache_without_room_is_refused_before_any_step():
    """A sliding group's tokens take addresses of its reservation too (its pages behind the window
    are dropped, not its addresses): a window-8 Mistral's conversation continued past the 256 tokens
    its cache reserved raised ``CapacityError`` at the first decode step, the cache left holding
    the whole prompt, so a shorter retry was refused as well. Refused before anything is computed
    now, as for full attention, the cache as it was, and a call that fits continues it."""
    from transformers import DynamicCache

    from hf_vkv import CapacityError

    model = tiny("mistral")
    first = model.generate(**prompts(1, 10), max_new_tokens=5, cache_implementation="vkv", return_dict_in_generate=True)
    cache = first[cache_kwarg()]
    held = cache.get_seq_length()
    long = torch.cat([first.sequences, prompts(1, 236, seed=1)["input_ids"]], 1)
    with pytest.raises(CapacityError, match="has room for 256 tokens a row and this call may cache 260.*nothing was "
                                            "computed"):
        model.generate(input_ids=long, max_new_tokens=10, **{cache_kwarg(): cache})
    assert cache.get_seq_length() == held
    cache.check_invariants()
    ids = torch.cat([first.sequences, torch.tensor([[7, 8]])], 1)
    ref_cache = DynamicCache(config=model.config)
    model.generate(**prompts(1, 10), max_new_tokens=5, **{cache_kwarg(): ref_cache})
    ref = model.generate(input_ids=ids, max_new_tokens=20, **{cache_kwarg(): ref_cache})
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=20, **{cache_kwarg(): cache}), ref)
    with pytest.raises(CapacityError, match="room for 256 tokens a row and this call may cache 259"):
        model.generate(**prompts(1, 250), max_new_tokens=10, **{cache_kwarg(): VKVCache(model.config)})


@pytest.mark.parametrize(("arch", "attn"), [("mistral", "sdpa"), ("mistral", "vkv_paged"), ("gemma3", "sdpa")])
def test_a_budget_does_not_bound_the_tokens_of_a_sliding_group(arch: str, attn: str):
    """A sliding group holds its window whatever the length, so the memory budget does not bound
    its tokens: with ``budget_bytes`` 64 KiB (256 KiB paged), a window-8 Mistral's reservation was
    cut to 129 tokens (budget / bytes a token + 1) and a 200-token answer raised ``CapacityError``
    at token 130 (``max_tokens`` did not help), Gemma 3's sliding groups too, where their windows
    and the full layer's 160 tokens take 44 KiB. Now DynamicCache's tokens."""
    inputs = prompts(1, 10)
    new = 600 if attn == "vkv_paged" else 200
    ref = tiny(arch).generate(**inputs, max_new_tokens=new, do_sample=False)
    budget = (256 if attn == "vkv_paged" else 64) * 1024
    out = tiny(arch, attn=attn).generate(**inputs, max_new_tokens=new, do_sample=False, cache_implementation="vkv",
                                         cache_config={"budget_bytes": budget}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    cache = out[cache_kwarg()]
    cache.check_invariants()
    assert cache.stats().resident_bytes <= budget


@pytest.mark.parametrize("layers", [1, 4])
def test_a_cache_of_a_model_of_another_depth_is_refused_before_any_step(layers: int):
    """A 2-layer model's cache passed to a deeper model's generate filled layers 0-1 and then
    raised at layer 2 with those layers a token longer; passed to a shallower one, it ran and left
    layer 1 behind (ragged lengths). Refused before anything is computed now, the cache as it was."""
    model = tiny("llama")
    first = model.generate(**prompts(1, 7), max_new_tokens=3, cache_implementation="vkv", return_dict_in_generate=True)
    cache = first[cache_kwarg()]
    lengths = [cache.get_seq_length(i) for i in range(2)]
    other = tiny("llama", layers=layers)
    ids = torch.cat([first.sequences, torch.tensor([[5, 6]])], 1)
    with pytest.raises(hf_vkv.ArgumentError, match=f"made for a model of 2 layers .* this model has {layers}.*nothing"):
        other.generate(input_ids=ids, max_new_tokens=3, **{cache_kwarg(): cache})
    assert [cache.get_seq_length(i) for i in range(2)] == lengths
    cache.check_invariants()
    from transformers import DynamicCache
    ref_cache = DynamicCache(config=model.config)
    model.generate(**prompts(1, 7), max_new_tokens=3, **{cache_kwarg(): ref_cache})
    ref = model.generate(input_ids=ids, max_new_tokens=4, **{cache_kwarg(): ref_cache})
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4, **{cache_kwarg(): cache}), ref)


def test_prompt_lookup_has_room_for_what_it_drafts_past_max_length():
    """Prompt lookup cuts its candidates at the prompt's length, not at ``max_length``: a verifying
    forward caches up to ``prompt_lookup_num_tokens`` past ``max_length - 1`` before generate crops
    them. vkv's rows were sized to ``max_length - 1`` (past the model's context, or at the
    ``max_tokens`` its own check asked for) and the call died midway with ``CapacityError``."""
    from hf_vkv import CapacityError

    model = tiny("llama")
    ids = torch.cat([prompts(1, 5)["input_ids"]] * 50, 1)  # 250 tokens of a repeating pattern: drafts match
    ref = model.generate(input_ids=ids, max_new_tokens=25, prompt_lookup_num_tokens=10)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=25, prompt_lookup_num_tokens=10,
                                      cache_implementation="vkv"), ref)
    short = torch.cat([prompts(1, 5)["input_ids"]] * 2, 1)
    with pytest.raises(CapacityError, match="at least 47"):
        model.generate(input_ids=short, max_new_tokens=30, prompt_lookup_num_tokens=8, cache_implementation="vkv",
                       cache_config={"max_tokens": 46})
    ref = model.generate(input_ids=short, max_new_tokens=30, prompt_lookup_num_tokens=8)
    assert torch.equal(model.generate(input_ids=short, max_new_tokens=30, prompt_lookup_num_tokens=8,
                                      cache_implementation="vkv", cache_config={"max_tokens": 47}), ref)


def test_pickling_a_cache_or_a_store_is_a_typed_refusal_and_copies_still_work():
    """``pickle`` / ``torch.save`` of a cache or store raised a raw ``TypeError`` from deep inside
    (``cannot pickle 'mappingproxy' object``, ``'_thread.RLock'``): a typed refusal naming what
    does carry them (a fork, a prefix file, ``store.save``); copies made in the process still work."""
    import copy
    import io
    import pickle

    from hf_vkv import ArgumentTypeError, PrefixStore

    model = tiny("llama")
    out = model.generate(**prompts(1, 12), max_new_tokens=3, cache_implementation="vkv", return_dict_in_generate=True)
    cache = out[cache_kwarg()]
    with pytest.raises(ArgumentTypeError, match=r"not pickled.*copy\.deepcopy.*save_prefix"):
        pickle.dumps(cache)
    with pytest.raises(ArgumentTypeError, match="not pickled"):
        torch.save(out, io.BytesIO())
    with pytest.raises(ArgumentTypeError, match=r"not pickled.*store\.save\(folder, model=model\)"):
        pickle.dumps(PrefixStore(model.config))
    fork = copy.deepcopy(cache)
    assert copy.copy(cache).get_seq_length() == fork.get_seq_length() == cache.get_seq_length()
    fork.check_invariants()
    cache.check_invariants()


def test_an_encoder_decoder_cache_has_stats_and_invariants():
    """``out.cache.stats()`` (the README's first look at a cache) raised ``AttributeError`` for an
    encoder-decoder model: its cache answers for its decoder's self-attention part."""
    from breadth_models import prompts as breadth_prompts
    from breadth_models import tiny as breadth_tiny

    out = breadth_tiny("t5").generate(**breadth_prompts(), max_new_tokens=3, num_beams=2,
                                      cache_implementation="vkv", return_dict_in_generate=True)
    cache = out[cache_kwarg()]
    stats = cache.stats()
    assert stats == cache.self_attention_cache.stats() and stats.resident_bytes > 0
    cache.check_invariants()


def test_a_model_compiled_in_place_is_refused_before_any_step():
    """``model.compile()`` then generate with vkv: the compiled attention read vkv's views with
    other kernels than DynamicCache's tensors, greedy logits 1.2e-7 apart, silently. Refused
    before anything is computed now, naming compile_config; the uncompiled model still runs."""
    model = tiny("llama")
    ids = prompts(1, 9)
    ref = model.generate(**ids, max_new_tokens=3)
    model.model.layers[0].compile()  # in place: nothing is compiled until the module is called
    with pytest.raises(hf_vkv.CompiledModuleError, match=r"model.layers.0.*compile_config=CompileConfig\(\)"):
        model.generate(**ids, max_new_tokens=3, cache_implementation="vkv")
    cache = VKVCache(model.config)
    with pytest.raises(hf_vkv.CompiledModuleError):
        model.generate(**ids, max_new_tokens=3, **{cache_kwarg(): cache})
    assert cache.get_seq_length() == 0
    model.model.layers[0]._compiled_call_impl = None  # what the module had before compile()
    assert torch.equal(model.generate(**ids, max_new_tokens=3, cache_implementation="vkv"), ref)


@pytest.mark.parametrize("how", ["the model's forward", "an attention's forward", "a layer wrapped"])
def test_a_model_compiled_by_hand_is_refused_before_any_step(how: str):
    """``torch.compile`` by hand: ``model.forward = torch.compile(model.forward)`` gave decode
    logits 2.1e-6 off DynamicCache's under the same compiled forward, silently; a compiled
    attention forward or a layer replaced by its compiled wrapper failed midway with a raw
    inductor error. Each is refused before anything is computed, as ``model.compile()`` is
    (nothing is compiled until called: the refusal costs no compilation)."""
    model = copy.deepcopy(tiny("llama"))  # tiny's models are shared: this one is changed
    ids = prompts(1, 9)
    ref = model.generate(**ids, max_new_tokens=3)
    layers = model.model.layers
    if how == "the model's forward":
        model.forward = torch.compile(model.forward)
    elif how == "an attention's forward":
        layers[1].self_attn.forward = torch.compile(layers[1].self_attn.forward)
    else:
        layers[0] = torch.compile(layers[0])
    with pytest.raises(hf_vkv.CompiledModuleError, match="torch.compile"):
        model.generate(**ids, max_new_tokens=3, cache_implementation="vkv")
    if how == "the model's forward":
        del model.forward
    elif how == "an attention's forward":
        del layers[1].self_attn.forward
    else:
        layers[0] = layers[0]._orig_mod
    assert torch.equal(model.generate(**ids, max_new_tokens=3, cache_implementation="vkv"), ref)


def test_keys_and_values_of_two_dtypes_under_autocast_say_what_to_do():
    """Under ``torch.autocast`` a Llama's keys come out float32 and its values bfloat16; vkv keeps
    one dtype a layer, and its refusal said only that they differ."""
    model = tiny("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(LayerMismatchError, match=r"torch.autocast.*model.to"):
        model.generate(**prompts(1, 9), max_new_tokens=3, cache_implementation="vkv")


@pytest.mark.parametrize("short", [3, 13])
def test_continuing_a_cache_with_the_new_tokens_alone_is_a_typed_error(short: int) -> None:
    """A call that continues a returned cache with input_ids no longer than what the cache holds
    (the new tokens alone, without the history) failed inside the model's forward with
    ``RuntimeError: cannot reshape tensor of 0 elements`` (DynamicCache too). It is an
    ``ArgumentError`` naming both lengths and what to pass, before anything is computed; the cache
    is as it was and continues exactly."""
    model = tiny("llama")
    inputs = prompts(1, 10, seed=4)
    out = model.generate(**inputs, max_new_tokens=4, cache_implementation="vkv", return_dict_in_generate=True)
    cache = out[cache_kwarg()]
    held = cache.get_seq_length()
    assert held == 13
    with pytest.raises(hf_vkv.ArgumentError, match=rf"already holds 13 tokens a row and input_ids hold {short}"):
        model.generate(input_ids=out.sequences[:, :short], **{cache_kwarg(): cache}, max_new_tokens=3)
    assert cache.get_seq_length() == held
    cache.check_invariants()
    ids = torch.cat([out.sequences, torch.tensor([[33, 34]])], 1)
    got = model.generate(input_ids=ids, **{cache_kwarg(): cache}, max_new_tokens=3, return_dict_in_generate=True,
                         output_logits=True)
    first = model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True)  # DynamicCache, continued
    assert torch.equal(first.sequences, out.sequences)
    want = model.generate(input_ids=ids, **{cache_kwarg(): first[cache_kwarg()]}, max_new_tokens=3,
                          return_dict_in_generate=True, output_logits=True)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
