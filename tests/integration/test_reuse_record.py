"""One call, one record: prefix reuse decides on the call's own record, never gives a wrong token,
never leaks.

Each case a new user hit: a store reused by a model with the same config and other weights,
explicit ``position_ids``, an interrupted call, an out-of-memory error during beams, a call's own
``page_bytes`` / ``budget_bytes`` beside a store, assisted decoding with a store, and two threads
reading their own call's report. The oracle is DynamicCache on the same model and inputs."""

from __future__ import annotations

import ast
import copy
import gc
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from models import PAD, assert_same_tokens, assistant, tiny
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_vkv
from hf_vkv import CacheOptionError, KVCacheOutOfMemory, PrefixStore, VKVCache, reuse_report
from hf_vkv.generate import cache_kwarg
from hf_vkv.prefix.fingerprint import _BLOCKS, _sample_index

pytestmark = pytest.mark.integration

PACKAGE = Path(__file__).resolve().parents[2] / "hf_vkv"


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


def _call(model: Any, ids: torch.Tensor, store: PrefixStore | None, **kwargs: Any) -> Any:
    extra = {"cache_implementation": "vkv", "cache_config": {"prefix_store": store}} if store is not None else {}
    kwargs.setdefault("max_new_tokens", 6)
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=PAD, return_dict_in_generate=True,
                          **kwargs, **extra)


def _stepped_aside(model: Any, ids: torch.Tensor, store: PrefixStore) -> Any:
    """A call with ``store`` whose tokens and logits are DynamicCache's without it; its report."""
    got = _call(model, ids, store, output_logits=True)
    ref = _call(model, ids, None, output_logits=True)
    assert_same_tokens(ref.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits, strict=True))
    return reuse_report(got)


def _in_use(store: PrefixStore) -> int:
    """Pages referenced in the store's memory (its entries' and live calls')."""
    memory = store.memory("cpu")
    return sum(a.pool.stats().in_use for a in memory._arena_for.arenas.values() if not a.closed)


def _live_caches() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, VKVCache))


@pytest.mark.threads(1, 2)
def test_a_model_with_other_weights_steps_aside() -> None:
    """A base model fills the store; a fine-tune (same config, other weights) gets its own
    DynamicCache's tokens, the store stays as it was, and the base model still reuses it."""
    base, tuned = tiny("llama", seed=0), tiny("llama", seed=5)
    assert base.config.to_dict() == tuned.config.to_dict()
    store = PrefixStore(base.config)
    history = _ids(40)
    _call(base, history, store)
    entries = store.prefixes()
    ids = torch.cat([history, _ids(5, 1)], dim=1)
    got = _call(tuned, ids, store)
    assert_same_tokens(_call(tuned, ids, None).sequences, got.sequences)
    report = reuse_report(got)
    assert report is not None and "other weights" in report.refusal and report.reused_tokens == 0
    assert store.prefixes() == entries
    again = _call(base, ids, store)
    assert_same_tokens(_call(base, ids, None).sequences, again.sequences)
    assert reuse_report(again).reused_tokens > 0
    store.check_invariants()


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("edit", ["unsampled value", "embedding row", "load_state_dict"])
def test_a_parameter_written_in_place_where_the_fingerprint_does_not_sample_steps_aside(edit: str) -> None:
    """A parameter written in place between the values the weights fingerprint samples (one
    weight of an MLP, one token's embedding row, a ``load_state_dict`` of other weights with
    the sampled values kept): the store steps aside, where it served K/V of the old weights
    (SmolLM2: logits 0.11 and 0.87 off a full prefill). Logits are the changed model's own;
    after ``store.clear()`` the store serves these weights again."""
    model = copy.deepcopy(tiny("llama", seed=0))  # tiny's models are shared: this one is changed
    store = PrefixStore(model.config)
    history = _ids(40)
    _call(model, history, store)
    ids = torch.cat([history, _ids(5, 1)], dim=1)
    def unsampled(weight: torch.Tensor, row: int = 0) -> tuple[int, int]:
        """A place in ``weight``'s row ``row`` that the fingerprint does not sample."""
        sampled = set(_sample_index(weight.numel(), _BLOCKS).tolist())
        column = next(c for c in range(weight.shape[1]) if row * weight.shape[1] + c not in sampled)
        return row, column

    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        if edit == "unsampled value":
            weight[unsampled(weight)] += 5
        elif edit == "embedding row":
            table = model.model.embed_tokens.weight
            table[unsampled(table, int(history[0, 3]))] += 0.5
        else:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["model.layers.0.mlp.up_proj.weight"][unsampled(weight)] += 5
            model.load_state_dict(state)
    assert store.fingerprint(model) == store.weights_fingerprint  # the samples do not see it
    report = _stepped_aside(model, ids, store)
    assert report.reused_tokens == 0 and "written in place" in report.refusal and "store.clear()" in report.refusal
    store.clear()
    _call(model, history, store)
    again = _call(model, ids, store, output_logits=True)
    assert reuse_report(again).reused_tokens == 40
    assert_same_tokens(_call(model, ids, None).sequences, again.sequences)
    store.check_invariants()


@pytest.mark.parametrize("where", ["the model", "one layer"])
def test_a_model_in_training_mode_neither_fills_nor_reads_the_store(where: str) -> None:
    """A call in training mode (an RL rollout that forgot ``model.eval()``) stored K/V computed
    with dropout, and the next call in eval mode reused them (logits 14.6 off its DynamicCache);
    a shared document was prefilled once for rows whose dropout differs. Now the store steps
    aside in training mode, saying so, and takes nothing in; back in eval mode it serves again."""
    model = copy.deepcopy(tiny("llama"))  # tiny's models are shared: this one is changed
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    store = PrefixStore(model.config)
    history = _ids(40)
    (model if where == "the model" else model.model.layers[1]).train()
    torch.manual_seed(0)
    got = _call(model, history, store)
    report = reuse_report(got)
    assert report.refusal is not None and "training mode" in report.refusal and report.inserted == 0
    assert store.stats().entries == 0
    model.eval()
    ids = torch.cat([history, _ids(5, 1)], dim=1)
    first = _call(model, ids, store, output_logits=True)
    ref = _call(model, ids, None, output_logits=True)
    assert reuse_report(first).refusal is None and reuse_report(first).reused_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, first.logits, strict=True))
    again = _call(model, torch.cat([ids, _ids(3, 2)], dim=1), store)
    assert reuse_report(again).reused_tokens > 0
    store.check_invariants()


def test_a_buffer_rewritten_in_place_steps_aside() -> None:
    """The rotary embedding's ``inv_freq`` (a buffer, not a parameter) rewritten in place changes
    every key: the store steps aside and the tokens are a DynamicCache's of the changed model (it
    reused K/V of the old frequencies: logits 0.045 apart)."""
    model = copy.deepcopy(tiny("llama", seed=0))  # tiny's models are shared: this one is changed
    store = PrefixStore(model.config)
    history = _ids(40)
    _call(model, history, store)
    ids = torch.cat([history, _ids(5, 1)], dim=1)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.5)
    report = _stepped_aside(model, ids, store)
    assert report.reused_tokens == 0 and "other weights" in report.refusal and "buffers" in report.refusal
    store.check_invariants()


def test_a_pruning_mask_replaced_where_the_fingerprint_does_not_sample_steps_aside() -> None:
    """A second round of ``torch.nn.utils.prune`` replaces a layer's ``weight_mask`` buffer by a
    new tensor that differs from the old one in a few values (none the fingerprint samples): the
    store steps aside (it reused K/V of the old mask: SmolLM2, logits 0.011 apart) and the tokens
    are a DynamicCache's of the re-pruned model."""
    from torch.nn.utils import prune

    model = copy.deepcopy(tiny("llama", seed=0))
    for layer in model.model.layers:
        prune.l1_unstructured(layer.self_attn.v_proj, "weight", amount=0.2)
    store = PrefixStore(model.config)
    history = _ids(40)
    _call(model, history, store)
    mask = model.model.layers[0].self_attn.v_proj.weight_mask
    prune.l1_unstructured(model.model.layers[0].self_attn.v_proj, "weight", amount=3)  # 3 more weights cut
    again = model.model.layers[0].self_attn.v_proj.weight_mask
    sampled = torch.from_numpy(_sample_index(mask.numel(), _BLOCKS))
    assert again is not mask and torch.equal(again.reshape(-1)[sampled], mask.reshape(-1)[sampled])
    report = _stepped_aside(model, torch.cat([history, _ids(5, 1)], dim=1), store)
    assert report.reused_tokens == 0 and "replaced" in report.refusal
    store.check_invariants()


def test_a_quantized_model_whose_weights_are_packed_steps_aside() -> None:
    """torch.ao's dynamic quantization packs the Linear layers' weights outside the parameters
    and buffers: two quantized models with other attention weights fingerprinted alike, and the
    second reused the first's K/V (SmolLM2: other tokens, logits 23.6 apart). The store steps
    aside for such a model (nothing goes in), naming a quantized layer; ``store.save(model=)``
    and ``load(model=)`` refuse it."""
    model = copy.deepcopy(tiny("llama", seed=0))
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8).eval()
    store = PrefixStore(quantized.config)
    history = _ids(40)
    for ids in (history, torch.cat([history, _ids(5, 1)], dim=1)):
        report = _stepped_aside(quantized, ids, store)
        assert report.reused_tokens == 0 and "packed" in report.refusal and "self_attn" in report.refusal
    assert len(store) == 0
    with pytest.raises(hf_vkv.PrefixMismatchError, match="cannot be fingerprinted") as err:
        store.save(Path(tempfile.mkdtemp()) / "q", model=quantized)
    assert err.value.field == "weights"


def test_a_model_cast_to_another_dtype_steps_aside_naming_the_dtype() -> None:
    """The same model cast to bfloat16 (its weights fingerprint differs too) gets its own
    DynamicCache's tokens, and the report names the dtypes, not other weights."""
    model = copy.deepcopy(tiny("llama", seed=0))  # tiny's models are shared: this one is cast
    store = PrefixStore(model.config)
    history = _ids(40)
    _call(model, history, store)
    assert store.dtype == torch.float32
    entries = store.prefixes()
    model = model.to(torch.bfloat16)
    ids = torch.cat([history, _ids(5, 1)], dim=1)
    got = _call(model, ids, store)
    assert_same_tokens(_call(model, ids, None).sequences, got.sequences)
    report = reuse_report(got)
    assert report.reused_tokens == 0 and "other weights" not in report.refusal
    assert "torch.float32 K/V and the model computes in torch.bfloat16" in report.refusal, report.refusal
    assert store.prefixes() == entries
    store.check_invariants()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_explicit_position_ids_are_honoured(arch: str) -> None:
    """Positions shifted by 40 make reuse step aside (the tokens are DynamicCache's with those
    positions); the positions transformers would use anyway keep reuse on."""
    model = tiny(arch)
    store = PrefixStore(model.config)
    history = _ids(30)
    _call(model, history, store)
    ids = torch.cat([history, _ids(4, 2)], dim=1)
    shifted = torch.arange(ids.shape[1])[None] + 40
    got = _call(model, ids, store, position_ids=shifted)
    assert_same_tokens(_call(model, ids, None, position_ids=shifted).sequences, got.sequences)
    assert "position_ids" in reuse_report(got).refusal
    plain = torch.arange(ids.shape[1])[None]
    got = _call(model, ids, store, position_ids=plain)
    assert_same_tokens(_call(model, ids, None, position_ids=plain).sequences, got.sequences)
    report = reuse_report(got)
    assert report.refusal is None and report.reused_tokens > 0


def _continued_reference(model: Any, doc: torch.Tensor, ids: torch.Tensor, rows: int, seed: int, **kwargs: Any) -> Any:
    """The documented reference of a reusing call: a DynamicCache that holds ``doc`` (computed
    alone, as the store computed it), one copy per row, continued over the rest of ``ids``."""
    held = model.generate(doc, attention_mask=torch.ones_like(doc), max_new_tokens=1, do_sample=False,
                          pad_token_id=PAD, return_dict_in_generate=True).past_key_values
    held.batch_repeat_interleave(rows)
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=PAD, return_dict_in_generate=True,
                          output_logits=True, **{cache_kwarg(): held}, **kwargs)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", [{"do_sample": True, "num_return_sequences": 2}, {"num_beams": 2, "do_sample": False}])
def test_rows_prefilled_one_by_one_keep_the_reused_prefix(mode: dict[str, Any], threads: int) -> None:
    """Where prefill once cannot compute the rows' new tokens once (a forward's call is not exact on
    one row per prompt: forced here in the second layer, after the first wrote its tokens), the
    new tokens run on every row over the stored prefix, which the rows keep: logits equal to the
    continued DynamicCache's, and the report's computed tokens are the new ones. The rows once went
    back to nothing and recomputed the whole prompt while the report said it was reused."""
    from hf_vkv.generate.row_exactness import InexactRows

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = tiny("llama")
    try:
        store = PrefixStore(model.config)
        doc = _ids(40)
        _call(model, doc, store, max_new_tokens=1)
        ids = torch.cat([doc, _ids(3, 1)], dim=1)

        layer = model.model.layers[1]
        forward = layer.forward

        def refuse(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if hidden_states.shape[0] == 1:  # the prefill on one row per prompt
                raise InexactRows("forced: a call is not exact on one row per prompt")
            return forward(hidden_states, *args, **kwargs)

        # the layer's forward replaced, not hooked: a store steps aside for a model with a user's hook
        layer.forward = refuse
        try:
            torch.manual_seed(0)
            got = _call(model, ids, store, max_new_tokens=3, output_logits=True, **mode)
        finally:
            del layer.forward
        expected = _continued_reference(model, doc, ids, 2, 0, max_new_tokens=3, **mode)
        assert_same_tokens(expected.sequences, got.sequences)
        assert all(torch.equal(a, b) for a, b in zip(expected.logits, got.logits))
        report = reuse_report(got)
        assert report.refusal is None and report.reused_tokens == 2 * 40 and report.computed_tokens == 2 * 3, report
        verdict = got.past_key_values.stats().prefill_once  # at 2 threads a linear layer may refuse first
        assert "forced" in verdict or (threads == 2 and "differently from each other" in verdict), verdict
        store.check_invariants()
    finally:
        torch.set_num_threads(before)


class _Interrupt(StoppingCriteria):
    def __init__(self, at: int, error: type[BaseException]) -> None:
        self.at, self.error, self.calls = at, error, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise self.error("interrupted")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_call_holds_nothing(error: type[BaseException]) -> None:
    """Nine calls interrupted mid-decoding: no cache of theirs stays alive, the store's memory
    holds only its entries' pages (also after ``clear``), and the next call is served."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    _call(model, _ids(30), store)
    held, caches = _in_use(store), _live_caches()
    for k in range(9):
        try:
            _call(model, torch.cat([_ids(30), _ids(3 + k, k)], dim=1), store,
                  stopping_criteria=StoppingCriteriaList([_Interrupt(2, error)]))
        except error:
            pass
        else:
            raise AssertionError("the call was not interrupted")
    assert _live_caches() == caches
    assert _in_use(store) == held
    store.clear()
    assert _in_use(store) == 0
    ids = torch.cat([_ids(30), _ids(4, 3)], dim=1)
    assert_same_tokens(_call(model, ids, None).sequences, _call(model, ids, store).sequences)
    store.check_invariants()


@pytest.mark.parametrize("where", ["prefill", "decoding"])
def test_an_interrupted_call_gives_back_the_entry_it_continued(where: str) -> None:
    """A prompt that continues a stored entry takes the entry over (its rows move into the call's
    cache, nothing mapped). Interrupted in the prefill's forward after the first layer wrote (the
    layers hold different counts) or while decoding, the call gives the entry back as it was:
    the same prefixes, the same pages in use, no cache left alive; the next call takes it over
    and equals the DynamicCache that holds the same history, continued, logits included."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    first, ref_first = _call(model, _ids(30), store), _call(model, _ids(30), None)
    ids = torch.cat([first.sequences, _ids(5, 7)], dim=1)
    first.past_key_values.close()  # the entry alone holds its pages (a write into them copies none)
    del first
    entries, held, caches = store.prefixes(), _in_use(store), _live_caches()
    assert [len(e) for e in entries] == [35] and store.longest_prefix(ids) == 35
    failing = {"on": False}

    def fail(module: Any, args: Any, output: Any) -> None:
        if failing["on"] and args[0].shape[1] > 1:
            raise RuntimeError("interrupted")

    hook = model.model.layers[-1].register_forward_hook(fail)
    try:
        for k in range(3):
            failing["on"] = where == "prefill"
            stop = [] if where == "prefill" else [_Interrupt(2 + k, RuntimeError)]
            with pytest.raises(RuntimeError, match="interrupted"):
                _call(model, ids, store, stopping_criteria=StoppingCriteriaList(stop))
            assert store.prefixes() == entries and _in_use(store) == held and _live_caches() == caches
            store.check_invariants()
    finally:
        failing["on"] = False
        hook.remove()
    got = _call(model, ids, store, output_logits=True)
    ref = _call(model, ids, None, output_logits=True, **{cache_kwarg(): ref_first.past_key_values})
    assert_same_tokens(ref.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits, strict=True))
    report = reuse_report(got)
    assert report.refusal is None and report.reused_tokens == 35 and report.start_column == 35
    store.check_invariants()


@pytest.mark.threads(1, 2)
def test_a_prompt_a_few_tokens_short_of_an_entry_takes_it_over_cut_back() -> None:
    """A chat server encodes the generated answer again, and its last tokens can differ: a prompt
    that shares all but the entry's last 2 tokens takes the entry over, cut back to the shared 33
    (nothing mapped), and equals the DynamicCache holding those 33 tokens, continued."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    first, ref_first = _call(model, _ids(30), store), _call(model, _ids(30), None)
    first.past_key_values.close()
    del first
    assert [len(e) for e in store.prefixes()] == [35]
    ids = torch.cat([ref_first.sequences[:, :33], _ids(5, 8)], dim=1)
    got = _call(model, ids, store, output_logits=True)
    held = ref_first.past_key_values
    held.crop(33 - held.get_seq_length())  # the 33 tokens the prompt shares
    ref = _call(model, ids, None, output_logits=True, **{cache_kwarg(): held})
    assert_same_tokens(ref.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits, strict=True))
    report = reuse_report(got)
    assert report.refusal is None and report.reused_tokens == 33 and report.copied_rows == 0
    assert [len(e) for e in store.prefixes()] == [43]  # the entry went, cut; the longer row came in
    store.check_invariants()


def test_out_of_memory_during_beams_leaves_the_store_usable() -> None:
    """Beams that outgrow the store's memory budget raise :class:`KVCacheOutOfMemory`; their
    pages go back at once and the next (smaller) call runs and reuses."""
    model = tiny("llama")
    store = PrefixStore(model.config, cache_config={"budget_bytes": 384 * 1024})
    history = _ids(30)
    _call(model, history, store)
    held = _in_use(store)
    with pytest.raises(KVCacheOutOfMemory):
        _call(model, torch.cat([history, _ids(8, 4)], dim=1), store, num_beams=8, max_new_tokens=200,
              min_new_tokens=200)
    assert _in_use(store) == held
    ids = torch.cat([history, _ids(4, 5)], dim=1)
    got = _call(model, ids, store)
    assert_same_tokens(_call(model, ids, None).sequences, got.sequences)
    assert reuse_report(got).reused_tokens > 0
    store.check_invariants()


def _padded(*rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (each ``[1, n]``) left-padded to one batch, and its attention mask."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1]:], mask[i, width - r.shape[1]:] = r[0], 1
    return ids, mask


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("mode", ["samples", "padded"])
def test_rows_that_outgrow_the_models_context_are_stored(mode: str) -> None:
    """Prompt and answer past ``max_position_embeddings`` (transformers generates on, and so
    does vkv): each row of a many-row call becomes an entry, where its insertion raised
    ``CapacityError`` after the whole generation (each row's own cache had the model's context
    of room, not the call's). Tokens and logits as DynamicCache's; a later call reuses a row."""
    model = tiny("llama")  # max_position_embeddings=256
    store = PrefixStore(model.config)
    if mode == "samples":
        ids, mask = _ids(250), None
        kwargs: dict[str, Any] = {"do_sample": True, "num_return_sequences": 2}
    else:
        ids, mask = _padded(_ids(250), _ids(246, 1))
        kwargs = {}

    def run(cache: dict[str, Any]) -> Any:
        torch.manual_seed(7)
        return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, pad_token_id=PAD,
                              max_new_tokens=10, min_new_tokens=10, return_dict_in_generate=True,
                              output_logits=True, **kwargs, **cache)

    want = run({})
    got = run({"cache_implementation": "vkv", "cache_config": {"prefix_store": store}})
    assert_same_tokens(want.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits))
    assert reuse_report(got).inserted == 2 and store.stats().entries == 2
    store.check_invariants()
    follow = torch.cat([got.sequences[0:1, :259], _ids(3, 9)], dim=1)  # row 0 (no padding): the 259 tokens held
    again = _call(model, follow, store, max_new_tokens=3)
    assert reuse_report(again).reused_tokens == 259
    assert_same_tokens(_call(model, follow, None, max_new_tokens=3).sequences, again.sequences)
    store.check_invariants()


def test_a_call_whose_rows_cannot_all_be_stored_stores_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished call's rows go in all or none: where the second row's cache cannot be filled
    (a failure made here: what running out of memory does), the first row is not left in the
    store, no cache is left behind, and the next call is served."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    ids, mask = _padded(_ids(30), _ids(24, 1))
    caches = _live_caches()
    taken = VKVCache.take_rows
    calls = []

    def fail_second(self: VKVCache, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("made to fail")
        return taken(self, *args, **kwargs)

    monkeypatch.setattr(VKVCache, "take_rows", fail_second)
    with pytest.raises(RuntimeError, match="made to fail"):
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, do_sample=False,
                       cache_implementation="vkv", cache_config={"prefix_store": store})
    monkeypatch.setattr(VKVCache, "take_rows", taken)
    assert len(calls) == 2
    assert store.stats().entries == 0 and store.stats().inserts == 0
    assert _live_caches() == caches
    store.check_invariants()
    got = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=4, do_sample=False,
                         cache_implementation="vkv", cache_config={"prefix_store": store}, return_dict_in_generate=True)
    assert reuse_report(got).inserted == 2
    store.check_invariants()


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_padded_batch_counts_no_padding_as_computed(repeats: int) -> None:
    """``computed_tokens`` counts prompt tokens, as ``prompt_tokens`` does: never the padding a
    batch's shorter prompts carry (it counted 40 computed of 35), with prefill once (one row per
    prompt) or without; the store's ``prompt_tokens_computed`` sums the reports'."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    ids, mask = _padded(_ids(20), _ids(15, 1))
    kwargs: dict[str, Any] = {"do_sample": True, "num_return_sequences": 2} if repeats == 2 else {}
    got = model.generate(ids, attention_mask=mask, pad_token_id=PAD, max_new_tokens=3, return_dict_in_generate=True,
                         cache_implementation="vkv", cache_config={"prefix_store": store}, **kwargs)
    report = reuse_report(got)
    assert report.refusal is None and report.reused_tokens == 0
    assert report.prompt_tokens == 35 * repeats
    assert report.computed_tokens == 35
    assert store.stats().prompt_tokens_computed == 35
    store.check_invariants()


def test_memory_options_beside_a_store_are_refused_with_where_they_go() -> None:
    model = tiny("llama")
    store = PrefixStore(model.config)
    ids = _ids(10)
    for key, value in (("page_bytes", 64 * 1024), ("budget_bytes", 1 << 20)):
        with pytest.raises(CacheOptionError, match=f"PrefixStore.*{key}"):
            model.generate(ids, max_new_tokens=2, cache_implementation="vkv",
                           cache_config={"prefix_store": store, key: value})
    same = store.memory("cpu").options.page_bytes  # the store's own values are no conflict
    got = model.generate(ids, max_new_tokens=2, cache_implementation="vkv", return_dict_in_generate=True,
                         cache_config={"prefix_store": store, "page_bytes": same})
    assert reuse_report(got).refusal is None
    store.check_invariants()


def test_assisted_decoding_with_a_store_steps_aside_and_says_why() -> None:
    model, helper = tiny("llama"), assistant("llama")
    store = PrefixStore(model.config)
    ids = _ids(20)
    got = _call(model, ids, store, assistant_model=helper)
    assert_same_tokens(_call(model, ids, None, assistant_model=helper).sequences, got.sequences)
    assert "assisted decoding" in reuse_report(got).refusal
    store.check_invariants()


def test_two_threads_read_their_own_reports() -> None:
    """Two threads at once through one store, prompts of different lengths: each call's report
    is its own (read from the cache it returned)."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    lengths = {0: 20, 1: 33}
    seen: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for i in range(4):
                out = _call(model, _ids(lengths[k], 10 * k + i), store)
                seen[k].append(reuse_report(out).prompt_tokens)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == {0: [20] * 4, 1: [33] * 4}
    store.check_invariants()


def test_no_call_state_in_module_globals() -> None:
    """Nothing in the package keeps per-call state in a thread-local, a context variable or a
    weak dictionary (the hidden channels a call's state used to travel through). The one
    thread-local left is the CUDA driver's count of open context blocks per thread: state of the
    thread, not of a call."""
    banned = {("threading", "local"), ("contextvars", "ContextVar"), ("weakref", "WeakKeyDictionary"),
              ("weakref", "WeakValueDictionary")}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "cuda" / "driver.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and (node.value.id, node.attr) in banned:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module in ("threading", "contextvars", "weakref") \
                    and any((node.module, a.name) in banned for a in node.names):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found
    assert not hasattr(hf_vkv, "last_report")


@pytest.mark.threads(1, 2)
def test_generates_own_helpers_in_its_kwargs_do_not_stop_reuse() -> None:
    """``generate(tokenizer=...)`` (what transformers' server passes with every request, for stop
    strings) keeps the tokenizer in the model kwargs; the forward never reads it, so reuse applies,
    with DynamicCache's tokens."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    model = tiny("llama", seed=0)
    store = PrefixStore(model.config)
    history = _ids(40)
    _call(model, history, store, tokenizer=tokenizer)
    follow = torch.cat([history, _ids(5, seed=1)], dim=1)
    out = _call(model, follow, store, tokenizer=tokenizer)
    report = reuse_report(out)
    assert report.refusal is None and report.reused_tokens >= 40
    assert_same_tokens(out.sequences, _call(model, follow, None).sequences)


@pytest.mark.threads(1, 2)
def test_a_cache_nobody_gets_back_goes_into_the_store_itself() -> None:
    """``generate`` without ``return_dict_in_generate`` (the server's and pipelines' calls) returns
    the sequences alone: its one-row cache goes into the store itself; later calls reuse it with DynamicCache's tokens, and the store stays
    consistent."""
    model = tiny("llama", seed=0)
    history = _ids(40)
    plain = model.generate(history, attention_mask=torch.ones_like(history), do_sample=False, pad_token_id=PAD,
                           max_new_tokens=8)
    for eos in (None, int(plain[0, 40 + 3])):  # run to max_new_tokens; stop at the 4th new token
        store = PrefixStore(model.config)
        seq = model.generate(history, attention_mask=torch.ones_like(history), do_sample=False, pad_token_id=PAD,
                             max_new_tokens=8, eos_token_id=eos, cache_implementation="vkv",
                             cache_config={"prefix_store": store})
        assert isinstance(seq, torch.Tensor) and store.stats().inserts == 1
        stored = max(len(p) for p in store.prefixes())
        assert stored == (40 + 7 if eos is None else 40 + 3)  # the last token (the eos) was never fed back
        store.check_invariants()
        follow = torch.cat([seq[:, :stored], _ids(5, seed=1)], dim=1)
        out = _call(model, follow, store)
        assert reuse_report(out).reused_tokens == stored
        assert_same_tokens(out.sequences, _call(model, follow, None).sequences)
        store.check_invariants()


@pytest.mark.parametrize("other", ["dynamic", "static"])
def test_a_call_naming_another_cache_than_the_models_config_gets_it_without_the_store(other: str) -> None:
    """A store in ``model.generation_config`` (as docs/prefix_reuse.md sets it up) and a call that
    names another cache: that cache, exactly as on a model without the store, and the store
    untouched (before: a CacheOptionError telling the user to add cache_implementation='vkv').
    The same store given in the call's own ``cache_config`` with another cache is still refused."""
    model = tiny("llama")
    ids = _ids(12, seed=3)
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation=other, **kwargs)
    store = PrefixStore(model.config)
    saved = model.generation_config.cache_implementation, model.generation_config.cache_config
    model.generation_config.cache_implementation = "vkv"
    model.generation_config.cache_config = {"prefix_store": store}
    try:
        got = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation=other, **kwargs)
        assert not isinstance(got.past_key_values, VKVCache)
        assert_same_tokens(ref.sequences, got.sequences)
        for a, b in zip(ref.logits, got.logits, strict=True):
            assert torch.equal(a, b)
        assert store.stats().lookups == 0 and len(store) == 0
        with pytest.raises(CacheOptionError, match="needs cache_implementation='vkv'"):
            model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation=other,
                           cache_config={"prefix_store": PrefixStore(model.config)}, **kwargs)
        vkv = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # the model's default: vkv, the store
        assert isinstance(vkv.past_key_values, VKVCache) and store.stats().lookups == 1
        store.check_invariants()
    finally:
        model.generation_config.cache_implementation, model.generation_config.cache_config = saved


def test_a_report_counts_the_entries_a_call_added_as_the_store_does() -> None:
    """The same prompt answered three times: its row is the entry already stored from the second
    call on, so the store keeps that entry and adds none; the calls' reports said 1 each (3 inserts
    against the store's 1)."""
    model = tiny("llama")
    store = PrefixStore(model.config)
    ids = _ids(9)
    reports = [reuse_report(_call(model, ids, store)) for _ in range(3)]
    assert [r.inserted for r in reports] == [1, 0, 0]
    assert sum(r.inserted for r in reports) == store.stats().inserts == 1
    assert store.serves(ids[0].tolist()) and not store.serves(ids[0].tolist() + [7] * 40)
    store.check_invariants()
