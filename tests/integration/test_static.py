"""The static (compileable) layout: StaticLayer's contract over virtual memory.

Every case compares with transformers' ``StaticCache`` under the same compile configuration (the
oracle for compiled decoding) and counts compiled frames: one capture for the whole generation,
no recompilation per step, no graph break (``fullgraph=True``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import CompileConfig
from transformers.cache_utils import StaticCache

import hf_vkv
from hf_vkv import VKVCache, devices
from hf_vkv.ab.probes import kv_bytes
from hf_vkv.generate import cache_kwarg
from models import assert_same_tokens, prompts, tiny

pytestmark = pytest.mark.integration

FRAMES: list[int] = []


def _counting_backend(gm: torch.fx.GraphModule, example_inputs: Any, **_: Any) -> Any:
    """A compile backend that runs the captured graph as it is and counts captures (a module-level
    function: generate deep-copies its compile config, so a counting object would be copied)."""
    FRAMES.append(len(gm.graph.nodes))
    return gm.forward


def _compile_config(backend: Any = _counting_backend, *, dynamic: bool | None = False) -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=backend, mode=None)
    config._compile_all_devices = True  # compile on the CPU too (transformers compiles on accelerators only)
    return config


MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, num_return_sequences=2, top_k=0, top_p=1.0),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_generate_matches_static_cache(arch: str, mode: str) -> None:
    model = tiny(arch)
    inputs = prompts(2, 9, seed=31, left_pad=[0, 3])
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_logits=True, **MODES[mode])
    torch._dynamo.reset()
    FRAMES.clear()
    torch.manual_seed(5)
    ref = model.generate(**inputs, cache_implementation="static", compile_config=_compile_config(), **kwargs)
    assert len(FRAMES) == 1  # the reference compiled too
    torch._dynamo.reset()
    FRAMES.clear()
    torch.manual_seed(5)
    got = model.generate(**inputs, cache_implementation="vkv", cache_config={"page_bytes": 4096},
                         compile_config=_compile_config(), **kwargs)
    assert got.past_key_values.layout == "static"  # chosen because compile_config was given
    assert len(FRAMES) == 1, f"{len(FRAMES)} captures for 11 compiled steps"  # no recompilation per step
    assert_same_tokens(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)
    got.past_key_values.check_invariants()


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("mode", ["greedy", "beams", "sampled"])
def test_a_compile_config_transformers_does_not_compile_keeps_dynamic_cache_bits(mode: str) -> None:
    """On the CPU a plain ``CompileConfig()`` compiles nothing (transformers compiles there only
    with ``_compile_all_devices``), and ``disable_compile=True`` nothing anywhere: the call without
    vkv generates with DynamicCache, so vkv keeps the default layout and its bits (before, it took
    the static layout, StaticCache's arithmetic: logits up to 3e-5 apart)."""
    model = tiny("llama")
    inputs = prompts(2, 9, seed=34, left_pad=[3, 0])
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True, output_logits=True,
                  **{"greedy": {}, "beams": {"num_beams": 2}, "sampled": {"do_sample": True}}[mode])
    for extra in ({"compile_config": CompileConfig()}, {"compile_config": _compile_config(), "disable_compile": True}):
        torch.manual_seed(6)
        ref = model.generate(**inputs, **extra, **kwargs)
        torch.manual_seed(6)
        got = model.generate(**inputs, cache_implementation="vkv", **extra, **kwargs)
        assert got.past_key_values.layout != "static"
        assert_same_tokens(ref.sequences, got.sequences)
        for a, b in zip(ref.logits, got.logits, strict=True):
            assert torch.equal(a, b)


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_beam_search_with_a_static_layout_matches_static_cache(arch: str) -> None:
    """transformers' beam search does not compile the forward (5.23): the layout's beams run
    eagerly here, token-identical to StaticCache's; the compiled reorder is the next test."""
    model = tiny(arch)
    inputs = prompts(2, 9, seed=32, left_pad=[2, 0])
    kwargs = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False)
    ref = model.generate(**inputs, cache_implementation="static", **kwargs, disable_compile=True)
    got = model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "static", "page_bytes": 4096},
                         compile_config=_compile_config(), return_dict_in_generate=True, **kwargs)
    assert_same_tokens(ref, got.sequences)
    stats = got.past_key_values.stats()
    assert stats.cow_copies + stats.tail_copies > 0  # beams did share, then copy, pages (at a write or a reorder)
    got.past_key_values.check_invariants()


@pytest.mark.threads(1, 2)
def test_a_graph_captured_once_survives_beam_reorders_and_copy_on_write() -> None:
    """A forward compiled at the first decode step runs 16 steps with a reorder (rows taking other
    rows' pages, copy-on-write of shared tails) between each: the same logits as StaticCache, whose
    reorder copies every row, and a single capture."""
    model = tiny("llama")
    rows, prompt = 4, 11
    ids = prompts(rows, prompt, seed=33)["input_ids"]
    vkv = VKVCache(model.config, layout="static", page_bytes=4096, batch_size=rows, max_tokens=64)
    static = StaticCache(config=model.config, max_cache_len=64)
    torch._dynamo.reset()
    FRAMES.clear()
    step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=_counting_backend)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        outs = [model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True) for cache in (vkv, static)]
        assert torch.equal(outs[0].logits, outs[1].logits)
        for k in range(16):
            nxt = outs[0].logits[:, -1].argmax(-1, keepdim=True)
            positions = torch.full((rows, 1), prompt + k)
            vkv.map_ahead(1)  # what generate does before each step
            outs = [step(input_ids=nxt, **{cache_kwarg(): cache}, position_ids=positions, use_cache=True)
                    for cache in (vkv, static)]
            assert torch.equal(outs[0].logits, outs[1].logits), f"step {k}"
            beam_idx = torch.randint(0, rows, (rows,), generator=g)
            vkv.reorder_cache(beam_idx)
            static.reorder_cache(beam_idx)
    assert len(FRAMES) == 2  # one capture per cache class, none again over 16 steps and 16 reorders
    # beams took other rows' pages: their partly written pages were copied, by a reorder into the
    # row's own page (remapping nothing under the captured addresses) or on write
    stats = vkv.stats()
    assert stats.tail_copies > 0 and stats.cow_copies + stats.tail_copies > 0
    vkv.check_invariants()


def _ahead_pages_shared(cache: VKVCache) -> list[int]:
    """Pages a compiled step may write (from the written length's page on) that a row of ``cache``
    holds but does not own alone."""
    written = int(cache.get_seq_length())
    shared = []
    for group in cache.groups:
        buffer = group.buffer
        first = written * buffer.item_bytes // buffer.table.page_size
        for r in range(group.batch):
            for t in buffer.table_rows(r):
                row = buffer.table.row(t)
                shared += [p for p in row.pages[max(first - row.start, 0):] if buffer.table.pool.refcount(p) > 1]
    return shared


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize(("prompt", "moves"), [(11, False), (70, True)])
def test_a_reorder_maps_ahead_again_only_when_it_moved_page_references(monkeypatch: pytest.MonkeyPatch, prompt: int,
                                                                      moves: bool) -> None:
    """Row 1 takes row 0's history (64 tokens per 4096-byte page of a 16-wide head). Within one
    page (11 tokens) row 1 keeps its table and gets the written bytes copied in: no page, length
    or mapping changes, so the reorder does not check every sub-row's pages again (the next
    step's ``map_ahead`` does). Past a page (70 tokens) row 1 takes row 0's first page: the
    reorder maps ahead at once. Either way every page a compiled step may write is its row's own."""
    from hf_vkv.cache.static_group import StaticGroup

    calls: list[int | None] = []
    original = StaticGroup.map_ahead

    def counted(self: StaticGroup, tokens: int | None = None) -> None:
        calls.append(tokens)
        original(self, tokens)

    monkeypatch.setattr(StaticGroup, "map_ahead", counted)
    model = tiny("llama")
    cache = VKVCache(model.config, layout="static", page_bytes=4096, batch_size=2, max_tokens=192)
    ids = prompts(2, prompt, seed=38)["input_ids"]
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True)
    cache.map_ahead(1)  # what generate does before each step
    assert _ahead_pages_shared(cache) == []
    before = [list(g.buffer.table.entries) for g in cache.groups]
    calls.clear()
    cache.reorder_cache(torch.tensor([0, 0]))
    assert calls == ([None] * len(cache.groups) if moves else [])
    assert ([list(g.buffer.table.entries) for g in cache.groups] != before) == moves
    assert _ahead_pages_shared(cache) == []
    cache.check_invariants()
    # row 1 now reads row 0's tokens: the next step gives StaticCache's logits after the same reorder
    # (not "both rows equal": on some CPUs at two threads a batch's identical rows differ in the
    # last bits, StaticCache's as much as ours)
    oracle = StaticCache(config=model.config, max_cache_len=192)
    step = dict(input_ids=ids[:1, :1].expand(2, 1), position_ids=torch.full((2, 1), prompt), use_cache=True)
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(): oracle}, use_cache=True)
        oracle.reorder_cache(torch.tensor([0, 0]))
        want = model(**{cache_kwarg(): oracle}, **step).logits
        cache.map_ahead(1)
        out = model(**{cache_kwarg(): cache}, **step).logits
    assert torch.equal(out, want)
    cache.check_invariants()


@pytest.mark.parametrize("base", ["head_major", "token_major"])
def test_inductor_compiled_greedy_matches_static_cache(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor (AOT autograd) over the static layout on either contiguous layout it wraps: the CPU's
    (head-major) and CUDA's (token-major, set here as the CPU's default). Token-major puts every layer of
    a group in one reservation, so the layers' full views share storage and are mutated in place:
    AOT autograd accepts that only if they share one ``_base`` (it rejected them when each layer's
    view was typed on its own, the failure a GPU run found)."""
    monkeypatch.setitem(devices._POLICIES, "cpu", dataclasses.replace(devices.policy_for("cpu"), layout=base))
    model = tiny("llama")
    inputs = prompts(2, 12, seed=3, left_pad=[0, 4])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    torch._dynamo.reset()
    ref = model.generate(**inputs, cache_implementation="static", compile_config=_compile_config("inductor"), **kwargs)
    torch._dynamo.reset()
    got = model.generate(**inputs, cache_implementation="vkv", compile_config=_compile_config("inductor"),
                         return_dict_in_generate=True, **kwargs)
    assert type(got.past_key_values.layers[0].group.layout.base).__name__ == {
        "head_major": "HeadMajorLayout", "token_major": "TokenMajorLayout"}[base]
    assert_same_tokens(ref, got.sequences)


def test_resident_bytes_follow_the_tokens_not_the_capacity() -> None:
    """A 1k-token prompt in a cache of 32k tokens per row: the pages hold the live tokens (plus the
    pages mapped ahead), where a StaticCache holds the whole capacity."""
    model = tiny("llama")
    ids = prompts(1, 1024, seed=35)["input_ids"]
    cache = VKVCache(model.config, layout="static", page_bytes=4096, max_tokens=32 * 1024)
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True)
    cache.map_ahead(1)
    stats = cache.stats()
    assert stats.resident_bytes <= 1.1 * stats.token_bytes, (stats.resident_bytes, stats.token_bytes)
    static = StaticCache(config=model.config, max_cache_len=32 * 1024)
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(): static}, use_cache=True)
    assert kv_bytes(static) >= 30 * stats.resident_bytes  # StaticCache: its full-capacity buffers
    # and the full-capacity views really span the capacity, at fixed addresses
    keys, _ = cache.layers[0].full_keys, cache.layers[0].full_values
    assert keys.shape[2] == 32 * 1024 and torch.count_nonzero(keys[:, :, 2048:]) == 0  # unbacked reads as zeros


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_window_layers_compile_as_static_cache_s(arch: str) -> None:
    """Sliding-window layers keep transformers' StaticSlidingWindowLayer (a bounded window, as in
    StaticCache); full-attention layers are vkv's: the whole model is token- and logit-identical to
    StaticCache, past the window, with as many captures as StaticCache (its sliding layer keeps a
    Python int length, so it needs ``dynamic=None``: ``dynamic=False`` recompiles it every step)."""
    model = tiny(arch)
    inputs = prompts(2, 9, seed=36, left_pad=[0, 2])
    kwargs = dict(max_new_tokens=14, do_sample=False, return_dict_in_generate=True, output_logits=True)
    torch._dynamo.reset()
    FRAMES.clear()
    ref = model.generate(**inputs, cache_implementation="static", compile_config=_compile_config(dynamic=None), **kwargs)
    reference_frames = len(FRAMES)
    torch._dynamo.reset()
    FRAMES.clear()
    got = model.generate(**inputs, cache_implementation="vkv", cache_config={"page_bytes": 4096},
                         compile_config=_compile_config(dynamic=None), **kwargs)
    assert reference_frames <= 2 and len(FRAMES) == reference_frames  # no more captures than StaticCache's own
    assert_same_tokens(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)
    cache = got.past_key_values
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == [type(layer).__name__.replace("StaticLayer", "VKVStaticLayer") for layer in ref.past_key_values.layers]
    assert cache.stats().vkv_layers == kinds.count("VKVStaticLayer")
    cache.check_invariants()


def test_static_layout_is_compileable_only_there() -> None:
    model = tiny("llama")
    assert VKVCache(model.config, layout="static").is_compileable
    assert not VKVCache(model.config).is_compileable
    assert isinstance(VKVCache(model.config, layout="static"), hf_vkv.VKVCache)


def test_a_fork_of_a_static_cache_has_its_own_length_and_pages() -> None:
    """The fork's layers get their own length tensor and full views of the fork's pages: stepping
    the fork leaves the original's length and next logits as if there were no fork."""
    model = tiny("llama")
    ids = prompts(2, 9, seed=37)["input_ids"]
    cache, alone = (VKVCache(model.config, layout="static", page_bytes=4096, max_tokens=64) for _ in range(2))
    step = dict(position_ids=torch.full((2, 1), 9), use_cache=True)
    with torch.no_grad():
        for c in (cache, alone):
            model(input_ids=ids, **{cache_kwarg(): c}, use_cache=True)
        fork = cache.fork()
        model(input_ids=ids[:, :1], **{cache_kwarg(): fork}, **step)
        assert int(cache.get_seq_length()) == 9 and int(fork.get_seq_length()) == 10
        assert fork.layers[0].full_keys.data_ptr() != cache.layers[0].full_keys.data_ptr()
        got = model(input_ids=ids[:, 1:2], **{cache_kwarg(): cache}, **step).logits
        ref = model(input_ids=ids[:, 1:2], **{cache_kwarg(): alone}, **step).logits
    assert torch.equal(got, ref)
    for c in (cache, fork):
        c.check_invariants()


@pytest.mark.parametrize("given", [None, 20])
def test_a_shorter_call_after_a_longer_one_keeps_static_cache_s_capacity(given: int | None) -> None:
    """transformers sizes generate's StaticCache to the largest capacity a static call of the model
    had (``model._previous_max_cache_length``, against recompiling), and its attention sums over the
    whole capacity: the static layout does the same, so a shorter call after a longer one gives
    StaticCache's logits bit for bit. It sized itself to the call alone (logits 2-3e-6 apart, found
    when another test's longer static call ran first on the same model)."""
    import copy

    model = copy.deepcopy(tiny("llama"))
    extra = {} if given is None else {"max_cache_len": given}
    long, short = prompts(1, 30, seed=2), prompts(2, 8, seed=4)
    kwargs: dict[str, Any] = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)
    model.generate(**long, max_new_tokens=8, cache_implementation="static", **kwargs)
    capacity = model._previous_max_cache_length
    assert capacity > 8 + 6
    ref = model.generate(**short, max_new_tokens=6, cache_implementation="static", cache_config=extra or None,
                         **kwargs)
    got = model.generate(**short, max_new_tokens=6, cache_implementation="vkv",
                         cache_config={"layout": "static", **extra}, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)
    assert got[cache_kwarg()].options.max_tokens == model._previous_max_cache_length == capacity


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generate_s_max_cache_len_sizes_the_static_layout_as_static_cache(arch: str) -> None:
    """``generate(max_cache_len=L)`` is transformers' ceiling for its StaticCache (sized
    ``max(max_length - 1, L)``), whose attention sums over the whole capacity: the static layout
    sized itself to the call alone and its logits were 7e-7 off StaticCache's, silently. Now sized
    as StaticCache, bit for bit (and ``cache_config['max_tokens']``, vkv's own, still wins)."""
    import copy

    reference, model = copy.deepcopy(tiny(arch)), copy.deepcopy(tiny(arch))  # fresh: _previous_max_cache_length
    inputs = prompts(3, 10, seed=5, left_pad=[0, 3, 5])
    kwargs: dict[str, Any] = dict(do_sample=False, output_logits=True, return_dict_in_generate=True,
                                  max_new_tokens=12, max_cache_len=64)
    ref = reference.generate(**inputs, cache_implementation="static", **kwargs)
    got = model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "static"}, **kwargs)
    assert_same_tokens(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)
    assert got[cache_kwarg()].options.max_tokens == 64
    own = model.generate(**inputs, cache_implementation="vkv", cache_config={"layout": "static", "max_tokens": 80},
                         **kwargs)
    assert own[cache_kwarg()].options.max_tokens == 80


@pytest.mark.parametrize("compiled", [False, True])
def test_a_budget_that_cannot_hold_the_capacity_is_refused_before_any_step(compiled: bool) -> None:
    """The static layout's attention reads every row's whole capacity (the mask covers
    ``max_cache_len``); a budget holding fewer tokens a row cut the reservation below it, and
    attention failed with a raw torch ``RuntimeError`` (mask 100 against keys 65). Now a
    :class:`KVCacheOutOfMemory` before any step, nothing stored, whose ``fits_bytes`` runs the call
    with StaticCache's logits bit for bit."""
    import copy

    from transformers import LogitsProcessor, LogitsProcessorList

    steps: list[int] = []

    class Count(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            steps.append(1)
            return scores

    reference, model = copy.deepcopy(tiny("llama")), copy.deepcopy(tiny("llama"))  # fresh: _previous_max_cache_length
    inputs = prompts(1, 9, seed=38)
    kwargs: dict[str, Any] = dict(max_new_tokens=92, min_new_tokens=92, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
    extra: dict[str, Any] = {"compile_config": _compile_config()} if compiled else {}
    layout = {} if compiled else {"layout": "static"}  # a compile_config chooses the static layout
    # 2 layers x K/V x 2 heads x 16 dims x 4 bytes = 512 bytes a token: 8 pages hold the prompt and 64 tokens a
    # row, not the capacity of 100
    torch._dynamo.reset()
    FRAMES.clear()
    with pytest.raises(hf_vkv.KVCacheOutOfMemory) as refused:
        model.generate(**inputs, cache_implementation="vkv",
                       cache_config={**layout, "page_bytes": 4096, "budget_bytes": 8 * 4096},
                       logits_processor=LogitsProcessorList([Count()]), **extra, **kwargs)
    assert not steps and not FRAMES  # no step ran, nothing compiled
    assert "budget_bytes" in str(refused.value) and refused.value.fits_bytes == 16 * 4096  # 8 sub-rows, 2 pages each
    torch._dynamo.reset()
    ref = reference.generate(**inputs, cache_implementation="static", **extra, **kwargs)
    torch._dynamo.reset()
    got = model.generate(**inputs, cache_implementation="vkv",
                         cache_config={**layout, "page_bytes": 4096, "budget_bytes": refused.value.fits_bytes},
                         **extra, **kwargs)
    assert got.past_key_values.layout == "static"
    assert_same_tokens(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits, strict=True):
        assert torch.equal(a, b)
    got.past_key_values.check_invariants()


def test_a_static_cache_refused_by_its_budget_is_left_as_it_was() -> None:
    """A cache passed in whose budget cannot hold a row's capacity refuses the first update before
    it makes anything (no buffer, no layer initialized, no page): the message says what to do."""
    model = tiny("llama")
    ids = prompts(2, 9, seed=39)["input_ids"]
    # the budget holds the prompt and 128 tokens a row (16 pages), not 200; both rows: 2 x 8 sub-rows x 4 pages
    cache = VKVCache(model.config, layout="static", page_bytes=4096, budget_bytes=16 * 4096, max_tokens=200)
    with torch.no_grad(), pytest.raises(hf_vkv.KVCacheOutOfMemory, match=r"budget_bytes'\] to at least 262,144"):
        model(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True)
    assert not any(layer.is_initialized for layer in cache.layers) and cache.get_seq_length() == 0
    assert all(group.buffer is None and group.geometry is None for group in cache._groups)
    assert cache.stats().resident_bytes == 0
    cache.check_invariants()
