"""Prefix reuse inside ``generate()``, the per-call half: ``cache_config={"prefix_store": store}``.

The store itself (radix tree, budget, files) is :mod:`hf_vkv.prefix`; this module is what one
``generate(cache_implementation="vkv")`` call (and so every ``pipeline("text-generation")``
call, chat messages included) does with it, on its :class:`~hf_vkv.generate.call.GenerateCall`:

1. when generate makes its cache (:func:`memory_for`, :func:`attach`): the cache draws from the
   store's memory (:meth:`PrefixStore.memory`, the store's layout), so rows can share the entries'
   pages, and the call's record holds the store, the end-of-sequence ids and any reason reuse
   cannot apply to this model (:func:`model_refusal`);
2. at the prefill (:func:`start`): when two or more different prompts share a leading run of
   tokens the store does not hold yet (a document and several questions), prefills that run once,
   batch 1, and stores it; looks up each unique prompt's longest stored prefix (by exact token
   ids, at most all but its last token); starts every row from it (:meth:`VKVCache.take_rows`: the
   entry's pages, shared; a left-padded row's prefix sits at an unaligned offset and is copied);
   transformers' own prefill (through prefill once) then computes only the rest. Rows with
   different reused lengths start from the smallest common column ``C = min(padding + reused)``:
   the longer ones compute a few stored tokens again. One unpadded row that continues an entry
   (up to :data:`TAKE_TAIL_TOKENS` short of its end) takes the entry over instead
   (:meth:`PrefixStore.take`): its row moves into the call's cache, nothing mapped;
3. when the decoding loop ends (:func:`finish`): inserts each finished row (prompt and answer, up
   to its first end-of-sequence token; beams: the prompt only) into the store, as a fork when the
   row is not padded and as a copy when it is, within the store's budget; a one-row cache the call
   built and hands to nobody (``generate``'s result is the sequences alone: the server's and
   pipelines' calls) goes in itself, with no fork.

Where reuse cannot apply, the call runs exactly as without a store and the report
(``cache.stats().reuse.refusal``, :class:`~hf_vkv.cache.stats.ReuseReport`) says why:
encoder-decoder models (the decoder's K/V depend on the encoder's input, which the store's keys do
not hold), a model with another config or other weights (or adapters) than the store's entries,
peft's prompt learning and per-row adapters, recurrent layers, the static layout,
``inputs_embeds``, images and any other model input that token ids do not identify,
explicit ``position_ids`` other than the ones transformers would use, an attention mask that is
not left padding, assisted decoding (its first forward is not generate's prefill). Sliding-window
layers (Gemma 2 and 3, Mistral with a window) keep only their window's pages, so their rows are
shared from token 0 and never copied: a left-padded batch of such a model, or one in the paged
layout (whose rows copy the stored ones), steps aside, a stored
row serves only prefixes whose window it still holds (``min_prefix_length``), and a row is stored
only where its window is whole (not cut back at an end-of-sequence token before its last token).

Exactness: the reference is what transformers computes when a user reuses a cache by hand — a
DynamicCache holding the same history, continued over the new tokens; the battery in
``tests/integration/test_prefix_reuse.py`` checks tokens against DynamicCache's.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from typing import Any

import torch

from .. import devices
from ..cache import RowSource, VKVCache
from ..cache.options import PREFIX_STORE_KEY
from ..memory.errors import ArgumentError, CacheOptionError, CacheOptionTypeError, KVCacheOutOfMemory, VKVError
from ..prefix import PrefixStore
from ..prefix.errors import PrefixMismatchError
from ..prefix.fingerprint import (OFFLOADED, WEIGHTS_DIFFER, config_fingerprint, describe_config_difference, in_training,
                                  per_row_adapters, weights_identity)
from . import prefill_once
from .call import GenerateCall, begin
from .names import CACHE_NAMES, cache_kwarg

__all__ = ["TAKE_TAIL_TOKENS", "attach", "count_prefill", "finish", "memory_conflict", "memory_for", "model_refusal",
           "split_prefix_store", "start"]

#: A one-row call whose prompt continues a stored entry takes the entry over (no page mapped);
#: it still does when the entry holds up to this many tokens past what the prompt shares, cut off.
#: A chat server encodes again the text the model generated, and the re-encoded answer can end in
#: other tokens than those generated (2 tokens short in 2 of 13 turns of a chat through
#: ``hf-vkv serve``). A longer unshared tail is likely another conversation's: that entry is
#: borrowed (its shared pages mapped), not cut.
TAKE_TAIL_TOKENS = 4

#: Inputs of ``generate``'s prefill that token ids (and left padding) fully describe, or that
#: change nothing the store holds: any other input that is set (pixel values, image features,
#: ``mm_encoder_outputs``, ``inputs_embeds``, token type ids, ...) makes reuse step aside.
_TEXT_INPUTS = frozenset({"attention_mask", "cache_position", "use_cache", "output_attentions",
                          "output_hidden_states", "return_dict", "logits_to_keep", "position_ids",
                          # generate's own helpers, kept in its model kwargs, never read by the forward
                          # (stop strings' tokenizer: what transformers' server passes with every request)
                          "tokenizer", "assistant_tokenizer"})


# --------------------------------------------------------------------------------- generate's cache
def split_prefix_store(config: dict[str, Any]) -> tuple[PrefixStore | None, dict[str, Any]]:
    """``(the prefix store of cache_config or None, the other options)``; a ``prefix_store`` that
    is not a :class:`~hf_vkv.PrefixStore` is a :class:`~hf_vkv.CacheOptionTypeError`."""
    rest = dict(config)
    store = rest.pop(PREFIX_STORE_KEY, None)
    if store is not None and not isinstance(store, PrefixStore):
        raise CacheOptionTypeError(
            f"cache_config[{PREFIX_STORE_KEY!r}] must be a hf_vkv.PrefixStore, got {type(store).__name__}: "
            f"store = hf_vkv.PrefixStore(model.config, budget_bytes=...)")
    return store, rest


def model_refusal(model: Any, store: PrefixStore) -> str | None:
    """Why ``store``'s entries cannot serve ``model`` (``None``: they can)."""
    if model.config.is_encoder_decoder:
        return ("an encoder-decoder model: the decoder's K/V depend on the encoder's input, which the store's "
                "keys (decoder token ids) do not hold")
    if config_fingerprint(model.config) != store.config_fingerprint:
        detail = describe_config_difference(model.config, store.config, a_name="model", b_name="store")
        return f"the store was made for another model (config fingerprints differ: {detail})"
    if devices.model_device(model) is None:
        return (f"the model's parameters are on the meta device (accelerate's cpu_offload / disk_offload: {OFFLOADED}, "
                f"and the store's memory is per device); load the model onto its device to reuse prefixes")
    wrapper = inputs_wrapper(model)
    if wrapper is not None:
        return (f"the model's generation inputs are prepared by {wrapper} for this call (peft's prompt learning: "
                f"virtual tokens or prompt embeddings the store's keys, token ids, do not hold)")
    if per_row_adapters(model):
        return ("adapters chosen per row (peft's adapter_names): the store's keys, token ids, do not say which "
                "adapter computed an entry")
    training = in_training(model)
    if training is not None:
        return (f"{training} is in training mode: dropout makes K/V differ from one forward to the next, so they "
                f"are neither stored nor taken (model.eval() for reuse)")
    return None


def inputs_wrapper(model: Any) -> str | None:
    """The class of the object whose method prepares ``model``'s generation inputs, where it is
    not the model's own: peft's prompt learning (prefix and prompt tuning, ...) sets the base
    model's ``prepare_inputs_for_generation`` to its ``PeftModel``'s for a ``generate`` call,
    which adds virtual tokens' K/V or prompt embeddings; ``None`` for the model's own method."""
    prepare = vars(model).get("prepare_inputs_for_generation")
    owner = getattr(prepare, "__self__", model)
    return None if prepare is None or owner is model else type(owner).__name__


def memory_for(model: Any, store: PrefixStore, cache_config: dict[str, Any]) -> VKVCache:
    """The memory ``generate``'s cache for ``model`` draws from, where :func:`model_refusal` said
    none (the caller asks it once a call): the store's (its page size, budget and layout). The
    memory options are the store's: a call that names other ``page_bytes`` or ``budget_bytes`` is a
    :class:`~hf_vkv.CacheOptionError` (its pages could not be the store's) naming where they go."""
    memory = store.memory(model.device)
    conflict = memory_conflict(memory, cache_config)
    if conflict is not None:
        key, given, held = conflict
        raise CacheOptionError(
            f"cache_config[{key!r}]={given!r} with a prefix_store: a call's cache draws from the store's memory "
            f"({key}={held!r}), so that its rows can share the stored pages. Give it to the store instead: "
            f"hf_vkv.PrefixStore(model.config, cache_config={{{key!r}: {given!r}}}), or drop the prefix_store")
    return memory


def memory_conflict(memory: VKVCache, cache_config: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """``(key, given, the store's)`` for a memory option of ``cache_config`` that differs from the
    store's ``memory`` (``None``: the call can draw from it)."""
    for key in ("page_bytes", "budget_bytes"):
        given, held = cache_config.get(key), getattr(memory.options, key)
        if given is not None and given != held:
            return key, given, held
    return None


def attach(cache: VKVCache, store: PrefixStore, model: Any, *, owned: bool, rows: int, num_beams: int,
           eos_token_id: Any, refusal: str | None) -> GenerateCall:
    """The record of a ``generate`` call whose ``cache`` (made with :func:`memory_for`'s memory)
    reuses ``store``: put on the cache for the prefill (:func:`start`) and the end of the decoding
    loop (:func:`finish`). ``refusal``: why the call's cache could not draw from the store
    (:func:`model_refusal`'s answer, which the caller asked before building the cache, or another
    reason; its report says so, and nothing is taken from or put into the store)."""
    weights = versions = None
    if refusal is None:
        try:
            weights, versions = weights_identity(model)
        except PrefixMismatchError as e:  # a parameter on the meta device: nothing to read
            refusal = str(e)
    if weights is not None and store.weights_fingerprint not in (None, weights):
        if store.dtype not in (None, model.dtype):
            refusal = (f"the store's entries hold {store.dtype} K/V and the model computes in {model.dtype} (a cast "
                       f"model's weights differ too): a store serves one dtype; use a store per dtype")
        else:
            refusal = (f"the store's entries were computed with other weights (same config; {WEIGHTS_DIFFER}): a "
                       f"store serves one model's weights; use a store per model, adapter or attention, or "
                       f"store.clear() to fill it again with these weights")
    elif versions is not None and not store.unwritten_since(versions):
        refusal = ("the model's parameters were written in place since the store's entries were computed (a "
                   "parameter's version counter moved: an optimizer step, load_state_dict, an edit under "
                   "torch.no_grad()), a parameter or buffer was replaced (module.weight = ..., a new pruning mask), "
                   "or this is another copy of that model: its K/V may differ where the weights "
                   "fingerprint does not sample; store.clear() fills the store again with these weights, or use a "
                   "store per model")
    return begin(cache, owned=owned, rows=rows, num_beams=num_beams, store=store, eos_token_id=eos_token_id,
                 refusal=refusal, weights=weights)


# --------------------------------------------------------------------------------- the prefill
def start(call: GenerateCall, cache: VKVCache, model: Any, input_ids: torch.Tensor, model_kwargs: dict) -> None:
    """At ``generate``'s prefill: start ``cache``'s rows from the store (see the module
    docstring), or write in the call's report why not. Once per call."""
    if call.prefilled or call.report is None:
        return
    call.prefilled = True
    started = time.perf_counter()
    reason = call.report.refusal or _start_rows(call, cache, model, input_ids, model_kwargs)
    call.report.seconds_to_start = time.perf_counter() - started
    call.report.refusal = reason


def count_prefill(call: GenerateCall, cache: VKVCache) -> None:
    """After the prefill: count what it computed (in the report and the store's stats)."""
    report = call.report
    if report is None or call.input_ids is None or report.refusal is not None:
        return
    start, pads = report.start_column, call.pads
    if cache.prompt_repeats > 1:  # prefill once counted the columns it computed: one row per prompt where it ran
        rows = range(0, len(pads), cache.prompt_repeats) if cache.prefill_counts.verdict.startswith("on") \
            else range(len(pads))
        computed = cache.prefill_counts.computed - call.computed_before
    else:
        rows = range(len(pads))
        computed = len(pads) * (call.input_ids.shape[1] - start)
    report.computed_tokens += computed - sum(max(pads[r] - start, 0) for r in rows)  # not the padding
    assert call.store is not None
    call.store.count_prefill(prompt_tokens=report.prompt_tokens, computed=report.computed_tokens)


def _pads(input_ids: torch.Tensor, model_kwargs: dict) -> list[int] | None:
    """Each row's left padding, or ``None`` when the attention mask is not left padding."""
    mask = model_kwargs.get("attention_mask")
    rows, length = input_ids.shape
    if mask is None:
        return [0] * rows
    if mask.dim() != 2 or tuple(mask.shape) != (rows, length):
        return None
    mask = mask.to("cpu").bool()
    pads = (~mask).sum(dim=1)
    if not torch.equal(mask, torch.arange(length)[None, :] >= pads[:, None]):
        return None
    return [int(p) for p in pads.tolist()]


def _positions_refusal(position_ids: Any, pads: list[int], length: int) -> str | None:
    """Why explicit ``position_ids`` differ from what the stored prefixes were computed at
    (each row's tokens at ``0, 1, ...`` after its padding); ``None``: they do not."""
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
            or tuple(position_ids.shape) != (len(pads), length):
        return "explicit position_ids of another shape than [rows, tokens] (multimodal or custom positions)"
    ids = position_ids.to("cpu")
    for row, pad in enumerate(pads):
        if not torch.equal(ids[row, pad:], torch.arange(length - pad, dtype=ids.dtype)):
            return (f"explicit position_ids (row {row} does not count 0, 1, ... from its first token): the stored "
                    f"prefixes were computed at other positions")
    return None


def _input_refusal(cache: VKVCache, model_kwargs: dict) -> str | None:
    if cache.get_seq_length():
        return "the cache already holds tokens"
    if cache.transformers_layers():
        return "layers kept by transformers (recurrent or linear-attention state) cannot start from stored pages"
    if cache.layout == "static":
        return "the static layout (compiled steps)"
    for key, value in model_kwargs.items():
        if key in _TEXT_INPUTS or key in CACHE_NAMES or value is None or isinstance(value, (bool, int, float, str)):
            continue
        if isinstance(value, (dict, list, tuple)) and not value:
            # generate passes mm_encoder_outputs={} to every call of a model that takes images
            return (f"a model that takes images or other media (generate passes it {key!r}, empty in a text-only "
                    f"call): its prompts' K/V may depend on more than their token ids, so reuse serves text models")
        return f"the model input {key!r} is not identified by token ids"
    return None


def _start_rows(call: GenerateCall, cache: VKVCache, model: Any, input_ids: torch.Tensor,
                model_kwargs: dict) -> str | None:
    """Fill ``cache`` from the store; return why it could not (``None``: it did)."""
    store, report = call.store, call.report
    assert store is not None and report is not None
    rows, length = input_ids.shape
    report.rows = rows
    reason = _input_refusal(cache, model_kwargs)
    if reason is not None:
        return reason
    pads = _pads(input_ids, model_kwargs)
    if pads is None:
        return "the attention mask is not left padding"
    reason = _positions_refusal(model_kwargs.get("position_ids"), pads, length)
    if reason is not None:
        return reason
    if cache.slides() and any(pads):
        return ("sliding-window layers with left-padded rows: a stored window is shared from token 0, never copied "
                "to a padded row's offset (batches of one prompt length reuse)")
    if cache.slides() and getattr(model.config, "_attn_implementation", None) == devices.PAGED_ATTENTION:
        return ("sliding-window layers in the paged layout ('vkv_paged'): its rows would copy the stored windows, "
                "which a window's pages do not allow")
    call.input_ids, call.pads = input_ids, pads
    report.prompt_tokens = sum(length - p for p in pads)
    k = cache.prompt_repeats
    if k > 1 and prefill_once.repeats_refusal(input_ids, model_kwargs, k) is not None:
        k = 1  # rows that do not repeat their prompt: each row is its own
    unique = list(range(0, rows, k))
    ids = input_ids.to("cpu")
    tokens = {u: ids[u, pads[u]:].tolist() for u in unique}
    if rows == 1 and pads[0] == 0 and call.owned:  # one row continuing an entry: it moves here, nothing mapped
        call.taken = store.take(tokens[0], into=cache, tail_tokens=TAKE_TAIL_TOKENS)
        if call.taken:
            report.start_column = report.reused_tokens = call.taken
            return None
    if len(unique) > 1:
        report.common_prefix_tokens = _store_common_prefix(model, store, [tokens[u] for u in unique], call.weights)
        report.computed_tokens += report.common_prefix_tokens
    with contextlib.ExitStack() as borrowed:  # the entries, read in place while the store is locked
        found = {u: borrowed.enter_context(store.borrow(tokens[u])) for u in unique}
        column = min(pads[u] + m for u, (_, m) in found.items())
        report.start_column = column
        if column == 0:
            return None  # nothing stored yet: a full prefill, whose rows are stored afterwards
        if cache.slides() and any(entry.min_prefix_length() > column for entry, _ in found.values()):
            report.start_column = 0
            return (f"sliding-window layers: the batch's rows share {column} stored tokens, and a stored row's window "
                    f"for them is gone (it serves longer prefixes only)")
        sources = []
        for row in range(rows):
            u = row - row % k
            sources.append(RowSource(found[u][0] if column > pads[u] else None, offset=pads[u]))
        try:
            report.copied_rows = cache.take_rows(sources, length=column)
        except ArgumentError as e:  # a sliding group that cannot share a row refuses before any group takes one
            if not cache.slides() or cache.get_seq_length() or cache.rows:
                raise
            report.start_column = 0
            return f"sliding-window layers: {e}"
    report.reused_tokens = sum(max(column - p, 0) for p in pads)
    return None


def _common_length(sequences: list[list[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for other in sequences[1:]:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n


def _store_common_prefix(model: Any, store: PrefixStore, prompts: list[list[int]], weights: str | None) -> int:
    """Prefill the tokens every prompt starts with (at most all but the shortest's last) once,
    batch 1, over what the store holds of them, and store them; return the tokens computed."""
    shared = min(_common_length(prompts), min(len(p) for p in prompts) - 1)
    if shared < devices.MIN_COMMON_PREFIX:
        return 0
    tokens = prompts[0][:shared]
    if store.longest_prefix(tokens + [0]) >= shared:
        return 0  # stored already

    cache = store.lookup(tokens)
    try:
        held = cache.get_seq_length()
        if shared - held < devices.MIN_COMMON_PREFIX:
            cache.close()
            return 0
        device = model.device
        kwargs: dict[str, Any] = {cache_kwarg(): cache, "use_cache": True}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kwargs["logits_to_keep"] = 1  # only the K/V are wanted
        model(input_ids=torch.tensor([tokens[held:]], device=device),
              position_ids=torch.arange(held, shared, device=device)[None], **kwargs)
    except BaseException:
        cache.close()
        raise
    store.insert(tokens, cache, give=True, weights=weights)
    return shared - held


# --------------------------------------------------------------------------------- after decoding
def finish(call: GenerateCall, cache: VKVCache, sequences: Any, *, returned: bool = True) -> int:
    """When the decoding loop returned ``sequences``: insert ``cache``'s finished rows into the
    store; return how many (0 where reuse did not apply). ``returned=False``: ``generate`` hands
    the cache to nobody (its result is the sequences alone: the server's, a pipeline's), so a
    one-row cache the call built goes into the store itself, cut to the row's end, instead of a
    fork of it (no fork to map, no cache left to release)."""
    report = call.report
    if report is None:
        return 0
    if not call.prefilled and report.refusal is None:
        report.refusal = "assisted decoding: its first forward is not generate's prefill, which reuse starts"
    if report.refusal is None and call.input_ids is not None and isinstance(sequences, torch.Tensor):
        taken, call.taken = call.taken, 0  # the row, inserted longer than the entry it took over, stores that entry again
        report.inserted = _insert_rows(call, cache, sequences, give=call.owned and not returned, taken=taken)
    return report.inserted


def give_back(call: GenerateCall, cache: VKVCache) -> bool:
    """The call failed: the store entry ``cache`` took over at its start (:meth:`PrefixStore.take`)
    goes back into the store, as ``cache`` itself cut back to the entry's tokens (nothing wrote
    them: the call's writes come after). Returns whether it did; the caller must then not close
    ``cache``. ``False``: the call took nothing, or the entry could not go back (it is lost from
    the store: a later prompt prefills it again, never reads wrong K/V)."""
    taken, call.taken = call.taken, 0
    if not taken or call.store is None or call.input_ids is None:
        return False
    try:
        cache.cut_to(taken)
        call.store.insert(call.input_ids[0, :taken].tolist(), cache, give=True, weights=call.weights)
    except (ValueError, VKVError):
        return False
    return True  # the store holds it (or closed it: an entry alone over the budget)


def _insert_rows(call: GenerateCall, cache: VKVCache, sequences: torch.Tensor, *, give: bool, taken: int = 0) -> int:
    """Insert the finished rows of ``cache`` (their ids in ``sequences``); return how many became
    entries (a row an entry already serves is kept by the store as that entry: not counted). All
    or none: every row that needs a cache of its own gets it before the first goes in, so where a
    row cannot (a padded row's copy finds the store's memory full) none is inserted, with a
    warning, and the call returns what it computed. ``taken``: the tokens of the
    entry the call took over (:meth:`PrefixStore.take`); a row alone over the store's budget, which
    the store would drop, stores those again instead (the entry is not lost)."""
    store, ids = call.store, call.input_ids
    assert store is not None and ids is not None
    held = cache.get_seq_length()
    prompt = ids.shape[1]
    if call.num_beams > 1:  # rows were reordered by beams: store each prompt, which all its beams share
        k = cache.prompt_repeats
        rows = [(r, ids[r].tolist(), prompt) for r in range(0, ids.shape[0], k)]
    elif sequences.shape[0] == cache.rows:
        seq = sequences.to("cpu")
        rows = []
        for r in range(cache.rows):
            row = seq[r].tolist()
            end = held
            for i in range(prompt, held):
                if row[i] in call.eos:
                    end = i + 1
                    break
            rows.append((r, row, end))
    else:
        return 0
    shortest = max(cache.min_prefix_length(), 1)  # a sliding window behind a shorter row is gone
    rows = [(r, row, end) for r, row, end in rows if end - call.pads[r] >= shortest]
    if len(rows) == 1 and call.pads[rows[0][0]] == 0 and cache.rows == 1:
        # give: the call's own cache, which nobody else holds; else a fork of it
        _, row, end = rows[0]
        budget = store.budget_bytes
        if taken and budget is not None and (cache.bytes_at_most(rows=1, tokens=end) or 0) > budget:
            end = taken  # the row alone is over the budget: keep the entry it took over
        if end < held and cache.slides():
            return 0  # a sliding window is not cut back (its pages behind it are gone)
        if give and end < held:
            cache.crop(end - held)
        new = not store.serves(row[:end])  # an entry already serving the row is kept, not counted
        return int(bool(store.insert(row[:end], cache, give=give, weights=call.weights)) and new)
    # a cache per row, each with the call's room (a row may have outgrown the model's context)
    reserved = cache.reserved_tokens()
    room = {} if reserved is None else {"max_tokens": reserved}
    made: list[tuple[list[int], VKVCache]] = []
    try:
        for r, row, end in rows:
            pad = call.pads[r]
            one = store.new_cache(batch_size=1, **room)
            made.append((row[pad:end], one))
            one.take_rows([RowSource(cache, row=r, start=pad)], length=end - pad)
    except BaseException as error:
        for _, one in made:
            one.close()
        if not isinstance(error, KVCacheOutOfMemory):
            raise
        warnings.warn(f"PrefixStore: this call's {len(rows)} rows were not stored: copying them out of the call's "
                      f"cache (rows with padding are copied) needs more than the store's memory has free "
                      f"({error.requested_bytes:,} bytes asked, {error.free_bytes:,} free); the call's output is "
                      f"whole. Raise the store's cache_config['budget_bytes'] to keep such calls", UserWarning,
                      stacklevel=2)
        return 0
    inserted = 0
    for i, (tokens, one) in enumerate(made):
        try:
            new = not store.serves(tokens)
            inserted += bool(store.insert(tokens, one, give=True, weights=call.weights)) and new  # the store keeps it
        except BaseException:
            for _, left in made[i + 1:]:
                left.close()
            raise
    return inserted
