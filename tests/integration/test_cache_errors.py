"""Named errors: what goes wrong says what it is, and leaves the cache consistent and usable."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import FIRST_WORD, SMALL_PAGE, assert_same_tokens, prompts, tiny
from transformers.cache_utils import DynamicCache

from hf_vkv import CacheClosedError, CapacityError, KVCacheOutOfMemory, LayerMismatchError, VKVCache
from hf_vkv.devices import UnsupportedDeviceError
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration


def _states(batch: int = 2, heads: int = 2, q: int = 5, dim: int = 16, dtype: torch.dtype = torch.float32,
            device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, q, dim, generator=g).to(dtype)
    return k.to(device), (k * 2).to(device)


# ------------------------------------------------------------------------------------ layer mismatch
@pytest.mark.parametrize("what", ["heads", "head_dim", "dtype", "device"])
def test_layer_mismatch_inside_a_group(what: str) -> None:
    model = tiny("llama")
    cache = VKVCache(config=model.config, page_bytes=SMALL_PAGE)
    k0, v0 = _states()
    cache.update(k0, v0, 0)
    bad = {"heads": dict(heads=4), "head_dim": dict(dim=8), "dtype": dict(dtype=torch.float64),
           "device": dict(device="meta")}[what]
    with pytest.raises(LayerMismatchError, match=r"layer 1 has .* but its group 'full_attention' holds") as info:
        cache.update(*_states(**bad), 1)
    assert "groups" in str(info.value)  # says what to do
    assert isinstance(info.value, ValueError)
    # nothing changed: layer 1 can still join with matching states, layer 0 is intact
    keys, values = cache.update(*_states(seed=1), 1)
    assert torch.equal(keys, _states(seed=1)[0]) and torch.equal(cache.layers[0].keys, k0)
    cache.check_invariants()


def test_per_layer_groups_accept_different_geometries() -> None:
    """The fix the error message suggests works."""
    cache = VKVCache(config=tiny("llama").config, groups="layer")
    cache.update(*_states(), 0)
    keys, _ = cache.update(*_states(heads=4, dtype=torch.float64), 1)
    assert keys.dtype == torch.float64 and keys.shape[1] == 4
    assert len(cache.groups) == 2
    cache.check_invariants()


def test_keys_and_values_must_match() -> None:
    cache = VKVCache(config=tiny("llama").config)
    k, v = _states()
    with pytest.raises(LayerMismatchError, match="key/value states"):
        cache.update(k, v[:, :, :3], 0)
    with pytest.raises(LayerMismatchError, match=r"keys \(torch.float32 on cpu\) and values \(torch.float64 on cpu\) differ"):
        cache.update(k, v.double(), 0)


def test_unsupported_device() -> None:
    cache = VKVCache(config=tiny("llama").config)
    with pytest.raises(UnsupportedDeviceError, match="only the host"):
        cache.update(*_states(device="meta"), 0)


def test_batch_larger_than_the_rows_of_a_filled_cache() -> None:
    cache = VKVCache(config=tiny("llama").config)
    cache.update(*_states(batch=2), 0)
    cache.update(*_states(batch=2), 1)
    with pytest.raises(LayerMismatchError, match="batch 3 is larger than the 2 rows"):
        cache.update(*_states(batch=3, q=1), 0)
    cache.check_invariants()


def test_fewer_rows_than_a_filled_cache_holds() -> None:
    """Continuing one row of a two-row cache would leave the other behind unread (DynamicCache
    fails to concatenate): refused, nothing changed; with the row selected first it continues as
    DynamicCache does."""
    model = tiny("llama")
    inputs = prompts(2, 10, left_pad=[0, 3], seed=4)
    for name in ("dynamic", "vkv"):
        extra = {"cache_implementation": "vkv"} if name == "vkv" else {}
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **extra)
        cache = out.past_key_values
        ids = torch.cat([out.sequences, torch.full((2, 2), FIRST_WORD)], 1)[:1]
        mask = torch.ones(1, ids.shape[1], dtype=torch.long)
        if name == "vkv":
            length = cache.get_seq_length()
            with pytest.raises(LayerMismatchError, match="batch 1 continues a cache of 2 rows"):
                model.generate(input_ids=ids, attention_mask=mask, **{cache_kwarg(): cache}, max_new_tokens=3)
            assert cache.get_seq_length() == length
            cache.check_invariants()
        cache.batch_select_indices(torch.tensor([0]))
        got = model.generate(input_ids=ids, attention_mask=mask, **{cache_kwarg(): cache}, max_new_tokens=3,
                             do_sample=False)
        if name == "dynamic":
            want = got
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------ capacity
def test_prompt_longer_than_the_reservation() -> None:
    model = tiny("llama")
    inputs = prompts(2, 10, seed=71)
    cache = VKVCache(config=model.config, max_tokens=8)
    with pytest.raises(CapacityError, match="room for 8 tokens a row and this call may cache 12"):
        model.generate(**inputs, **{cache_kwarg(): cache}, max_new_tokens=3)  # refused before the prefill
    assert cache.get_seq_length() == 0
    cache.check_invariants()
    with pytest.raises(CapacityError, match="10 items do not fit: rows were reserved for 8"), torch.no_grad():
        model(**inputs, **{cache_kwarg(): cache})  # a forward by hand meets the reservation itself
    assert cache.get_seq_length() == 0
    cache.check_invariants()
    with pytest.raises(CapacityError):
        model.generate(**inputs, cache_implementation="vkv", cache_config={"max_tokens": 8}, max_new_tokens=3)


def test_generation_running_past_the_reservation() -> None:
    model = tiny("llama")
    cache = VKVCache(config=model.config, max_tokens=14, page_bytes=SMALL_PAGE)
    inputs = prompts(2, 10, seed=72)
    with pytest.raises(CapacityError, match="room for 14 tokens a row and this call may cache 19"):
        model.generate(**inputs, **{cache_kwarg(): cache}, max_new_tokens=10, do_sample=False)
    assert cache.get_seq_length() == 0  # generate refuses before its prefill; decode steps by hand run into it
    with torch.no_grad():
        model(**inputs, **{cache_kwarg(): cache})
        with pytest.raises(CapacityError, match="15 items do not fit"):
            for _ in range(10):
                model(input_ids=inputs["input_ids"][:, -1:], **{cache_kwarg(): cache})
    assert all(layer.get_seq_length() == 14 for layer in cache.layers)  # every step before it is whole
    cache.check_invariants()


# ------------------------------------------------------------------------------------ budget
def test_budget_too_small_then_recovers() -> None:
    model = tiny("llama")
    inputs = prompts(2, 10, seed=73)  # 2 rows x 40 tokens x 512 B = 10 pages of 4 KiB at the end
    kwargs: dict[str, Any] = {"max_new_tokens": 30, "do_sample": False}
    expected = model.generate(**inputs, **kwargs)

    with pytest.raises(KVCacheOutOfMemory) as info:
        model.generate(**inputs, cache_implementation="vkv",
                       cache_config={"page_bytes": SMALL_PAGE, "budget_bytes": 6 * SMALL_PAGE}, **kwargs)
    err = info.value
    assert isinstance(err, MemoryError)
    assert err.budget_bytes == 6 * SMALL_PAGE and err.requested_bytes > err.free_bytes >= 0
    assert "budget_bytes" in str(err)

    # the same cache object: consistent after the failure, usable once rows are freed
    # token-major: one 512-byte token of both layers after another, 8 tokens a page
    cache = VKVCache(config=model.config, layout="token_major", page_bytes=SMALL_PAGE, budget_bytes=6 * SMALL_PAGE)
    with pytest.raises(KVCacheOutOfMemory):
        model.generate(**inputs, **{cache_kwarg(): cache}, **kwargs)
    cache.check_invariants()
    lengths = {layer.get_seq_length() for layer in cache.layers}
    assert lengths == {24}  # 6 pages = 2 rows x 24 tokens: the step that needed a 7th page wrote nothing
    assert torch.equal(cache.layers[0].keys[:, :, :10],
                       DynamicCache(config=model.config).update(*_prefill_kv(model, inputs), 0)[0])
    cache.reset()
    assert cache.stats().resident_bytes == 0
    short = {"max_new_tokens": 12, "do_sample": False}
    assert_same_tokens(model.generate(**inputs, **short), model.generate(**inputs, **{cache_kwarg(): cache}, **short))
    cache.check_invariants()

    # a new generate with a bigger budget works
    out = model.generate(**inputs, cache_implementation="vkv", return_dict_in_generate=True,
                         cache_config={"layout": "token_major", "page_bytes": SMALL_PAGE,
                                       "budget_bytes": 10 * SMALL_PAGE}, **kwargs)
    assert_same_tokens(expected, out.sequences)
    assert out.past_key_values.stats().pool_resident_bytes <= 10 * SMALL_PAGE
    out.past_key_values.check_invariants()


def _prefill_kv(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(**inputs, **{cache_kwarg(): ref})
    return ref.layers[0].keys, ref.layers[0].values


def test_budget_shared_by_two_groups() -> None:
    """gemma3: a sliding and a full group draw on one budget; running out leaves both consistent."""
    model = tiny("gemma3")
    cache = VKVCache(config=model.config, page_bytes=SMALL_PAGE, budget_bytes=4 * SMALL_PAGE)
    with pytest.raises(KVCacheOutOfMemory):
        model.generate(**prompts(2, 10, seed=74), **{cache_kwarg(): cache}, max_new_tokens=60, do_sample=False)
    cache.check_invariants()
    assert cache.stats().pool_resident_bytes <= 4 * SMALL_PAGE


def test_budget_smaller_than_a_page() -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match="smaller than one page"):
        model.generate(**prompts(1, 4), cache_implementation="vkv", max_new_tokens=2,
                       cache_config={"page_bytes": SMALL_PAGE, "budget_bytes": 1000})


# ------------------------------------------------------------------------------------ closed
def test_use_after_close() -> None:
    model = tiny("llama")
    inputs = prompts(1, 6, seed=75)
    out = model.generate(**inputs, cache_implementation="vkv", max_new_tokens=4, return_dict_in_generate=True)
    cache = out.past_key_values
    (group,) = cache.groups
    arena = group.buffer.store
    cache.close()
    cache.close()  # idempotent
    assert arena.closed and arena.pool.stats().in_use == 0
    with pytest.raises(CacheClosedError, match="closed"):
        cache.layers[0].keys
    with pytest.raises(CacheClosedError):
        model.generate(input_ids=out.sequences, **{cache_kwarg(): cache}, max_new_tokens=2)
    with pytest.raises(CacheClosedError):
        cache.update(*_states(batch=1, q=1), 0)
    assert cache.stats().resident_bytes == 0


# ------------------------------------------------------------------------------------ options
def test_unknown_cache_config_key() -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"unknown cache_config key\(s\) \['page_size'\].*known keys"):
        model.generate(**prompts(1, 4), cache_implementation="vkv", cache_config={"page_size": 4096},
                       max_new_tokens=2)
    with pytest.raises(ValueError, match=r"keyword argument\(s\) \['pages_bytes'\] for VKVCache\(\).*did you mean 'page_bytes'"):
        VKVCache(config=model.config, pages_bytes=4096)  # the constructor's words, not cache_config's


@pytest.mark.parametrize("bad", [{"page_bytes": -1}, {"page_bytes": 1000}, {"budget_bytes": 0},
                                 {"group_policy": "row"}, {"max_tokens": 0}])
def test_bad_option_values(bad: dict[str, Any]) -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match=next(iter(bad))):
        model.generate(**prompts(1, 4), cache_implementation="vkv", cache_config=bad, max_new_tokens=2)


def test_cache_implementation_with_past_key_values() -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match="Passing both `cache_implementation`"):
        model.generate(**prompts(1, 4), cache_implementation="vkv", **{cache_kwarg(): VKVCache(config=model.config)},
                       max_new_tokens=2)
    with pytest.raises(ValueError, match="Passing both `cache_implementation`"):
        model.generate(**prompts(1, 4), cache_implementation="vkv", **{cache_kwarg(): DynamicCache()}, max_new_tokens=2)


def test_constructor_misuse() -> None:
    with pytest.raises(TypeError, match=r"VKVCache\(config=model.config\)"):
        VKVCache(config=None)
    from hf_vkv import CacheOptions

    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['options'\] for VKVCache\(\)"):  # one way in
        VKVCache(config=tiny("llama").config, options=CacheOptions(), page_bytes=SMALL_PAGE)
    with pytest.raises(ValueError, match=r"\['max_tokenz'\] for VKVCache\(\).*did you mean 'max_tokens'"):  # never ignored
        VKVCache(config=tiny("llama").config, max_tokenz=5)
    cache = VKVCache(config=tiny("llama").config, max_tokens=5)
    cache.update(*_states(q=5), 0)
    with pytest.raises(CapacityError):  # max_tokens is honoured
        cache.update(*_states(q=1), 0)


# ------------------------------------------------------------------------------------ row operations' arguments
def _fed(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


def test_a_cache_continued_with_more_rows_than_it_holds_is_refused() -> None:
    """After a selection of 2 of 3 rows, a forward of 3 rows was taken: the third row read the
    cached tokens of a row the selection had dropped (head-major) or moved (token-major), with no
    error, where DynamicCache refuses (its concatenation). ``generate`` gave 3 rows of tokens."""
    model = tiny("llama")
    ids = prompts(3, 9)["input_ids"]
    for layout in ("head_major", "token_major"):
        cache = VKVCache(config=model.config, layout=layout)
        reference = DynamicCache(config=model.config)
        assert torch.equal(_fed(model, cache, ids), _fed(model, reference, ids))
        cache.batch_select_indices(torch.tensor([2, 0]))
        reference.batch_select_indices(torch.tensor([2, 0]))
        more = torch.full((3, 1), FIRST_WORD + 5)
        with pytest.raises(RuntimeError):
            _fed(model, reference, more)
        with pytest.raises(LayerMismatchError, match="batch 3 continues a cache of 2 rows: its other 1 rows hold no"):
            _fed(model, cache, more)
        cache.check_invariants()
        assert cache.get_seq_length() == 9
        with pytest.raises(LayerMismatchError, match="batch 3 continues a cache of 2 rows"):
            model.generate(torch.cat([torch.cat([ids[[2, 0]], ids[:1]]), more], dim=1),
                           attention_mask=torch.ones(3, 10, dtype=torch.long), max_new_tokens=2,
                           **{cache_kwarg(): cache})
        reference = DynamicCache(config=model.config)  # the 2 rows continue as DynamicCache's do
        _fed(model, reference, ids[[2, 0]])
        assert torch.equal(_fed(model, cache, more[:2]), _fed(model, reference, more[:2]))


def test_row_operations_a_kept_transformers_layer_lacks_are_refused_before_anything_changes() -> None:
    """LFM2's convolution layers are transformers' ``LinearAttentionLayer``, which has no
    ``batch_select_indices`` or ``batch_repeat_interleave``: vkv's groups changed their rows
    first and transformers' layers then raised an AttributeError, leaving the attention rows and
    the convolution state apart (a continued forward: other logits than DynamicCache's)."""
    from breadth_models import tiny as breadth_tiny

    from hf_vkv import LayerCallError

    model = breadth_tiny("lfm2")
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))
    cache, reference = VKVCache(config=model.config), DynamicCache(config=model.config)
    assert torch.equal(_fed(model, cache, ids), _fed(model, reference, ids))
    for call, argument in (("batch_select_indices", torch.tensor([2, 0])), ("batch_repeat_interleave", 2)):
        with pytest.raises(AttributeError):
            getattr(reference, call)(argument)
        with pytest.raises(LayerCallError, match=f"{call}: .*LinearAttentionLayer.*nothing was changed"):
            getattr(cache, call)(argument)
        assert [g.batch for g in cache.groups] == [3]
        cache.check_invariants()
    more = torch.randint(3, 128, (3, 1), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_fed(model, cache, more), _fed(model, reference, more))


def test_one_layers_row_operations_check_their_arguments_as_the_caches_do() -> None:
    """With ``groups="layer"`` a layer's own ``reorder_cache`` read a bool mask as row numbers and
    truncated floats, and its ``batch_repeat_interleave(-1)`` emptied the layer: the cache-level
    calls (and DynamicLayer) refuse all three."""
    from hf_vkv import ArgumentError, ArgumentTypeError

    model = tiny("llama")
    ids = prompts(3, 9)["input_ids"]
    cache = VKVCache(config=model.config, groups="layer")
    _fed(model, cache, ids)
    keys = [layer.keys.clone() for layer in cache.layers]
    for bad in (torch.tensor([True, False, True]), torch.tensor([0.9, 1.0, 2.0]), [2, 1, 0], torch.tensor([[2, 1, 0]])):
        with pytest.raises(ArgumentTypeError, match="1-d integer tensor"):
            cache.layers[0].reorder_cache(bad)
    with pytest.raises(ArgumentError, match="repeats must be >= 1"):
        cache.layers[0].batch_repeat_interleave(-1)
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, keys))
    cache.check_invariants()


def test_bad_arguments_of_update_write_states_and_selections_are_typed_and_change_nothing() -> None:
    from hf_vkv import ArgumentTypeError

    model = tiny("llama")
    cache = VKVCache(config=model.config)
    k, v = _states()
    for layer_idx in ("0", None, 0.0):
        with pytest.raises(ArgumentTypeError, match=r"update\(layer_idx\) takes an int"):
            cache.update(k, v, layer_idx)
    with pytest.raises(ArgumentTypeError, match="key and value states as tensors"):
        cache.update([[0.0]], [[0.0]], 0)
    with pytest.raises(ArgumentTypeError, match=r"write_states\(start\) takes an int"):
        cache.write_states(0, k, v, start="1")
    assert cache.get_seq_length() == 0
    ids = prompts(3, 9)["input_ids"]
    _fed(model, cache, ids)
    for bad in (1, "ab"):
        with pytest.raises(ArgumentTypeError, match="batch_select_indices takes row numbers"):
            cache.batch_select_indices(bad)
    assert cache.rows == 3
    reference = DynamicCache(config=model.config)
    _fed(model, reference, ids)
    cache.batch_select_indices(slice(0, 2))  # as DynamicCache indexes its batch dimension
    reference.batch_select_indices(slice(0, 2))
    more = torch.full((2, 1), FIRST_WORD + 3)
    assert torch.equal(_fed(model, cache, more), _fed(model, reference, more))
    cache.check_invariants()


def test_a_refused_reset_of_a_closed_cache_changes_nothing() -> None:
    """``reset()`` of a closed cache raised CacheClosedError after zeroing its lengths: the cache
    then said it held no tokens, and a later fork said so instead of that it was closed."""
    model = tiny("llama")
    cache = VKVCache(config=model.config)
    _fed(model, cache, prompts(1, 9)["input_ids"])
    cache.close()
    with pytest.raises(CacheClosedError):
        cache.reset()
    assert cache.get_seq_length() == 9
    with pytest.raises(CacheClosedError):
        cache.fork(3)


def test_a_vkv_cache_wrapped_in_transformers_encoder_decoder_cache_is_checked_before_anything_runs() -> None:
    """``EncoderDecoderCache(VKVCache(...), DynamicCache(...))``, the way to pass a vkv cache to
    an encoder-decoder model by hand, skipped vkv's up-front checks: a cache without room raised
    ``CapacityError`` after 8 steps had run (holding 8 tokens), one made for a 2-layer decoder
    raised mid-forward in a 3-layer one (its layers 0 and 1 holding a token)."""
    import transformers
    from transformers import GenerationConfig
    from transformers.cache_utils import EncoderDecoderCache

    from hf_vkv import ArgumentError

    def bart(layers: int) -> Any:
        config = transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=layers, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                         max_position_embeddings=64, vocab_size=128, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
        torch.manual_seed(0)
        model = transformers.BartForConditionalGeneration(config).eval()
        model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                                   decoder_start_token_id=2)
        return model

    model, deeper = bart(2), bart(3)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = EncoderDecoderCache(VKVCache(config=model.config, max_tokens=8), DynamicCache(config=model.config))
    with pytest.raises(CapacityError, match="room for 8 tokens a row"):
        model.generate(input_ids=ids, max_new_tokens=20, **{cache_kwarg(): cache})
    assert cache.self_attention_cache.get_seq_length() == 0
    cache = EncoderDecoderCache(VKVCache(config=model.config), DynamicCache(config=model.config))
    with pytest.raises(ArgumentError, match="made for a model of 2 layers"):
        deeper.generate(input_ids=ids, max_new_tokens=5, **{cache_kwarg(): cache})
    assert [layer.get_seq_length() for layer in cache.self_attention_cache.layers] == [0, 0]
    cache.self_attention_cache.check_invariants()
    reference = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    got = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, **{cache_kwarg(): cache})
    assert torch.equal(reference, got)  # the cache serves its own model as before
