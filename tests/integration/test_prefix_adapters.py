"""A prefix store and a model with adapters (peft's LoRA through ``get_peft_model``; transformers'
own ``load_adapter`` asks for a newer peft than the package index has) or another attention: a
store serves the weights, adapters and attention that filled it, and steps aside for any other.

Found by trying what a peft user does: a store filled with adapter ``one`` and then reused with
adapter ``two`` active, or with adapters disabled, gave other tokens (SmolLM2 with two random LoRA
adapters on ``q/k/v_proj``: logits up to 30 apart, ``reused_tokens`` 89): switching adapters
changes no parameter, and a merge writes the weights through ``param.data``, which bumps no
version counter. The oracle is DynamicCache on the same model in the same adapter state: the
continued one where the store is reused, a fresh one where it steps aside."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from models import PAD, tiny
from transformers import DynamicCache

from hf_vkv import PrefixMismatchError, PrefixStore, VKVCache, reuse_report
from hf_vkv.generate import cache_kwarg
from hf_vkv.prefix.fingerprint import weights_fingerprint

peft = pytest.importorskip("peft", reason="peft is a test dependency (pyproject's [test] extra)")

pytestmark = pytest.mark.integration

TARGETS = ["q_proj", "k_proj", "v_proj"]


def _lora(seed: int) -> Any:
    torch.manual_seed(seed)  # init_lora_weights=False draws both LoRA matrices: the adapter changes K/V
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)


def _with_adapters() -> Any:
    """A tiny Llama (a copy: the shared one is left as it is) with LoRA adapters ``one`` (active)
    and ``two``."""
    model = peft.get_peft_model(copy.deepcopy(tiny("llama")), _lora(1), adapter_name="one")
    model.add_adapter("two", _lora(2))
    model.set_adapter("one")
    return model.eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _call(model: Any, ids: torch.Tensor, *, store: PrefixStore | None = None, cache: DynamicCache | None = None) -> Any:
    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs.update(cache_implementation="vkv", cache_config={"prefix_store": store})
    if cache is not None:
        kwargs[cache_kwarg()] = cache
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                          pad_token_id=PAD, output_logits=True, return_dict_in_generate=True, **kwargs)


def _assert_identical(ref: Any, got: Any, where: str) -> None:
    assert torch.equal(ref.sequences, got.sequences), f"{where}: tokens differ"
    for step, (a, b) in enumerate(zip(ref.logits, got.logits, strict=True)):
        assert torch.equal(a, b), f"{where}: logits differ at step {step} (max {float((a - b).abs().max()):.3g})"


def _continued(turn: Any, columns: int) -> DynamicCache:
    """The first turn's DynamicCache cut to the ``columns`` tokens the store lends (transformers'
    idiom for reusing a cache by hand)."""
    cache = turn.past_key_values
    cache.crop(columns - cache.get_seq_length())
    return cache


def _steps_aside(model: Any, ids: torch.Tensor, store: PrefixStore, where: str, *, reason: str = "adapters") -> None:
    """The call gets DynamicCache's tokens and logits, a refusal naming ``reason``, and the store
    stays as it was."""
    entries = store.prefixes()
    got = _call(model, ids, store=store)
    _assert_identical(_call(model, ids), got, where)
    report = reuse_report(got)
    assert report.reused_tokens == 0 and reason in report.refusal, (where, report)
    assert store.prefixes() == entries, where  # nothing inserted by a call that stepped aside
    store.check_invariants()


@pytest.mark.threads(1, 2)
def test_a_store_serves_the_adapter_that_filled_it_and_steps_aside_for_any_other() -> None:
    model = _with_adapters()
    store = PrefixStore(model.config)
    history = _ids(40, 0)
    first_ref, first = _call(model, history), _call(model, history, store=store)
    _assert_identical(first_ref, first, "adapter one, turn 1")
    ids = torch.cat([first.sequences[:, :-1], _ids(6, 1)], dim=1)
    lent = store.longest_prefix(ids)
    assert lent == first.sequences.shape[1] - 1

    got = _call(model, ids, store=store)  # the same adapter: reused, exact against the continued cache
    _assert_identical(_call(model, ids, cache=_continued(first_ref, lent)), got, "adapter one, turn 2")
    assert reuse_report(got).reused_tokens == lent and reuse_report(got).refusal is None

    model.set_adapter("two")
    _steps_aside(model, ids, store, "adapter two")
    model.set_adapter("one")
    with model.disable_adapter():
        _steps_aside(model, ids, store, "adapters disabled")
    model.merge_adapter()  # one's weights written into the base layers through param.data
    _steps_aside(model, ids, store, "adapter one merged")
    model.unmerge_adapter()
    for layer in model.modules():  # LoRA's scaling changes what the layer adds, not a parameter
        if isinstance(layer, peft.tuners.lora.LoraLayer):
            layer.scale_layer(0.5)
    _steps_aside(model, ids, store, "adapter one at half scale")


def test_weights_merged_through_param_data_are_seen() -> None:
    """A plain model fills the store; an adapter merged into it (``merge_and_unload``: the same
    parameters, written through ``param.data``, no adapter layer left) gets DynamicCache's tokens
    and a refusal naming other weights, where a remembered fingerprint reused the stale K/V."""
    model = copy.deepcopy(tiny("llama"))
    store = PrefixStore(model.config)
    history = _ids(40, 0)
    _call(model, history, store=store)
    before = list(model.parameters())
    merged = peft.get_peft_model(model, _lora(1)).merge_and_unload()
    after = list(merged.parameters())  # the same parameter objects, their values changed
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True))
    _steps_aside(merged, torch.cat([history, _ids(6, 1)], dim=1), store, "merged", reason="other weights")


def test_a_saved_store_opens_only_for_the_adapter_that_filled_it(tmp_path: Path) -> None:
    """``store.save(folder, model=peft_model)`` fingerprints the transformers model inside the
    wrapper, the one ``generate`` runs, so a store opened with it is reused; opened with another
    adapter active it is refused with a typed error, and the store stays empty and usable."""
    model = _with_adapters()
    assert weights_fingerprint(model) == weights_fingerprint(model.get_base_model())
    store = PrefixStore(model.config)
    history = _ids(40, 0)
    _call(model, history, store=store)
    store.save(tmp_path / "store", model=model)

    opened = PrefixStore(model.config)
    assert opened.load(tmp_path / "store", model=model) > 0
    ids = torch.cat([history, _ids(6, 1)], dim=1)
    got = _call(model, ids, store=opened)
    assert reuse_report(got).reused_tokens > 0 and reuse_report(got).refusal is None

    model.set_adapter("two")
    other = PrefixStore(model.config)
    with pytest.raises(PrefixMismatchError, match="adapters") as err:
        other.load(tmp_path / "store", model=model)
    assert err.value.field == "weights" and len(other) == 0
    got = _call(model, ids, store=other)  # empty and usable: it fills with two's K/V
    _assert_identical(_call(model, ids), got, "adapter two, after the refused open")
    other.check_invariants()


@pytest.mark.threads(1, 2)
def test_a_store_filled_under_sdpa_steps_aside_for_eager_attention() -> None:
    """Eager attention's outputs differ from sdpa's in their last bits, and every layer's K/V
    after the first are computed from them: a store filled under sdpa steps aside for the same
    model switched to eager (it reused sdpa's K/V: logits 1.9e-6 from eager's continued cache), and
    serves it again once switched back. ``vkv_paged`` (sdpa on copied blocks) is sdpa's class."""
    model = copy.deepcopy(tiny("llama"))
    store = PrefixStore(model.config)
    history = _ids(40, 0)
    first = _call(model, history, store=store)
    ids = torch.cat([first.sequences[:, :-1], _ids(6, 1)], dim=1)
    model.set_attn_implementation("eager")
    _steps_aside(model, ids, store, "eager", reason="attention")
    model.set_attn_implementation("sdpa")
    lent = store.longest_prefix(ids)
    again = _call(model, ids, store=store)
    _assert_identical(_call(model, ids, cache=_continued(_call(model, history), lent)), again, "sdpa again")
    assert reuse_report(again).refusal is None and reuse_report(again).reused_tokens == lent > 0
    store.check_invariants()


def test_adapters_chosen_per_row_step_aside() -> None:
    """peft's ``adapter_names`` runs each row with an adapter of its own (forward pre-hooks on
    the adapter layers for the call): a store filled with adapter ``one`` steps aside for such a
    call, whose rows get DynamicCache's tokens, and nothing is stored from it."""
    model = _with_adapters()
    store = PrefixStore(model.config)
    history = _ids(40, 0)
    _call(model, history, store=store)
    ids = torch.cat([history, _ids(6, 1)], dim=1).repeat(2, 1)
    entries = store.prefixes()

    def rows(**extra: Any) -> Any:
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                              pad_token_id=PAD, output_logits=True, return_dict_in_generate=True,
                              adapter_names=["two", "one"], **extra)

    got = rows(cache_implementation="vkv", cache_config={"prefix_store": store})
    _assert_identical(rows(), got, "adapter_names")
    report = reuse_report(got)
    assert report.reused_tokens == 0 and "adapter_names" in report.refusal, report
    assert store.prefixes() == entries
    store.check_invariants()


@pytest.mark.parametrize("method", ["prefix", "prompt"])
def test_prompt_learning_steps_aside(method: str) -> None:
    """peft's prefix and prompt tuning prepare the base model's inputs themselves (virtual
    tokens' K/V, prompt embeddings) that token ids do not identify: a store steps aside, the
    tokens are DynamicCache's, nothing is stored. It used to reuse K/V without the virtual tokens
    (prefix tuning: other logits) and to fail at the end of a call (prompt tuning: ``IndexError``)."""
    torch.manual_seed(0)
    kind = peft.TaskType.CAUSAL_LM
    config = (peft.PrefixTuningConfig(task_type=kind, num_virtual_tokens=5) if method == "prefix"
              else peft.PromptTuningConfig(task_type=kind, num_virtual_tokens=5))
    model = peft.get_peft_model(copy.deepcopy(tiny("llama")), config).eval()
    store = PrefixStore(model.config)
    history = _ids(20, 0)
    for turn in range(2):
        got = _call(model, history, store=store)
        _assert_identical(_call(model, history), got, f"{method} tuning, turn {turn + 1}")
        report = reuse_report(got)
        if report is None:  # before transformers 5.24, peft swaps generate's cache for its own holding the prefix
            assert method == "prefix" and not isinstance(got[cache_kwarg()], VKVCache)
        else:
            assert report.reused_tokens == 0 and "prompt learning" in report.refusal, report
        assert len(store) == 0
        history = torch.cat([got.sequences[:, :-1], _ids(4, turn + 1)], dim=1)
    store.check_invariants()


def test_a_users_forward_hook_is_part_of_what_a_store_serves() -> None:
    """A steering hook (a vector added to a layer's output) changes every K/V after it: a store
    filled without it steps aside for the hooked model, one filled with it serves the hooked model
    exactly (against its own continued cache), and transformers' own hooks (capturing hidden
    states) do not count. It reused the unhooked K/V (other logits)."""
    model = copy.deepcopy(tiny("llama"))
    store = PrefixStore(model.config)
    history = _ids(40, 0)
    plain = _call(model, history, store=store)
    ids = torch.cat([plain.sequences[:, :-1], _ids(6, 1)], dim=1)
    shift = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    handle = model.model.layers[0].register_forward_hook(lambda module, args, out: out + shift)
    _steps_aside(model, ids, store, "a steering hook", reason="hooks")

    hooked = PrefixStore(model.config)
    first_ref, first = _call(model, history), _call(model, history, store=hooked)
    _assert_identical(first_ref, first, "hooked, turn 1")
    model.generate(input_ids=ids, max_new_tokens=1, pad_token_id=PAD, output_hidden_states=True,
                   return_dict_in_generate=True)  # transformers installs its capturing hooks
    lent = hooked.longest_prefix(ids)
    got = _call(model, ids, store=hooked)
    _assert_identical(_call(model, ids, cache=_continued(first_ref, lent)), got, "hooked, turn 2")
    assert reuse_report(got).reused_tokens == lent > 0
    handle.remove()
    _steps_aside(model, ids, hooked, "the hook removed", reason="hooks")
