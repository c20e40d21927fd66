"""Prefill once: ``generate``'s prefill runs each expanded prompt through the model once.

``generate`` repeats every prompt ``k = max(num_beams, num_return_sequences)`` times *before* its
prefill (``_expand_inputs_for_generation``), so a plain prefill computes ``k`` identical copies of
each prompt. With a :class:`~hf_vkv.VKVCache` that shares prompts, :func:`prefill` (called by the
wrapper of ``GenerationMixin._prefill`` that :func:`hf_vkv.generate.registry.register` installs) instead

1. checks that the rows really repeat: ``input_ids`` and every row-indexed input (attention mask,
   position ids, embeddings, encoder outputs, ...) equal in each group of ``k`` rows;
2. runs transformers' own ``_prefill`` (plain or chunked) on one row per prompt, inside
   :func:`unique_prompts`, which then repeats each cache row ``k`` times — the pages shared,
   nothing copied;
3. hands ``generate`` the step's outputs expanded to ``k`` rows (``repeat_interleave`` of every
   batch-first tensor: logits, hidden states, attentions, ...).

Why ``_prefill``: it is the one call that runs the prompt's forward in both 5.17 and the newest
transformers (``_sample`` and ``_beam_search`` call it, chunked prefill lives inside it), it takes
``input_ids`` and ``model_kwargs`` after expansion and before any forward, and its result is the
step output ``generate`` reads. Wrapping ``_expand_inputs_for_generation`` instead would hand
``generate`` unexpanded inputs for the decode loop, and wrapping the model's ``forward`` would
catch calls that are not generate's prefill.

Exact on this machine, not on one: a row of a batch-``B`` forward equals the same row of a
batch-``B*k`` forward only where every kernel splits its work the same way for both, which depends
on the shapes, the dtype and the thread count. :class:`~hf_vkv.generate.row_exactness.RowExactness` checks
each matmul, attention and reduction of the prompt's forward against its expansion the first time
its signature (shapes, strides, dtype, threads, ``B``, ``k``) is seen in the process: an exact one
costs nothing afterwards; one whose unique result differs runs on the expanded rows and hands back
DynamicCache's bits; one whose repeats differ among themselves makes the whole prefill run on every
row. Everything after the base model (the head: transforms, norms, the decoder, soft-capping, a
tied head) runs on all expanded rows: the base model's output rows are repeated before the head
reads them, so the head computes exactly what DynamicCache's does (only at the positions generate
keeps for the head, any other read filling the rest first: :mod:`hf_vkv.generate.head_rows`). Tokens and logits are
DynamicCache's (``torch.equal``); it is on by default (``cache_config={"prefill_once": False}``
turns it off). Where it cannot apply — rows that differ, a model or any module of it in training mode
(dropout differs per row), forward hooks a user put on it (they would see one row per prompt:
:func:`~hf_vkv.prefix.fingerprint.user_hooks`), mixture-of-experts models (an expert's matmul size depends on the batch), an input whose
row dimension this module cannot place (pixel values, image grids), a cache holding transformers' own
layers (hybrid models: their state cannot be rolled back after an inexact call), layers whose
activations are sequence first (FSMT), a head that reads more than the base model's last hidden
state (ProphetNet: :func:`_check_head_rows`) — the prefill runs on every row
as before and :meth:`VKVCache.stats` says why (``prefill_once``); calls that had to run on the
expanded rows are counted there too. The counts live on the cache as plain data
(:class:`~hf_vkv.cache.stats.PrefillCounts`, ``cache.prefill_counts``): this module writes them.

Thread count: verdicts are keyed by ``torch.get_num_threads()`` at the call, so a
``torch.set_num_threads`` between calls makes the next prefill probe its calls afresh.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import EncoderDecoderCache

from ..cache import VKVCache
from ..cache.encoder_decoder import VKVEncoderDecoderCache
from ..devices import policy_for
from ..memory import register_critical, section
from ..prefix.fingerprint import in_training, user_hooks
from .names import CACHE_NAMES
from .head_rows import HeadReads, RepeatedRows, leave_mode, repeat_for_head
from .row_exactness import InexactRows, RowExactness

__all__ = ["prefill", "expand_rows", "first_of_repeats", "repeats_refusal", "row_dim", "unique_prompts",
           "vkv_cache_of"]

#: Keys of ``model_kwargs`` whose tensors are not indexed by row.
_NOT_ROWS = frozenset({"cache_position", "logits_to_keep", "head_mask", "decoder_head_mask", "cross_attn_head_mask"})
#: Keys of ``model_kwargs`` whose tensors (nested in a ModelOutput too) have the rows first.
_ROWS_FIRST = frozenset({
    "input_ids", "attention_mask", "inputs_embeds", "token_type_ids", "mm_token_type_ids", "decoder_input_ids",
    "decoder_attention_mask", "decoder_inputs_embeds", "encoder_outputs", "encoder_hidden_states",
    "encoder_attention_mask", "labels",
})
#: Keys whose rows are the dim before the tokens: ``[B, T]``, multimodal rotary ``[3, B, T]``.
_ROWS_BEFORE_TOKENS = frozenset({"position_ids", "decoder_position_ids"})
#: Config attributes of mixture-of-experts models: each expert multiplies the tokens routed to it,
#: so its matmul has fewer rows when the forward has fewer, and with an expert capacity rows
#: compete for it.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "expert_capacity", "moe_num_experts")

#: Model types whose layers compute on ``[T, B, C]`` activations (fairseq's layout): the rows of a
#: call are not its dim 0, so :class:`RowExactness` cannot place them (a call whose tokens are not a
#: multiple of the prompts would not even be watched).
_SEQUENCE_FIRST = frozenset({"fsmt"})


class _Unplaced(Exception):
    """An input whose row dimension this module does not know."""


def vkv_cache_of(model_kwargs: dict, *, wrapped: bool = False) -> tuple[Any, VKVCache] | None:
    """``(the cache generate passes, its VKVCache part)`` or ``None`` for any other cache: a
    :class:`VKVCache` or a :class:`VKVEncoderDecoderCache` (whose row operations work, as prefill
    once and the decoding loop need), and with ``wrapped`` also transformers' own
    ``EncoderDecoderCache`` around a :class:`VKVCache` (what a user builds by hand: its
    self-attention cache is checked before anything runs as any other vkv cache)."""
    kinds = EncoderDecoderCache if wrapped else VKVEncoderDecoderCache
    for name in CACHE_NAMES:
        outer = model_kwargs.get(name)
        if outer is not None:
            inner = outer.self_attention_cache if isinstance(outer, kinds) else outer
            return (outer, inner) if isinstance(inner, VKVCache) else None
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, a tuple/list's items, a ModelOutput's / dict's values."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):  # ModelOutput is a dict too
        return [t for v in value.values() for t in _tensors(v)]
    return []


def row_dim(key: str, t: torch.Tensor, rows: int) -> int | None:
    """The dimension of ``model_kwargs[key]``'s tensor ``t`` that indexes the ``rows`` rows
    (``None``: not indexed by row). Raises ``_Unplaced`` for a tensor of an unknown key, or one
    whose shape does not have ``rows`` where its key says."""
    if key in _NOT_ROWS or t.dim() == 0:
        return None
    if key in _ROWS_FIRST:
        dim = 0
    elif key in _ROWS_BEFORE_TOKENS and t.dim() >= 2:
        dim = t.dim() - 2
    else:
        raise _Unplaced(f"prefill once cannot place the rows of {key!r} (shape {list(t.shape)})")
    if t.shape[dim] != rows:
        raise _Unplaced(f"{key!r} of shape {list(t.shape)} has no dimension of {rows} rows where expected")
    return dim


def _grouped_equal(t: torch.Tensor, dim: int, k: int) -> bool:
    """Whether each group of ``k`` consecutive rows (along ``dim``) of ``t`` repeats one row."""
    grouped = t.unflatten(dim, (t.shape[dim] // k, k))
    return torch.equal(grouped, grouped.narrow(dim + 1, 0, 1).expand_as(grouped))


def repeats_refusal(input_ids: torch.Tensor, model_kwargs: dict, k: int) -> str | None:
    """Why the rows of ``input_ids`` ``[B*k, T]`` and of the row-indexed ``model_kwargs`` are not
    ``B`` prompts each repeated ``k`` times in a row (``None``: they are), or why an input's rows
    cannot be placed (:func:`row_dim`)."""
    rows = input_ids.shape[0]
    if rows % k:
        return f"{rows} rows are not a multiple of {k}"
    named = [("input_ids", input_ids)] + [(key, t) for key, v in model_kwargs.items() for t in _tensors(v)]
    for key, t in named:
        try:
            dim = row_dim(key, t, rows)
        except _Unplaced as exc:
            return str(exc)
        if dim is not None and not _grouped_equal(t, dim, k):
            return f"the rows of {key!r} differ within a repeated prompt"
    return None


def _map_rows(value: Any, rows: int, fn: Any, keep: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor whose first dim is ``rows``; tuples, lists,
    dicts and ModelOutputs rebuilt around them; ``keep`` (the cache) and anything else as it is."""
    if value is keep:
        return value
    if isinstance(value, torch.Tensor):
        return fn(value) if value.dim() and value.shape[0] == rows else value
    if isinstance(value, (tuple, list)):
        return type(value)(_map_rows(v, rows, fn, keep) for v in value)
    if isinstance(value, dict):
        out = copy_mapping(value)
        for key, v in value.items():
            out[key] = _map_rows(v, rows, fn, keep)
        return out
    return value


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides a contiguous tensor of its shape has, as DynamicCache's expanded
    inputs have them (``contiguous()`` keeps a view whose size-1 dims carry the strides of the
    tensor it was cut from: a kernel may take another path for them)."""
    dense, step = [], 1
    for n in reversed(t.shape):
        dense.append(step)
        step *= max(n, 1)
    return t if t.stride() == tuple(reversed(dense)) else t.clone(memory_format=torch.contiguous_format)


def first_of_repeats(model_kwargs: dict, rows: int, k: int, *, keep: Any = None) -> dict:
    """``model_kwargs`` with every row-indexed tensor cut to the first row of each ``k`` along its
    row dimension (:func:`row_dim`; nested in containers for row-first keys), the rest as it is.
    Cut tensors are contiguous, as DynamicCache's expanded ones (a kernel may take another path for
    a strided operand; :func:`_dense`). Call after :func:`repeats_refusal` said ``None``."""
    out = copy_mapping(model_kwargs)
    for key, value in model_kwargs.items():
        if value is keep or key in _NOT_ROWS:
            continue
        if isinstance(value, torch.Tensor) and key in _ROWS_BEFORE_TOKENS:
            dim = row_dim(key, value, rows)
            out[key] = value if dim is None else _dense(value.unflatten(dim, (rows // k, k)).select(dim + 1, 0))
        elif key in _ROWS_FIRST:
            out[key] = _map_rows(value, rows, lambda t: _dense(t[::k]), keep)
    return out


def expand_rows(value: Any, rows: int, k: int, *, keep: Any = None) -> Any:
    """The inverse for outputs (row-first): every tensor with first dim ``rows`` repeated ``k``
    times per row (``repeat_interleave``), containers rebuilt (:func:`_map_rows`)."""
    return _map_rows(value, rows, lambda t: t.repeat_interleave(k, dim=0), keep)


def copy_mapping(value: dict) -> dict:
    """A shallow copy of a dict or ModelOutput of the same class."""
    if type(value) is dict:
        return dict(value)
    out = type(value).__new__(type(value))
    dict.update(out, value)
    out.__dict__.update(vars(value))
    return out


def base_of(model: Any) -> torch.nn.Module | None:
    """The module whose output rows the head reads: the decoder (``get_decoder()``: an
    encoder-decoder's decoder, OPT's decoder inside its base model, most models' base model),
    else the base model (``None``: the model is its own base, so there is no head to separate).
    :func:`prefill` checks that it ran: a model whose head reads another module steps aside."""
    base = None
    if hasattr(model, "get_decoder"):
        try:
            base = model.get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            base = None
    if not isinstance(base, torch.nn.Module) or base is model:
        base = getattr(model, "base_model", None)
    return base if isinstance(base, torch.nn.Module) and base is not model else None


def _cache_refusal(cache: VKVCache, device: torch.device) -> str | None:
    """Why ``generate``'s next prefill on ``device`` must run on every expanded row of ``cache``
    (``None``: it may run once per prompt, see :func:`unique_prompts`)."""
    if cache.prompt_repeats < 2:
        return "no prompt is repeated"
    if not (cache.options.share_prompts and cache.options.prefill_once is not False):
        return "cache_config sets share_prompts or prefill_once to False"
    if cache.options.prefill_once is None and not policy_for(device).prefill_once:
        return (f"not measured exact on {device.type} yet: cache_config={{'prefill_once': True}} turns it on "
                f"(a row of a batch-B forward may round differently from the same row in a batch-N one there)")
    if cache.get_seq_length() and not cache.rows_repeat_prompts():
        return "the cache already holds tokens, not the same ones in every row of a prompt"
    fixed = [type(layer).__name__ for layer in cache.transformers_layers()
             if not hasattr(layer, "batch_repeat_interleave")]
    if fixed:
        return f"transformers' {fixed[0]} layers this cache keeps cannot repeat rows"
    return None


@contextlib.contextmanager
def unique_prompts(cache: VKVCache, *, prompts: int, tokens: int,
                   repeat_rows: Callable[[int], None] | None = None) -> Iterator[None]:
    """Run ``generate``'s prefill on one row per prompt: inside, ``cache`` takes ``prompts``
    distinct rows as they are (no prompt sharing among them); on success each row is then repeated
    :attr:`VKVCache.prompt_repeats` times (``repeat_rows``, default the cache's
    ``batch_repeat_interleave``; an encoder-decoder cache passes its own), its pages shared and
    nothing copied. Counts ``prompts x tokens`` computed and ``prompts x (k - 1) x tokens`` saved
    (``tokens``: the whole prompt; tokens the cache holds already, from stored prefixes, are not)."""
    k = cache.prompt_repeats
    past = cache.get_seq_length()
    if past:  # rows started from stored prefixes (take_rows), k per prompt on the same pages: keep one
        cache.batch_select_indices(range(0, cache.rows, k))
    tokens -= past
    with cache.prompts_alone():
        yield
    (repeat_rows or cache.batch_repeat_interleave)(k)
    cache.count_shared_prompt_rows(prompts * (k - 1))
    counts = cache.prefill_counts
    counts.computed += prompts * tokens
    counts.saved += prompts * (k - 1) * tokens
    counts.verdict = "on"


def _refusal(model: Any, cache: VKVCache, input_ids: torch.Tensor, model_kwargs: dict) -> str | None:
    reason = _cache_refusal(cache, input_ids.device)
    if reason is not None:
        return reason
    training = in_training(model)
    if training is not None:
        return f"{training} is in training mode (dropout differs per row)"
    hooks = user_hooks(model)
    if hooks:
        return (f"forward hooks a user put on the model ({', '.join(hooks[:3])}{', ...' if len(hooks) > 3 else ''}) "
                f"would see one row per prompt: they may draw random numbers or act per row")
    if base_of(model) is None:
        return f"{type(model).__name__} has no base model whose output rows the head reads"
    if cache.transformers_layers():
        return ("the cache keeps transformers' own layers (linear or recurrent state), which cannot be rolled back "
                "if a call of the forward proves inexact midway")
    if cache.get_seq_length() and cache.slides():
        return ("the rows start from stored prefixes in sliding-window layers, which cannot be cut back to them if a "
                "call of the forward proves inexact midway (a window drops its pages behind it as it grows)")
    if model.config.model_type in _SEQUENCE_FIRST:
        return (f"{type(model).__name__}'s layers lay their activations out sequence first ([T, B, C]): the rows of "
                f"their calls cannot be placed")
    config = model.config.get_text_config(decoder=True)
    experts = [name for name in _EXPERTS if getattr(config, name, None)]
    if experts:
        return (f"a mixture-of-experts model ({experts[0]}={getattr(config, experts[0])}): an expert's matmul size "
                f"depends on how many rows the forward has")
    return repeats_refusal(input_ids, model_kwargs, cache.prompt_repeats)


def _expand_hidden(output: Any, prompts: int, k: int, keep: Any = None) -> tuple[Any, RepeatedRows | None]:
    """The base model's ``output`` with its last hidden state ``[prompts, T, H]`` repeated to
    ``[prompts*k, T, H]`` (contiguous, as DynamicCache's), so that the head runs on every row;
    where generate keeps ``keep`` positions for the head (``logits_to_keep``), only those are
    written, and the returned record says so (:func:`~hf_vkv.generate.head_rows.repeat_for_head`)."""
    if isinstance(output, tuple):
        first = output[0]
        return ((first.repeat_interleave(k, dim=0), *output[1:]) if first.shape[0] == prompts else output), None
    hidden = output.get("last_hidden_state") if isinstance(output, dict) else None
    if not isinstance(hidden, torch.Tensor) or hidden.shape[0] != prompts:
        return output, None
    out = copy_mapping(output)
    rows = repeat_for_head(hidden, k, keep)
    out["last_hidden_state"] = hidden.repeat_interleave(k, dim=0) if rows is None else rows.full
    return out, rows


@contextlib.contextmanager
@register_critical  # a Ctrl-C in its setup or teardown is raised once they have run (see the hooks below)
def _rows_checked(model: Any, prompts: int, k: int, *, keep: Any = None) -> Iterator[RowExactness]:
    """Inside: the base model's forwards are checked call by call (:class:`RowExactness`) and its
    output rows expanded before the head reads them (the positions ``keep`` names only, guarded
    by :class:`~hf_vkv.generate.head_rows.HeadReads` from the first such expansion to the end)."""
    base = base_of(model)
    mode = RowExactness(prompts=prompts, repeats=k)
    reads = HeadReads()
    caller = threading.get_ident()  # the hooks are the module's, seen by every thread's forward: this call's only

    def start(module: Any, args: Any) -> None:
        if threading.get_ident() != caller:
            return
        mode.watching = True
        mode.base_calls += 1

    def stop(module: Any, args: Any, output: Any) -> Any:
        if threading.get_ident() != caller:
            return None
        mode.watching = False
        output, rows = _expand_hidden(output, prompts, k, keep)
        if rows is not None:
            reads.add(rows)
        return output

    # The hooks and the mode are put on whole and taken off whole, Ctrl-C held (hf_vkv.memory.interrupts): one
    # left on the model by an interrupt would expand the rows of every later forward. The sections hold it inside
    # them; between them (a Ctrl-C as the body's exception enters the first finally, before its section), this
    # generator's frame, registered critical, has it raised again once the teardown has run.
    handles: list[Any] = []
    entered = False
    try:
        with section():
            handles = [base.register_forward_pre_hook(start), base.register_forward_hook(stop, always_call=True)]
            mode.__enter__()
            entered = True
        try:
            yield mode
        finally:
            with section():
                reads.close()
                if entered:
                    entered = False
                    leave_mode(mode)
        if not mode.base_calls:  # nothing was checked and the head did not see expanded rows
            raise InexactRows(f"{type(model).__name__}'s forward did not run {type(base).__name__}, the module whose "
                              f"rows prefill once checks and expands")
    finally:
        with section():
            if entered:
                leave_mode(mode)
            for handle in handles:
                handle.remove()


def _check_head_rows(model: Any, outputs: Any, prompts: int) -> None:
    """Raise :class:`InexactRows` where the head computed its logits for one row per prompt: it
    read something other than the base model's last hidden state, which alone comes back repeated
    (ProphetNet's head reads the decoder's n-gram streams, sized by the decoder's input rows), so
    it did not compute on DynamicCache's rows."""
    logits = outputs.get("logits") if isinstance(outputs, dict) else None
    if isinstance(logits, torch.Tensor) and logits.dim() and logits.shape[0] == prompts:
        raise InexactRows(f"{type(model).__name__}'s head computes its logits from more than the last hidden state "
                          f"of {type(base_of(model)).__name__}, on one row per prompt")


def prefill(original: Any, model: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
            *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin._prefill`` (``original``) run once per prompt where exact (see the module
    docstring); any other cache, or a prefill it cannot serve, goes to ``original`` unchanged."""
    found = vkv_cache_of(model_kwargs)
    if found is None:
        return original(model, input_ids, generation_config, model_kwargs, *args, **kwargs)
    outer, cache = found
    embeds = model_kwargs.get("inputs_embeds")
    rows = input_ids.shape[0]
    tokens = input_ids.shape[-1] or (embeds.shape[1] if isinstance(embeds, torch.Tensor) else 0)  # [B, 0] ids
    reason = _refusal(model, cache, input_ids, model_kwargs)
    if reason is None:
        k = cache.prompt_repeats
        prompts = rows // k
        unique_kwargs = first_of_repeats(model_kwargs, rows, k, keep=outer)
        repeat = outer.batch_repeat_interleave if outer is not cache else None
        past = cache.get_seq_length()  # tokens of the stored prefixes the rows started from (reuse)
        try:
            # the check innermost: a forward it rejects leaves the cache's rows unrepeated and uncounted
            with unique_prompts(cache, prompts=prompts, tokens=tokens, repeat_rows=repeat), \
                    _rows_checked(model, prompts, k, keep=model_kwargs.get("logits_to_keep")) as mode:
                outputs = original(model, input_ids[::k], generation_config, unique_kwargs, *args, **kwargs)
                _check_head_rows(model, outputs, prompts)
        except InexactRows as exc:
            # start again on every row: the rows, one per prompt, go back to the stored prefixes they
            # started from, k per prompt on the same pages (a reused prefix is kept), or to nothing
            if past:
                cache.cut_to(past)
                (repeat or cache.batch_repeat_interleave)(k)
            else:
                outer.reset()
            reason = str(exc)
        else:
            if mode.expanded or mode.partial:
                ran = [f"{mode.expanded} call(s) ran on every row"] if mode.expanded else []
                ran += [f"{mode.partial} call(s) on a few repeats of each prompt"] if mode.partial else []
                cache.prefill_counts.verdict = (f"on; {' and '.join(ran)} (not admitted as exact on one row per "
                                                f"prompt at {torch.get_num_threads()} thread(s))")
            return expand_rows(outputs, prompts, k, keep=outer)  # the logits have `rows` rows already
    if cache.prompt_repeats > 1:  # the whole prompt, less what the cache holds already (stored prefixes)
        cache.prefill_counts.computed += rows * (tokens - cache.get_seq_length())
        cache.prefill_counts.verdict = reason
    return original(model, input_ids, generation_config, model_kwargs, *args, **kwargs)
