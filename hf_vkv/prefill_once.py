"""Prefill once: ``generate``'s prefill runs each expanded prompt through the model once.

``generate`` repeats every prompt ``k = max(num_beams, num_return_sequences)`` times *before* its
prefill (``_expand_inputs_for_generation``), so a plain prefill computes ``k`` identical copies of
each prompt. With a :class:`~hf_vkv.VKVCache` that shares prompts, :func:`prefill` (the wrapper of
``GenerationMixin._prefill`` that :func:`hf_vkv.registration.register` installs) instead

1. checks that the rows really repeat: ``input_ids`` and every row-indexed input (attention mask,
   position ids, embeddings, encoder outputs, ...) equal in each group of ``k`` rows;
2. runs transformers' own ``_prefill`` (plain or chunked) on one row per prompt, inside
   :meth:`VKVCache.unique_prompt_prefill`, which then repeats each cache row ``k`` times — the
   pages shared, nothing copied;
3. hands ``generate`` the step's outputs expanded to ``k`` rows (``repeat_interleave`` of every
   batch-first tensor: logits, hidden states, attentions, ...).

Why ``_prefill``: it is the one call that runs the prompt's forward in both 5.17 and the newest
transformers (``_sample`` and ``_beam_search`` call it, chunked prefill lives inside it), it takes
``input_ids`` and ``model_kwargs`` after expansion and before any forward, and its result is the
step output ``generate`` reads. Wrapping ``_expand_inputs_for_generation`` instead would hand
``generate`` unexpanded inputs for the decode loop, and wrapping the model's ``forward`` would
catch calls that are not generate's prefill.

Exact: a row of a batch-``B`` forward equals the same row of a batch-``B*k`` forward on the
kernels we test (``torch.equal``; see ``tests/integration/test_prefill_once.py``), so tokens and
logits are DynamicCache's; it is on by default (``cache_config={"prefill_once": False}`` turns it
off). Where it cannot apply — rows that differ, a model in training mode (dropout differs per row),
mixture-of-experts models (an expert's matmul size depends on the batch) — the prefill runs on every row as before and
:meth:`VKVCache.stats` says why (``prefill_once``).
"""

from __future__ import annotations

from typing import Any

import torch

from .cache import VKVCache
from .cache.encoder_decoder import VKVEncoderDecoderCache

__all__ = ["prefill", "expand_rows", "first_of_repeats", "repeats_refusal"]

#: Keys of ``model_kwargs`` that are not indexed by row although they are tensors.
_NOT_ROWS = frozenset({"cache_position", "logits_to_keep"})
#: Fewest rows a matmul may have for a row of it to equal the same row in a matmul of more rows.
#: Measured on the CPU (MKL / oneDNN, fp32 and bf16): 1-3 rows take another kernel and round
#: differently, from 4 rows on every row is bit-identical (``tests/unit/test_prefill_rows.py``
#: checks this premise). The prompt's forward has ``prompts x tokens`` rows per matmul; the output
#: head, which sees one token per row, runs on every expanded row (see :func:`prefill`).
MIN_EXACT_ROWS = 4
#: Config attributes of mixture-of-experts models: each expert multiplies the tokens routed to it,
#: so its matmul has fewer rows when the forward has fewer (and rounds differently below
#: MIN_EXACT_ROWS: DeepSeek-V3 and GPT-OSS gave logits 4.8e-7 apart), and with an expert capacity
#: rows compete for it.
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "expert_capacity", "moe_num_experts")


def _vkv_cache(model_kwargs: dict) -> tuple[Any, VKVCache] | None:
    """``(the cache generate passes, its VKVCache part)`` or ``None`` for any other cache."""
    for name in ("cache", "past_key_values"):
        outer = model_kwargs.get(name)
        if outer is not None:
            inner = outer.self_attention_cache if isinstance(outer, VKVEncoderDecoderCache) else outer
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


def repeats_refusal(input_ids: torch.Tensor, model_kwargs: dict, k: int) -> str | None:
    """Why the rows of ``input_ids`` ``[B*k, T]`` and of the row-indexed ``model_kwargs`` are not
    ``B`` prompts each repeated ``k`` times in a row (``None``: they are)."""
    rows = input_ids.shape[0]
    if rows % k:
        return f"{rows} rows are not a multiple of {k}"
    named = [("input_ids", input_ids)] + [(key, t) for key, v in model_kwargs.items() if key not in _NOT_ROWS
                                          for t in _tensors(v)]
    for key, t in named:
        if t.dim() == 0 or t.shape[0] != rows:
            continue
        grouped = t.reshape(rows // k, k, *t.shape[1:])
        if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
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


def first_of_repeats(value: Any, rows: int, k: int, *, keep: Any = None) -> Any:
    """``value`` with every row-indexed tensor (first dim ``rows``) cut to the first row of each
    ``k`` (``[::k]``), containers rebuilt (:func:`_map_rows`)."""
    return _map_rows(value, rows, lambda t: t[::k], keep)


def expand_rows(value: Any, rows: int, k: int, *, keep: Any = None) -> Any:
    """The inverse for outputs: every tensor with first dim ``rows`` repeated ``k`` times per row
    (``repeat_interleave``), containers rebuilt (:func:`_map_rows`)."""
    return _map_rows(value, rows, lambda t: t.repeat_interleave(k, dim=0), keep)


def copy_mapping(value: dict) -> dict:
    """A shallow copy of a dict or ModelOutput of the same class."""
    if type(value) is dict:
        return dict(value)
    out = type(value).__new__(type(value))
    dict.update(out, value)
    out.__dict__.update(vars(value))
    return out


def _fewest_tokens(tokens: int, generation_config: Any) -> int:
    """The fewest tokens one forward of the prefill runs (the last chunk of a chunked prefill)."""
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if not chunk or chunk >= tokens:
        return tokens
    return min(chunk, tokens % chunk or chunk)


def _refusal(model: Any, cache: VKVCache, input_ids: torch.Tensor, tokens: int, generation_config: Any,
             model_kwargs: dict) -> str | None:
    reason = cache.prefill_once_refusal(input_ids.device)
    if reason is not None:
        return reason
    if model.training:
        return "the model is in training mode (dropout differs per row)"
    if model.get_output_embeddings() is None:
        return "the model has no output embedding layer to run on every row"
    prompts = input_ids.shape[0] // cache.prompt_repeats
    smallest = prompts * _fewest_tokens(tokens, generation_config)
    if smallest < MIN_EXACT_ROWS:
        return (f"a forward of {smallest} token row(s) (prompts x tokens) rounds differently from the same rows in "
                f"a larger batch; prefill once needs at least {MIN_EXACT_ROWS}")
    config = model.config.get_text_config(decoder=True)
    experts = [name for name in _EXPERTS if getattr(config, name, None)]
    if experts:
        return (f"a mixture-of-experts model ({experts[0]}={getattr(config, experts[0])}): an expert's matmul size "
                f"depends on how many rows the forward has")
    return repeats_refusal(input_ids, model_kwargs, cache.prompt_repeats)


def prefill(original: Any, model: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
            *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin._prefill`` (``original``) run once per prompt where exact (see the module
    docstring); any other cache, or a prefill it cannot serve, goes to ``original`` unchanged."""
    found = _vkv_cache(model_kwargs)
    if found is None:
        return original(model, input_ids, generation_config, model_kwargs, *args, **kwargs)
    outer, cache = found
    embeds = model_kwargs.get("inputs_embeds")
    rows = input_ids.shape[0]
    tokens = input_ids.shape[-1] or (embeds.shape[1] if isinstance(embeds, torch.Tensor) else 0)  # [B, 0] ids
    reason = _refusal(model, cache, input_ids, tokens, generation_config, model_kwargs)
    if reason is not None:
        if cache.prompt_repeats > 1:
            cache.record_full_prefill(reason, rows=rows, tokens=tokens)
        return original(model, input_ids, generation_config, model_kwargs, *args, **kwargs)
    k = cache.prompt_repeats
    prompts = rows // k
    unique_kwargs = first_of_repeats(model_kwargs, rows, k, keep=outer)
    repeat = outer.batch_repeat_interleave if outer is not cache else None

    def every_row(module: Any, args: tuple) -> tuple | None:
        # the output head reads one token per row: on `prompts` rows a matmul of 1-3 rows would round
        # differently from DynamicCache's (MIN_EXACT_ROWS), so it runs on all `rows`, as DynamicCache's does
        hidden = args[0]
        return (hidden.repeat_interleave(k, dim=0), *args[1:]) if hidden.shape[0] == prompts else None

    head = model.get_output_embeddings().register_forward_pre_hook(every_row)
    try:
        with cache.unique_prompt_prefill(prompts=prompts, tokens=tokens, repeat_rows=repeat):
            outputs = original(model, input_ids[::k], generation_config, unique_kwargs, *args, **kwargs)
    finally:
        head.remove()
    return expand_rows(outputs, prompts, k, keep=outer)  # the logits have `rows` rows already
