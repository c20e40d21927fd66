"""The ``"vkv_paged"`` attention's refusals: by model class and config, and per call."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import hf_vkv
from hf_vkv.attention import UnsupportedModelError, attention_refusal, register_attention
from hf_vkv.attention.guards import check_call
from hf_vkv.generate.names import cache_kwarg

_TINY = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)


class _Attention(torch.nn.Module):
    """An attention module without a config (the error falls back to its class name)."""


def _kv(tokens: int) -> torch.Tensor:
    return torch.zeros(1, 1, tokens, 16)


def test_error_is_typed_and_says_what_to_do() -> None:
    error = UnsupportedModelError(model_type="m", feature="f")
    assert isinstance(error, hf_vkv.VKVError) and isinstance(error, ValueError)
    assert "model type 'm': f" in str(error) and "cache_implementation='vkv'" in str(error)


def test_llama_is_served() -> None:
    assert attention_refusal(LlamaForCausalLM, LlamaConfig(**_TINY)) is None


def test_softcapping_is_refused_and_without_it_sdpa_support_still_decides() -> None:
    capped = attention_refusal(Gemma2ForCausalLM, Gemma2Config(**_TINY, head_dim=16))
    assert capped is not None and "softcapping (attn_logit_softcapping=50.0)" in str(capped)
    uncapped = attention_refusal(Gemma2ForCausalLM, Gemma2Config(**_TINY, head_dim=16, attn_logit_softcapping=None))
    if Gemma2ForCausalLM._supports_sdpa:  # transformers 5.17 declares it
        assert uncapped is None
    else:  # 5.23: "sdpa does not support softcapping", whatever the config says
        assert uncapped is not None and "_supports_sdpa = False" in str(uncapped)


@pytest.mark.parametrize(("kwargs", "phrase"), [
    ({"s_aux": torch.zeros(2)}, "attention sinks (s_aux)"),
    ({"softcap": 30.0}, "softcapping (softcap=30.0)"),
    ({"position_bias": torch.zeros(1, 2, 1, 1)}, "position bias covers 1 keys but the cache holds 5"),
])
def test_call_needing_more_than_sdpa_is_refused(kwargs: dict, phrase: str) -> None:
    with pytest.raises(UnsupportedModelError, match=phrase.replace("(", r"\(").replace(")", r"\)")) as raised:
        check_call(_Attention(), _kv(1), None, 5, kwargs)
    assert raised.value.model_type == "_Attention"


def test_tagged_keys_with_a_mask_of_another_length_are_refused() -> None:
    """The paged kernel reads the tag's tokens: a mask over fewer (or more) keys is not what it reads."""
    with pytest.raises(UnsupportedModelError, match="its mask covers 1 keys but the attention got 9"):
        check_call(_Attention(), _kv(1), torch.ones(1, 1, 1, 1, dtype=torch.bool), 9, {})


def test_keys_that_lost_their_paged_tag_are_refused() -> None:
    """A mask over 5 keys with 1 untagged key: the model replaced the tagged key after the update."""
    with pytest.raises(UnsupportedModelError, match="the paged cache's record of what to read was lost"):
        check_call(_Attention(), _kv(1), torch.ones(1, 1, 1, 5, dtype=torch.bool), None, {})


def test_values_other_than_the_update_returned_are_refused() -> None:
    """A tagged key with a value the model made after the update (DiffLlama splits the values):
    the paged attention would read the stored values instead."""
    with pytest.raises(UnsupportedModelError, match="other values than the cache update returned"):
        check_call(_Attention(), _kv(1), torch.ones(1, 1, 1, 5, dtype=torch.bool), 5, {}, values_replaced=True)


def test_keys_other_than_the_update_returned_are_refused_without_a_mask() -> None:
    """An untagged key beside a tagged value: the model replaced the key after the update; with no
    mask (a decode step without padding) the lengths alone could not tell."""
    with pytest.raises(UnsupportedModelError, match="other keys than the cache update returned"):
        check_call(_Attention(), _kv(1), None, None, {}, keys_replaced=True)


def test_ordinary_calls_pass() -> None:
    check_call(_Attention(), _kv(5), torch.ones(1, 1, 1, 5, dtype=torch.bool), None, {})
    # plain keys with a mask sdpa broadcasts, as with DynamicCache's (transformers 5.20's RecurrentGemma)
    check_call(_Attention(), _kv(9), torch.ones(1, 1, 1, 1, dtype=torch.bool), None, {})
    check_call(_Attention(), _kv(1), torch.ones(1, 1, 1, 5, dtype=torch.bool), 5,
               {"position_bias": torch.zeros(1, 2, 1, 5), "s_aux": None, "softcap": None})


def test_registration_is_idempotent() -> None:
    register_attention()
    hooks = (PreTrainedModel.get_correct_attn_implementation, PreTrainedModel.set_attn_implementation)
    register_attention()
    assert (PreTrainedModel.get_correct_attn_implementation, PreTrainedModel.set_attn_implementation) == hooks


def test_attention_assigned_directly_is_refused_at_the_first_forward() -> None:
    """Past the construction checks (the config's attention set by hand), the call checks still hold."""
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**_TINY, head_dim=16)).eval()
    model.config._attn_implementation_internal = "vkv_paged"
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        model(input_ids=torch.tensor([[3, 4, 5]]))


def _diffllama() -> torch.nn.Module:
    import transformers

    if not hasattr(transformers, "DiffLlamaForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DiffLlama")
    torch.manual_seed(0)
    return transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**{**_TINY, "num_key_value_heads": 2})).eval()


def _paged(model: torch.nn.Module, **options: object) -> object:
    """Greedy generate under "vkv_paged" with the paged layout (scores kept)."""
    model.config._attn_implementation_internal = "vkv_paged"
    try:
        return model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, cache_implementation="vkv",
                              cache_config={"layout": "paged", "block_tokens": 4, **options}, pad_token_id=0,
                              return_dict_in_generate=True, output_scores=True)
    finally:
        model.config._attn_implementation_internal = "sdpa"


def _sdpa(model: torch.nn.Module) -> object:
    """The reference: the same generate on DynamicCache with transformers' sdpa attention."""
    model.config._attn_implementation_internal = "sdpa"
    return model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True)


def _same(got: object, ref: object) -> None:
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, ref.scores, strict=True))


def test_values_reworked_after_the_update_compute_as_on_dynamic_cache() -> None:
    """DiffLlama splits the values the cache update returned: the paged layout returns the layer's
    gathered tokens (what DynamicCache returns), so its tokens and logits are DynamicCache's + sdpa's;
    construction refuses nothing."""
    model = _diffllama()
    assert attention_refusal(type(model), model.config) is None
    _same(_paged(model), _sdpa(model))


def test_values_replaced_after_the_update_are_refused_by_the_fused_kernel_at_the_first_forward() -> None:
    """The fused kernel reads the blocks in place: its layer tags the new values it returns, and a
    call with other values (DiffLlama's split halves) is refused before any token, never computed
    over the stored values (which gave other tokens than DynamicCache before the tag)."""
    model = _diffllama()
    with pytest.raises(UnsupportedModelError, match="other values than the cache update returned"):
        _paged(model, paged_kernel="fused")


def _replacing_keys_and_values(monkeypatch: pytest.MonkeyPatch, *, values: bool) -> None:
    """Every attention call of a Llama gets a new key tensor (``k * 1.0``) after the cache update,
    and a new value tensor too with ``values``."""
    from transformers.models.llama import modeling_llama

    interfaces = modeling_llama.ALL_ATTENTION_FUNCTIONS
    plain = interfaces.get_interface

    def replacing(implementation: str, default: object) -> object:
        function = plain(implementation, default)
        return lambda module, q, k, v, mask, **kw: function(module, q, k * 1.0, v * 1.0 if values else v, mask, **kw)

    monkeypatch.setattr(interfaces, "get_interface", replacing)


def test_keys_replaced_after_the_update_are_refused_by_the_fused_kernel_at_decode_without_a_mask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt without padding: no mask tells the lengths apart, and before the value was
    tagged the fused path's decode steps attended to the new key alone and generated other tokens."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY)).eval()
    _replacing_keys_and_values(monkeypatch, values=False)
    with pytest.raises(UnsupportedModelError, match="other keys than the cache update returned"):
        _paged(model, paged_kernel="fused")


@pytest.mark.parametrize("values", [False, True])
def test_keys_and_values_replaced_after_the_update_compute_as_on_dynamic_cache(
        monkeypatch: pytest.MonkeyPatch, values: bool) -> None:
    """By default the attention gets the layer's gathered tokens: a model that replaces the key, or
    the key and the value (which leaves no tag to tell by, and with no mask at decode attended to
    the new token alone when the layer returned only the new states), computes on all of them."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY)).eval()
    _replacing_keys_and_values(monkeypatch, values=values)
    _same(_paged(model), _sdpa(model))


def _forwards(model: torch.nn.Module) -> list[str]:
    """``"start"`` / ``"end"`` for each forward of ``model`` from now on."""
    seen: list[str] = []
    model.register_forward_pre_hook(lambda *_: seen.append("start"))
    model.register_forward_hook(lambda *_: seen.append("end"))
    return seen


def test_keys_and_values_replaced_after_the_update_are_refused_by_the_fused_kernel_in_the_first_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both replaced leaves no tag to refuse the attention call by, and before the receipt the
    decode steps attended to the new token alone and generated other tokens than DynamicCache's.
    The second layer's update finds the first layer's record unread: refused inside the first
    forward, before any logits."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**_TINY, "num_hidden_layers": 2})).eval()
    _replacing_keys_and_values(monkeypatch, values=True)
    seen = _forwards(model)
    with pytest.raises(hf_vkv.CacheOptionError, match="other keys and values than the cache update returned"):
        _paged(model, paged_kernel="fused")
    assert seen == ["start"]


def test_a_one_layer_model_that_replaces_both_is_refused_before_generate_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer: no later update in the forward checks its record, so ``generate`` checks when its
    loop returns (one new token: the prefill's forward is the only one)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY)).eval()
    _replacing_keys_and_values(monkeypatch, values=True)
    model.config._attn_implementation_internal = "vkv_paged"
    try:
        with pytest.raises(hf_vkv.CacheOptionError, match="other keys and values than the cache update returned"):
            model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=1, do_sample=False, cache_implementation="vkv",
                           cache_config={"layout": "paged", "block_tokens": 4, "paged_kernel": "fused"}, pad_token_id=0)
    finally:
        model.config._attn_implementation_internal = "sdpa"


@torch.no_grad()  # (with gradients the fused layer returns every token, for the gradient path's torch.cat)
def test_a_refused_forward_changes_nothing_and_the_cache_continues_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache passed by hand: the forward whose update finds the last record unread is refused
    before it writes, and once the model attends to what the update returns the cache continues as
    a DynamicCache holding the same tokens does."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY)).eval()
    prompt, step = torch.tensor([[3, 4, 5]]), torch.tensor([[6]])
    dynamic = DynamicCache(config=model.config)
    model(input_ids=prompt, **{cache_kwarg(): dynamic})
    want = model(input_ids=step, **{cache_kwarg(): dynamic}).logits
    model.config._attn_implementation_internal = "vkv_paged"
    try:
        cache = hf_vkv.VKVCache(model.config, layout="paged", block_tokens=4, paged_kernel="fused")
        with monkeypatch.context() as patched:
            _replacing_keys_and_values(patched, values=True)
            model(input_ids=prompt, **{cache_kwarg(): cache})  # the prefill's new states are all its tokens
            with pytest.raises(hf_vkv.CacheOptionError, match="other keys and values"):
                model(input_ids=step, **{cache_kwarg(): cache})
        assert cache.get_seq_length() == 3
        cache.check_invariants()
        got = model(input_ids=step, **{cache_kwarg(): cache}).logits
    finally:
        model.config._attn_implementation_internal = "sdpa"
    assert torch.equal(got, want)


def test_the_fused_kernel_refuses_attention_that_expands_cached_latents() -> None:
    """Multi-head latent attention expands the latents the cache holds into keys and values after
    the update: both replaced, nothing left to tell by, so the fused kernel is refused when the
    cache is made (the default paged layout serves it: tests/integration/test_breadth.py)."""
    import transformers

    config = transformers.DeepseekV3Config(hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                           vocab_size=64, max_position_embeddings=32, q_lora_rank=None,
                                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                           n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with pytest.raises(hf_vkv.CacheOptionError, match="expands the latents"):
        _paged(model, paged_kernel="fused")
