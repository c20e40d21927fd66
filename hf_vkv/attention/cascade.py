"""The ``"vkv_cascade"`` attention: a shared prefix read once per decode step (cascade attention).

Rows whose page tables share a prefix (one prompt's ``num_return_sequences`` rows, beams, forks)
hold the same keys and values there. For a decode step (one query per row) this attention splits
each cluster of such rows (:class:`~hf_vkv.kv_records.SharedPrefix`, tagged on the
keys by the cache) in two:

* the shared prefix ``[0, P)``, read **once**, with the queries of all the cluster's rows (and all
  query heads of a key head) stacked into one matmul — ``[Hkv, n*G, D] @ [Hkv, D, P]``;
* each row's own suffix ``[P, T)``, read per row;

and merges the two softmaxes by their log-sum-exp (:func:`merge_partials`), as vLLM v1's cascade
attention, FlashInfer's shared-prefix decode and Hydragen do. Everything else — prefill, several
new tokens, rows in no cluster, untagged keys, dropout, ``output_attentions``, a position bias,
a mask that differs over a cluster's prefix — goes to transformers' sdpa attention unchanged.

This reorders the float sums of attention, so it is opt-in: ``attn_implementation="vkv_cascade"``
(the door is the attention implementation because the computation that changes is attention's;
``cache_implementation="vkv"`` then tags the shared prefix). The A/B harness reports its max
|Δlogit| against DynamicCache; tokens must stay identical. Sums run in float32 for half-precision
inputs (in float64 for float64 ones). Float32 on the CPU without a mask reads each part in one
fused pass (torch's CPU flash kernel, which returns the log-sum-exp the merge needs, as sdpa's own
kernel); other inputs take a matmul-softmax-matmul in float32 (or float64). The common step — one
cluster of every row (a prompt's samples, beams), no mask, float32 on the CPU — is two calls of
that kernel (the stacked prefix, the rows' suffixes) and one merge, returned as is; at several
threads the prefix goes into its call as parts of its tokens, so that the kernel's (batch, head)
pairs spread evenly over the threads (:func:`_prefix_splits`). The cache tags a cluster only from the measured crossover of shared
tokens by rows and threads (:func:`~hf_vkv.devices.cascade_refusal`), below which the plain path is
as fast.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .errors import UnsupportedModelError
from ..kv_records import CASCADE_ATTENTION, Cluster, SharedPrefix, record_of
from .support import model_type_of

__all__ = ["attend_part", "cascade_decode", "merge_partials", "vkv_cascade_attention"]


def attend_part(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part of the keys, with its log-sum-exp.

    Args:
        query: ``[..., m, D]`` (any leading batch dims shared with ``key``/``value``).
        key, value: ``[..., n, D]`` / ``[..., n, Dv]``.
        mask: bool, broadcastable to ``[..., m, n]`` (True = attend), or ``None``.
    Returns:
        ``(out [..., m, Dv], lse [..., m])`` in float32 (float64 for float64 inputs); a query with
        nothing to attend to in this part has ``lse = -inf`` and ``out = 0``.
    """
    sums = torch.promote_types(query.dtype, torch.float32)  # float64 stays float64
    if key.shape[-2] == 0:  # an empty part: nothing to attend to
        shape = torch.broadcast_shapes(query.shape[:-2], value.shape[:-2])
        return (query.new_zeros(*shape, query.shape[-2], value.shape[-1], dtype=sums),
                query.new_full((*shape, query.shape[-2]), float("-inf"), dtype=sums))
    if mask is None and _fused(query, key, value):
        return _fused_part(query, key, value, scale=scale)
    scores = torch.matmul(query.to(sums), key.to(sums).transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # nothing to attend to: exp gives 0
    weights = scores.sub_(top).exp_()  # one exp pass: the softmax's numerators
    total = weights.sum(dim=-1)
    out = torch.matmul(weights, value.to(sums)).div_(total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1))
    return out, top.squeeze(-1) + torch.log(total)


#: torch's fused CPU attention kernel (the one sdpa runs on the CPU), which also returns the
#: log-sum-exp; ``None`` where this torch has none
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether torch's CPU flash kernel serves these inputs as :func:`_whole_batch` passes them
    (``[B, H, L, D]``, the query's heads a multiple of the keys'): float32 on the CPU (its sums
    are float32; a half-precision output would be rounded before the merge), one head size."""
    return (_CPU_FLASH is not None and query.dtype == key.dtype == value.dtype == torch.float32
            and query.device.type == "cpu" and query.shape[-1] == key.shape[-1] == value.shape[-1])


def _fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`_fused_part` serves these inputs: :func:`_flash_serves`, and 2-4 dims with
    batch dims of equal size (the kernel's premise)."""
    return (_flash_serves(query, key, value) and 2 <= query.dim() <= 4 and query.dim() == key.dim() == value.dim()
            and query.shape[:-2] == key.shape[:-2] == value.shape[:-2])


def _fused_part(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_part` without a mask, in one fused pass over the keys and values (torch's CPU
    flash kernel: blocks of keys, an online softmax, float32 sums), which never materialises the
    ``[..., m, n]`` scores. Same contract and shapes as :func:`attend_part`."""
    lead = query.shape[:-2]
    four = (4 - query.dim()) * (1,)  # the kernel takes [B, H, m, D]
    out, lse = _CPU_FLASH(query.reshape(*four, *query.shape), key.reshape(*four, *key.shape),
                          value.reshape(*four, *value.shape), scale=scale)
    return out.reshape(*lead, *out.shape[-2:]), lse.reshape(*lead, lse.shape[-1])


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                   finite: bool = False) -> torch.Tensor:
    """Attention over two disjoint parts of the keys, merged: ``[..., m, Dv]`` from each part's
    ``(out [..., m, Dv], lse [..., m])`` (:func:`attend_part`, any strides). Rows with nothing to
    attend to in either part give 0.

    Part a's share of the softmax is ``exp(lse_a) / (exp(lse_a) + exp(lse_b)) =
    sigmoid(lse_a - lse_b)``, so the merge is one interpolation ``out_b + share * (out_a - out_b)``
    (a part with ``lse = -inf`` gets share 0; both empty: share 1/2 of two zeros).
    ``finite``: the caller knows no ``lse`` is ``-inf`` (no mask, both parts non-empty), which
    spares the guard against ``-inf - -inf``; the result is the same."""
    diff = lse_a - lse_b
    share = torch.sigmoid(diff if finite else diff.nan_to_num_(nan=0.0)).unsqueeze(-1)
    return torch.lerp(out_b, out_a, share)


def _cluster_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, cluster: Cluster) -> torch.Tensor:
    """``[n, Hq, 1, Dv]`` float32 attention of one cluster's ``n`` rows (see the module docstring)."""
    n, p = len(cluster.index), cluster.tokens
    first = cluster.index[0]
    rows: slice | list[int] = slice(first, first + n) if cluster.consecutive else list(cluster.index)
    hkv, d = key.shape[1], query.shape[-1]
    g = query.shape[1] // hkv
    q = query[rows].reshape(n, hkv, g, d)  # [n, Hkv, G, D]
    # the prefix once: every row's query heads of a key head stacked, [Hkv, n*G, D] @ [Hkv, D, P]
    prefix_mask = None if mask is None else mask[first, 0, -1, :p]  # [P]: the cluster agrees on it
    out_p, lse_p = attend_part(q.transpose(0, 1).reshape(hkv, n * g, d), key[first, :, :p], value[first, :, :p],
                               scale=scale, mask=prefix_mask)
    # each row's own suffix, [n, Hkv, G, D] @ [n, Hkv, D, T - P]
    suffix_mask = None if mask is None else mask[rows][:, :, -1:, p:]  # [n, 1, 1, T - P]
    out_s, lse_s = attend_part(q, key[rows][:, :, p:], value[rows][:, :, p:], scale=scale, mask=suffix_mask)
    merged = merge_partials(out_p.reshape(hkv, n, g, -1).transpose(0, 1), lse_p.reshape(hkv, n, g).transpose(0, 1),
                            out_s, lse_s, finite=mask is None and 0 < p < key.shape[2])
    return merged.reshape(n, hkv * g, 1, -1)


#: Fewest shared tokens in each part when :func:`_whole_batch` splits the prefix over threads
MIN_SPLIT_TOKENS = 256


def _prefix_splits(kv_heads: int, tokens: int, threads: int) -> int:
    """Parts :func:`_whole_batch` cuts the prefix into along its tokens so that torch's CPU flash
    kernel, which shares out (batch, head) pairs among its threads, has a multiple of ``threads``
    of them: ``kv_heads`` key heads (3 in SmolLM2) over 2 threads leave one thread idle a third of
    the time; 2 parts give 6 pairs. 1 at one thread, or when a part would hold fewer than
    :data:`MIN_SPLIT_TOKENS` tokens or the tokens do not divide evenly."""
    splits = threads // math.gcd(kv_heads, threads)
    while splits > 1 and (tokens % splits or tokens // splits < MIN_SPLIT_TOKENS):
        splits -= 1
    return splits


def _whole_batch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, p: int) -> torch.Tensor:
    """:func:`_cluster_decode` of one cluster of every row, float32 on the CPU without a mask,
    ``0 < p < T`` (a prompt's samples, beams: every decode step), in the fewest operations: the
    prefix and the suffix each in one call of torch's CPU flash kernel, one merge. ``[B, Hq, 1, Dv]``.

    At several threads the prefix is read as :func:`_prefix_splits` parts of its tokens (one more
    batch dim of the same call, the stacked queries broadcast over it), merged with the suffix in
    one softmax over the parts' log-sum-exps.
    """
    n, hq, _, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    q = query.reshape(n, hkv, g, d)
    stacked = q.transpose(0, 1).reshape(1, hkv, n * g, d)
    out_s, lse_s = _CPU_FLASH(q, key[:, :, p:], value[:, :, p:], scale=scale)  # [n, Hkv, G, Dv], [n, Hkv, G]
    splits = _prefix_splits(hkv, p, torch.get_num_threads())
    if splits == 1:
        out_p, lse_p = _CPU_FLASH(stacked, key[:1, :, :p], value[:1, :, :p], scale=scale)  # [1, Hkv, n*G, Dv]
        merged = merge_partials(out_p.view(hkv, n, g, -1).transpose(0, 1), lse_p.view(hkv, n, g).transpose(0, 1),
                                out_s, lse_s, finite=True)  # both parts non-empty, no mask: no -inf
        return merged.reshape(n, hq, 1, -1)
    parts = (splits, p // splits)  # [Hkv, P, D] seen as [splits, Hkv, P / splits, D]: a view
    out_p, lse_p = _CPU_FLASH(stacked.expand(splits, -1, -1, -1), key[0, :, :p].unflatten(1, parts).transpose(0, 1),
                              value[0, :, :p].unflatten(1, parts).transpose(0, 1), scale=scale)
    lse = torch.cat([lse_p.reshape(splits, hkv, n, g).transpose(1, 2), lse_s.unsqueeze(0)])  # [splits + 1, n, Hkv, G]
    share = torch.softmax(lse, dim=0).unsqueeze_(-1)  # each part's share of the softmax
    out = out_s * share[splits]
    for i in range(splits):
        out.addcmul_(out_p[i].view(hkv, n, g, -1).transpose(0, 1), share[i])
    return out.reshape(n, hq, 1, -1)


def cascade_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: torch.Tensor | None,
                   scale: float, prefix: SharedPrefix) -> torch.Tensor:
    """Decode attention with each cluster's shared prefix read once.

    Args:
        query: ``[B, Hq, 1, D]``.
        key, value: ``[B, Hkv, T, D]`` / ``[B, Hkv, T, Dv]`` (``Hq % Hkv == 0``); rows of a
            cluster hold the same keys and values over its prefix.
        mask: bool ``[B, 1, 1, T]`` (True = attend) agreeing over each cluster's prefix, or
            ``None`` (every token; a decode query sees all of them).
        prefix: the clusters (every row not in one is in ``prefix.alone``).
    Returns:
        ``[B, Hq, 1, Dv]`` in the query's dtype, rows in none of the clusters left as zeros (the
        caller computes them). One cluster of every row (a prompt's samples, beams) is returned
        as computed, without a copy into a zeroed output.
    """
    clusters = prefix.clusters
    if len(clusters) == 1 and not prefix.alone and clusters[0].index[0] == 0 and clusters[0].consecutive:
        p = clusters[0].tokens
        if mask is None and 0 < p < key.shape[2] and _flash_serves(query, key, value):
            return _whole_batch(query, key, value, scale, p)
        return _cluster_decode(query, key, value, mask, scale, clusters[0]).to(query.dtype)
    out = query.new_zeros(*query.shape[:-1], value.shape[-1])
    for cluster in clusters:
        result = _cluster_decode(query, key, value, mask, scale, cluster).to(query.dtype)
        if cluster.consecutive:
            out[cluster.index[0]:cluster.index[0] + len(cluster.index)] = result
        else:
            out[list(cluster.index)] = result
    return out


def vkv_cascade_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The transformers attention contract, with shared prefixes read once (module docstring).

    Args:
        query: ``[B, Hq, q, D]``.
        key, value: ``[B, Hkv, kv, D]``, possibly tagged with a :class:`SharedPrefix`.
        attention_mask: ``sdpa_mask``'s bool ``[B, 1, q, kv]`` or ``None``.
    Returns:
        ``([B, q, Hq, Dv], None)`` as transformers' sdpa attention.
    Raises:
        UnsupportedModelError: attention sinks or logit softcapping (not computed here).
    """
    for name, feature in (("s_aux", "attention sinks (s_aux) are"), ("softcap", "attention logit softcapping is")):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                model_type=model_type_of(getattr(module, "config", None), type(module).__name__),
                feature=f"{feature} not part of the cascade attention", attention=CASCADE_ATTENTION)
    prefix = record_of(key, SharedPrefix)
    plain = (
        prefix is None or query.shape[2] != 1 or dropout > 0 or kwargs.get("output_attentions")
        or kwargs.get("position_bias") is not None or query.shape[0] != key.shape[0]
        or (attention_mask is not None and (attention_mask.dtype != torch.bool or not prefix.mask_agrees(attention_mask)))
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefix.mark_read()
    out = cascade_decode(query, key, value, mask=attention_mask, scale=scale, prefix=prefix)  # [B, Hq, 1, Dv]
    out = out.transpose(1, 2)
    if prefix.alone:
        rows = list(prefix.alone)
        mask = None if attention_mask is None else attention_mask[rows]
        alone, _ = sdpa_attention_forward(module, query[rows], key[rows], value[rows], mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        out[rows] = alone.to(out.dtype)
    return out.contiguous(), None
