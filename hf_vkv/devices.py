"""Device policy, in one place: which backend, page size, layout and budget a device gets.

Backends:

* CPU states → the host backend (memfd pages mapped with ``mmap``);
* CUDA states → the CUDA backend (``cuMemCreate`` pages mapped with ``cuMemMap``), imported only
  here and only then, so ``import hf_vkv`` never touches CUDA. Without ``cuda-bindings`` or an
  NVIDIA driver this raises :class:`~hf_vkv.cuda.driver.CudaUnavailableError` (an ``ImportError``)
  naming ``pip install 'hf_vkv[cuda]'``;
* anything else → :class:`UnsupportedDeviceError`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from dataclasses import dataclass

from .config_values import positive_ints
from .kv_records import PAGED_ATTENTION
from .memory import Arena, HostBackend
from .memory.errors import CacheOptionError, KVCacheOutOfMemory, VKVError
from .memory.limits import mem_available
from .memory.map_budget import PROCESS_MAP_BUDGET, MappingLimitError

__all__ = ["BEAM_TOKEN_MAJOR_MAX_PROMPT", "CASCADE_MIN_SHARED_TOKENS", "CUDA_CREATE_AHEAD", "CUDA_MARGIN_FRACTION", "CUDA_MIN_MARGIN_BYTES",
           "DevicePolicy", "HEAD_MAJOR_BEAM_SUBROW_MAPPINGS", "HEAD_MAJOR_PAGE_BYTES", "HEAD_MAJOR_SHARED_PROMPT_ROWS", "HEAD_MAJOR_SUBROW_MAPPINGS", "HOST_BUDGET_FRACTION", "HOST_PAGE_BYTES", "MAP_AHEAD_TOKENS",
           "MEMORY_LIMIT_MAX_PROMPT", "MEMORY_LIMIT_SLACK", "VIEW_ALIGNMENT_BYTES", "MIN_COMMON_PREFIX", "PAGED_BLOCK_TOKENS", "TOKEN_MAJOR_PAGE_BYTES", "PREFIX_STORE_PAGE_BYTES", "UNKNOWN_NEW_TOKENS", "UnsupportedDeviceError",
           "Workload", "WorkloadError", "arena_for_device", "cascade_refusal", "choose_layout", "default_cuda_budget", "head_major_excess", "head_major_mappings", "head_major_written_pages", "subrow_item_bytes", "default_host_budget", "layer_devices_of", "policy_for"]

#: Fewest tokens a cluster of rows must share for the ``"vkv_cascade"`` attention to read them once,
#: by intra-op threads, then by the rows in the cluster; ``None``: it did not pay at any length
#: measured. A step takes the entry of the most threads <= its own, and a cluster the entry of
#: the most rows <= its own (fewer rows spare fewer re-reads, so an entry never tags a cluster its
#: measurement did not cover). Below it the plain path is as fast or faster. Measured on the CPU
#: (SmolLM2-135M's attention geometry, float32), the fewest shared tokens from which the cascade
#: was faster at every longer length measured:
#:
#: * 4 rows — the larger of 4 beams' whole decode steps (``benchmarks/results/cascade_beams_cpu.json``,
#:   the cascade forced on every shared prefix; a beam's shared prefix is its full common pages)
#:   and one layer's attention. The beams' steps set it: cascade / sdpa 0.99x at 512 shared
#:   tokens (the shortest measured; within the rounds' spread), 0.98x at 1024, 0.89x at 1536 and
#:   2048 at one thread; at two threads 0.98x, 0.98x, 0.93x, 0.92x (the prefix read in parts of
#:   its tokens so that both threads work), where one layer's attention alone pays from 256 / 512;
#: * 2 and 8 rows — one layer's decode attention in sampling's shape (``num_return_sequences``
#:   rows of one prompt, a private suffix each: ``benchmarks/results/cascade_crossover.json`` at
#:   one thread, ``cascade_crossover_t2.json`` at two).
#:
#: ``tests/unit/test_cascade_crossover.py`` derives this table from those files. Not yet measured
#: on CUDA.
CASCADE_MIN_SHARED_TOKENS: dict[int, dict[int, int | None]] = {
    1: {2: 512, 4: 512, 8: 256},
    2: {2: 1536, 4: 512, 8: 256},
}


def cascade_refusal(*, shared_tokens: int, rows: int, threads: int | None = None) -> str | None:
    """Why a cluster of ``rows`` rows sharing their first ``shared_tokens`` tokens is not worth
    reading once at ``threads`` intra-op threads (default: ``torch.get_num_threads()``); ``None``:
    the ``"vkv_cascade"`` attention reads it once. From :data:`CASCADE_MIN_SHARED_TOKENS`."""
    threads = torch.get_num_threads() if threads is None else threads
    by_rows = CASCADE_MIN_SHARED_TOKENS[max((t for t in CASCADE_MIN_SHARED_TOKENS if t <= threads),
                                            default=min(CASCADE_MIN_SHARED_TOKENS))]
    measured = max((r for r in by_rows if r <= rows), default=None)
    if measured is None:
        return f"sdpa: {rows} row(s) share nothing to read once"
    least = by_rows[measured]
    if least is not None and shared_tokens >= least:
        return None
    where = "CASCADE_MIN_SHARED_TOKENS, measured"
    if least is None:
        return (f"sdpa: {rows} rows share {shared_tokens} tokens; reading them once did not pay for {measured}+ rows "
                f"at {threads} thread(s) at any length measured (hf_vkv.devices.{where})")
    return (f"sdpa: {rows} rows share {shared_tokens} tokens; reading them once pays for {measured}+ rows from "
            f"{least} shared tokens at {threads} thread(s) (hf_vkv.devices.{where})")

#: The default CUDA budget leaves this share of the device's memory free for torch (activations,
#: logits, its caching allocator) ...
CUDA_MARGIN_FRACTION = 0.05
#: ... and at least this many bytes.
CUDA_MIN_MARGIN_BYTES = 1 << 30
#: CUDA page handles created per batch when a page needs one and no spare is left (16 x 2 MiB =
#: 32 MiB of device memory): fewer driver calls per step. Not yet measured on a GPU.
CUDA_CREATE_AHEAD = 16

#: With no ``budget_bytes``, a host arena holds at most this share of ``MemAvailable`` (read when
#: the arena is made), so that no option makes vkv take the machine down.
HOST_BUDGET_FRACTION = 0.5

#: Address space a row of a sliding-window group may reserve however small the budget (64 GiB): its
#: pages behind the window are dropped, so the memory budget does not bound its tokens, addresses do
#: (a 64 KiB budget capped a window-8 Mistral at 129 tokens, where it holds 8 KiB whatever the length).
SLIDING_ROW_ADDRESS_BYTES = 1 << 36

#: Host page size of an arena made with no ``page_bytes`` and no layout to ask (layouts state their
#: own: :data:`TOKEN_MAJOR_PAGE_BYTES`, :data:`HEAD_MAJOR_PAGE_BYTES`): decode is flat across
#: 4 KiB .. 2 MiB pages (``benchmarks/page_size_cpu.py``, ``benchmarks/results/page_size_cpu.json``).
HOST_PAGE_BYTES = 256 * 1024
#: Host page size of the token-major layout. A token-major row strands at most one partly written
#: page of its own and a copy of its shared prompt's partly written last page: at 4 KiB less than a
#: tenth of a SmolLM2 token (fp32: 46,080 bytes a token), so a token-major cache holds its tokens'
#: bytes (``benchmarks/memory_limit.py``, ``benchmarks/results/memory_limit_g5_token_major.json``).
#: Decode is flat across 4 KiB .. 2 MiB pages (``benchmarks/results/page_size_cpu.json``).
TOKEN_MAJOR_PAGE_BYTES = 4 * 1024
#: Host page size of the head-major layout (the CPU default): a row strands up to one page per
#: (layer, K/V, head), and 4 KiB head-major pages decode within 1.5 % of an ideal preallocated cache
#: (``benchmarks/page_size_cpu.py``; ``docs/layouts.md``).
HEAD_MAJOR_PAGE_BYTES = 4 * 1024
#: Page size of a prefix store's memory on the CPU when its ``cache_config`` names none (the
#: caches ``generate`` builds with the store draw from the same memory). Measured on
#: SmolLM2-135M (1k stored tokens, 20 new, one thread): 4 KiB pages take 0.05 s to start the rows
#: and a 0.35-0.41 s time to first token; 16 KiB 0.011 s and 0.21 s; 64 KiB 0.007 s and
#: 0.23-0.28 s. A row strands at most one page per (layer, K/V, head): 2.9 MB for SmolLM2 at 16 KiB.
PREFIX_STORE_PAGE_BYTES = 16 * 1024
#: Tokens per block of the paged layout (``benchmarks/paged_cpu.py``, ``docs/paged.md``).
PAGED_BLOCK_TOKENS = 16
#: Longest prompt (tokens) for which CPU beam search gets the token-major layout (the longest
#: measured). Head-major keeps a partly written tail page per (layer, K/V, head) of a row, so when
#: beams diverge each beam copied one page per sub-row; token-major copies one page per row.
#: Measured (``benchmarks/beam_layout_cpu.py``, SmolLM2-135M fp32, 4 beams, 16 new tokens, one
#: thread, median of interleaved rounds, tokens identical to DynamicCache): prompt 45 tokens:
#: DynamicCache 1.41 s, head-major 1.89 s, token-major 1.43 s; 512 tokens: 6.30 s, 6.86 s, 6.19 s.
#: Since beam reorders copy a taken tail into the row's own page, the two layouts' decode steps
#: are within the run-to-run spread (64 tokens: head-major 1.060x DynamicCache's step, token-major
#: 1.065x; 512 tokens 0.970x and 0.968x; ``benchmarks/results/beam_layout_cpu_step_{64,512}.json``),
#: so the rule stands on the wall times above. Longer prompts keep head-major (its decode steps
#: read per-head rows); where the two cross between 512 and ~1k tokens is not measured.
BEAM_TOKEN_MAJOR_MAX_PROMPT = 512
#: Kernel mappings (``vm.max_map_count``) the layout rule counts per (layer, K/V, head) sub-row of
#: a head-major row without beams: its run of shared prompt pages, its own pages (a copy of the
#: prompt's partly written last page, then the pages it grows) and the unmapped rest of its slots,
#: which no neighbour can merge with. A run of own pages breaks where the pool cannot give the
#: next consecutive id (a recycled page, an id another row took); where rows share a prompt, that
#: happens to about one row's sub-rows of the prompt's rows, and to up to ~3.6 rows' worth where
#: the rows fill their reservation, which :data:`HEAD_MAJOR_SHARED_PROMPT_ROWS` adds per shared
#: prompt (:func:`head_major_mappings`).
#: Measured, the most held at any step or asked for by a change (``MapBudget.check``):
#:
#: * SmolLM2-135M, n=96 sampled rows of a 2048-token prompt, 6 new tokens: 51,660 mappings, 2.99
#:   per sub-row (``benchmarks/results/map_budget_step_2048x96_t1.json``);
#: * a 4-layer, 4-KV-head tiny Llama (32 sub-rows a row, 64-token pages;
#:   ``benchmarks/map_budget_layout.py count``, ``benchmarks/results/map_budget_count.json``):
#:   greedy 2.0, n=8 sampling 2.0 / 3.18 / 2.88 at prompts 20 / 100 / 130 with 6 / 60 / 120 new
#:   tokens; token-major at most 2.0 per row of a group in every case;
#: * tiny Llamas of 2 layers x 2 KV heads and 4 x 4, 64- and 16-token pages (head dim 16 / 64,
#:   float32), 799 sampled or greedy calls (n = 1..32 rows of 1, 2 or 4 prompts, left padding,
#:   prompts 60..520 tokens, 1..1000 new tokens, reservations of the model's 2048 positions down to
#:   the call's own length; ``docs/layouts.md#mappings`` has the commands): rows of distinct prompts
#:   at most 2 per sub-row (and the 2 of a change); rows sharing a prompt at most 3 per sub-row plus
#:   1.32 rows' worth of sub-rows per prompt in 2048-position reservations, 3.62 where the rows
#:   fill their reservation (n=2 of 100 tokens, 600 new: 4.69 per sub-row; n=8: 3.45; n=24: 3.15).
#:   That extra stops growing with the new tokens (the same at 600 and 1000).
#:
#: 3 per sub-row: SmolLM2's n=96 keeps head-major and its step (token-major's is ~1.5x there, below).
HEAD_MAJOR_SUBROW_MAPPINGS = 3
#: Rows' worth of sub-rows that the rows sharing one prompt (``prompt_repeats`` > 1) may hold over
#: :data:`HEAD_MAJOR_SUBROW_MAPPINGS` a sub-row: 3.62 measured at most (above), 4 with a margin.
HEAD_MAJOR_SHARED_PROMPT_ROWS = 4
#: Mappings a head-major sub-row holds besides one per page written past its prompt's whole pages:
#: the run of those prompt pages (one prefill wrote them to consecutive ids) and the unmapped rest.
#: So a sub-row holds at most ``2 + ceil((P mod t + G) / t)`` for a P-token prompt and G new tokens
#: of ``t`` tokens a page (:func:`head_major_written_pages`), and a change adds 2 for the moment
#: inside a run (``mapping_change``). This is what beam search reaches: its reorders give a row
#: pages that other rows wrote, so almost every page it writes is a run of its own, and a fixed
#: count per sub-row (4 before) was passed part-way through long calls (48 layers x 8 KV heads,
#: 16 beams, 520-token prompt: ``MappingLimitError`` at step 126 of 300 with vm.max_map_count
#: 65530, 53,796 held). Measured (tiny Llama of 2 layers x 2 KV heads, 64-token pages, the most
#: held or asked for at any step, per sub-row, against the bound; ``docs/layouts.md#mappings``):
#: 16 beams of 70 tokens: 2.95 / 4.95 / 6.02 / 11.02 at 50 / 150 / 300 / 600 new tokens (bound 3 /
#: 5 / 7 / 12); 8 beams, 600 new: 11.91 (12); 16-token pages (SmolLM2's head dim in float32), 16
#: beams of 520 tokens, 300 new: 20.94 (22). Over 370 beam calls (2..16 beams, batches of 1, 2 and
#: 4 prompts, left padding, prompts 63..520 tokens, 1..600 new tokens, 64- and 16-token pages,
#: reservations of 2048 positions or of the call's own length) a call held at most the bound plus
#: the 2 of a change.
HEAD_MAJOR_BEAM_SUBROW_MAPPINGS = 2
#: New tokens a row is counted to write where the workload does not say (``Workload.new_tokens``
#: is ``None``): a context longer than common models reserve, so that beams whose call length is
#: not known get token-major (rule 7 of :func:`choose_layout`) wherever the process has a
#: ``vm.max_map_count``-sized budget, rather than head-major rows that may run out part-way.
UNKNOWN_NEW_TOKENS = 1 << 17
#: Largest share by which a call's KV may exceed its physical limit, the tokens it holds stored
#: once: (prompt + rows x new tokens) tokens for rows sharing one prompt. Where head-major's
#: partly written pages could exceed it, :func:`choose_layout` gives the rows token-major (rule 6,
#: for prompts of at most :data:`MEMORY_LIMIT_MAX_PROMPT` tokens), whose partly written pages are
#: at most two small pages a row (:data:`TOKEN_MAJOR_PAGE_BYTES`).
MEMORY_LIMIT_SLACK = 0.03
#: Longest prompt whose rows rule 6 moves to token-major. Token-major's decode step and time to
#: first token are head-major's up to 512 tokens, and its step is slower at 2048 (SmolLM2-135M,
#: float32, one / two threads, the layouts interleaved, median of 3 rounds;
#: ``benchmarks/memory_limit.py layout-cost``, ``benchmarks/results/memory_limit_layout_cost*.json``):
#: token-major / head-major step 0.98 / 0.96 for n=8 at 512 tokens, 1.03 / 1.04 for n=64,
#: 1.11 / 0.99 for n=2, 0.88 / 1.05 greedy at 128; at 2048, 1.25 / 1.26 for n=8, 1.42 (one
#: thread) for n=32, 1.15 (one thread) greedy. So longer prompts keep head-major and its step,
#: with its partly written pages over the limit (docs/layouts.md#memory-at-the-limit); where the
#: two cross between 512 and 2048 tokens is not measured.
MEMORY_LIMIT_MAX_PROMPT = 512
#: Alignment that a (row, head)'s first key or value must share with DynamicCache's for attention
#: to compute the same bits from a view. DynamicCache hands attention contiguous ``[B, H, T, D]``
#: tensors, whose (row, head) blocks start ``T * D * itemsize`` bytes apart; vkv's head-major
#: blocks start on page boundaries. Torch's CPU attention rounds differently by where its inputs
#: start: SDPA over the same float32 keys and values placed at byte offsets 0, 4, ..., 124 of an
#: aligned buffer gave the bits of offset 0 only at multiples of 16 (this machine: AMD EPYC, AVX2;
#: head dims 24, 36, 50, 64, 80; 13, 100 and 517 tokens; bfloat16 at every offset). So where a
#: head's token of keys or values is not a multiple of this many bytes (a tiny Llama of head dim 50
#: in float32: decode logits 1.2e-7 apart from DynamicCache's), attention gets contiguous copies
#: (:func:`hf_vkv.cache.sources.views_misaligned`), and the static layout, whose views cannot be
#: copies, refuses a capacity that misplaces its blocks. 64, not the 16 measured: the widest
#: vector loads (AVX-512) and torch's own CPU allocation alignment.
VIEW_ALIGNMENT_BYTES = 64
#: Static layout: tokens of every row made writable ahead of the next compiled step when
#: ``cache_config['map_ahead']`` says nothing (``docs/static_compile.md``).
MAP_AHEAD_TOKENS = 32
#: Fewest tokens a prefix shared by a batch's prompts must have to be prefilled once on its own
#: first, with a prefix store (below it the extra forward costs more than the rows it spares).
MIN_COMMON_PREFIX = 32


class UnsupportedDeviceError(VKVError, ValueError):
    """Key/value states arrived on a device no backend of this installation serves."""


class WorkloadError(VKVError, ValueError):
    """A :class:`Workload` field out of range (rows, sub-rows or beams below one)."""


@dataclass(frozen=True, slots=True)
class DevicePolicy:
    """What a cache gets on one device type when ``cache_config`` says nothing.

    * ``backend``: ``"host"`` (memfd pages mapped with ``mmap``) or ``"cuda"`` (driver VMM);
    * ``layout``: the contiguous layout used by default (see :mod:`hf_vkv.cache.layouts` and
      ``docs/layouts.md`` for the measurements behind it);
    * ``budget``: ``"mem-available"`` (a share of the host's ``MemAvailable``:
      :func:`default_host_budget`) or ``"free-memory"``
      (:func:`default_cuda_budget`);
    * ``prefill_once``: whether ``generate``'s prefill runs each repeated prompt once by default
      (:mod:`hf_vkv.generate.prefill_once`): on the CPU, where every prefill proves its calls exact for its
      shapes, dtype and thread count (:mod:`hf_vkv.generate.row_exactness`, a cached probe) and steps aside
      where DynamicCache's own repeats differ; off on CUDA until a GPU run measures the probe's
      cost and verdicts there (the probe itself is device-neutral).

    Page sizes are the layouts' (each states its preferred page size per backend).
    """

    device_type: str
    backend: str
    layout: str
    budget: str
    prefill_once: bool


_POLICIES = {
    "cpu": DevicePolicy(device_type="cpu", backend="host", layout="head_major", budget="mem-available",
                         prefill_once=True),
    "cuda": DevicePolicy(device_type="cuda", backend="cuda", layout="token_major", budget="free-memory",
                          prefill_once=False),
}


def policy_for(device: torch.device | str) -> DevicePolicy:
    """The :class:`DevicePolicy` of ``device``; :class:`UnsupportedDeviceError` for a device no
    backend serves."""
    device = torch.device(device)
    policy = _POLICIES.get(device.type)
    if policy is None:
        raise UnsupportedDeviceError(
            f"key/value states are on {device}, but hf_vkv serves only the host (CPU) and CUDA devices; "
            f"move the model to 'cpu' or 'cuda', or use another cache_implementation"
        )
    return policy


@dataclass(frozen=True, slots=True)
class Workload:
    """What a cache will serve, as far as it is known when the cache is made (``generate``
    knows all of it; a cache made by hand knows its attention at most)."""

    device_type: str | None = None  # None: not known until the first update
    attention: str | None = None  # the model's attention implementation
    num_beams: int = 1
    prompt_tokens: int | None = None
    compiling: bool = False  # generate(..., compile_config=...): the step is compiled
    inherited: str | None = None  # the layout of the memory the cache draws from (a prefix store's; "contiguous": the device's default)
    rows: int | None = None  # rows the cache holds: batch x max(num_beams, num_return_sequences) (None: not known)
    subrows: int | None = None  # (layer, K/V, head) sub-rows of one row: 2 x the KV heads of every layer vkv stores
    mappings_free: int | None = None  # mappings vkv may still add (None: as the process's MapBudget.fits says)
    prompt_repeats: int | None = None  # rows sharing each prompt: max(num_beams, num_return_sequences) (None: not known)
    item_bytes: int | None = None  # bytes of one token in one sub-row: the wider K/V head dim x the dtype's size (None: not known)
    new_tokens: int | None = None  # tokens a row may cache past its prompt: a call's max_new_tokens (None: not known)

    def __post_init__(self) -> None:
        for name in ("num_beams", "rows", "subrows", "prompt_repeats", "item_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise WorkloadError(f"Workload.{name} must be a positive int, got {value!r}")
        value = self.new_tokens
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise WorkloadError(f"Workload.new_tokens must be an int >= 0, got {value!r}")


def choose_layout(asked: str | None, workload: Workload) -> str | None:
    """The one place a cache's layout is decided, called once per cache (at its first update
    for a cache made by hand, whose device is not known before). ``None``: not decided yet
    (the device is not known). The rule, first match wins:

    1. ``asked`` (``cache_config['layout']``) names one: that one (``"contiguous"``: the device's
       default contiguous layout); ``"paged"`` only under the ``"vkv_paged"`` attention, which is
       the only reader of its block tables (:class:`~hf_vkv.CacheOptionError` otherwise);
    2. a compiled step: ``"static"`` (fixed addresses, StaticLayer's contract);
    3. the ``"vkv_paged"`` attention: ``"paged"``;
    4. memory inherited from a prefix store: the store's layout (rows share its entries' pages);
       where that is head-major on the host (the store's own or the default) and the rows would
       need more mappings than rule 7 allows, :class:`~hf_vkv.memory.map_budget.MappingLimitError`
       now (``store_layout``; :func:`_check_store_rows`), naming the store's option
       (``PrefixStore(config, cache_config={'layout': 'token_major'})``), before any prefill
       rather than at a later step; ``generate`` then builds the call's cache without the store
       (rule 7 applies) and its reuse report says why;
    5. CPU beam search over prompts of at most :data:`BEAM_TOKEN_MAJOR_MAX_PROMPT` tokens:
       ``"token_major"``;
    6. memory at the limit: where the device's default is head-major on the host, the prompt has
       at most :data:`MEMORY_LIMIT_MAX_PROMPT` tokens and head-major's partly written pages could
       hold more than :data:`MEMORY_LIMIT_SLACK` over the call's physical limit
       (:func:`head_major_excess`, for any number of new tokens), ``"token_major"``, which
       strands at most two 4 KiB pages a row instead of one page per (layer, K/V, head) sub-row;
    7. rows are limited by memory, never by mappings: where the device's default is head-major
       and its rows would need more kernel mappings than the process has free
       (:func:`head_major_mappings` > ``mappings_free``, by default as
       ``PROCESS_MAP_BUDGET.fits`` says: ``vm.max_map_count`` less its headroom, the rest of
       the process and what vkv holds), ``"token_major"``, which maps at most ~2 ranges per row
       of a group instead of ~3 per (layer, K/V, head) sub-row, and under beams up to one per page
       of each sub-row (so beams count the call's ``new_tokens``, and where those are not known
       :data:`UNKNOWN_NEW_TOKENS`, which gives them token-major);
    8. the device's default (:attr:`DevicePolicy.layout`).

    Rule 6, measured (``benchmarks/memory_limit.py``, SmolLM2-135M float32, default options, 5
    new tokens, ``stats().resident_bytes`` when generate returns;
    ``benchmarks/results/memory_limit_g5*.json``): at 128 tokens token-major holds 0.80-0.99x the
    limit where head-major holds 1.08-2.57x (n = 1..64); at 512 tokens, n >= 2, 0.92-1.00x where
    head-major holds 1.04-1.85x. What it leaves: head-major on prompts over
    :data:`MEMORY_LIMIT_MAX_PROMPT` tokens, whose token-major step is 1.15-1.73x slower (there,
    n = 8..64 sampled rows or 8 beams of 2048 tokens hold 1.04-1.30x the limit, one row 1.005x),
    and one row of 512 tokens (1.02x; a lone row's limit is DynamicCache's).

    Rule 7, measured (``benchmarks/map_budget_layout.py``, SmolLM2-135M: 30 layers x K/V x 3 KV
    heads = 180 sub-rows a row, 540 mappings a row by :data:`HEAD_MAJOR_SUBROW_MAPPINGS` and 720
    more per shared prompt; with ``vm.max_map_count`` 65530 the budget leaves vkv 56,406 in a
    process that loaded the model, so head-major serves up to 103 sampled rows of one prompt (104
    where the new tokens fit in a page), and beam rows as their new tokens allow (float32, 16
    tokens a page, a prompt of a multiple of 16 tokens: 104 rows for 16 new tokens, 34 for 100,
    14 for 300, none where the call does not say); token-major above, whatever the prompt's
    length):

    * n=128 of an 8192-token prompt, bfloat16, 4 new tokens, default options (before: head-major,
      ``MappingLimitError`` at the first decode step, holding 46,080 and needing 22,862 more):
      token-major, 255 mappings held, 212 MiB of KV pages (``stats().resident_bytes``; a
      DynamicCache would hold 22.5 GiB), wall 349 s, time to first token 302 s, decode step 13.6 s
      (2 threads shared with other work; ``benchmarks/results/map_budget_real_8192x128_bf16.json``);
    * what token-major costs where it replaces head-major: n=96 of a 2048-token prompt, float32,
      6 new tokens, one thread, the layouts interleaved over 3 rounds (each run's median step,
      then the median): head-major 1.90 s a step holding 51,660 mappings, token-major 3.17 s
      holding 287 (1.51x; per round 1.79x, 1.51x, 1.43x), the same tokens
      (``benchmarks/results/map_budget_step_2048x96_t1.json``). So the rule switches only where
      head-major cannot run: at 96 rows head-major keeps its step.

    Nothing else moves: a workload head-major serves within its mappings keeps it, so its decode
    step is the one it had. Applies only where nothing was asked or inherited (a prefix store's
    rows must share its entries' layout; a layout named in ``cache_config`` is the user's: past
    the limit it raises :class:`~hf_vkv.memory.map_budget.MappingLimitError`, naming
    token-major)."""
    if asked == "paged" and workload.attention != PAGED_ATTENTION:
        raise CacheOptionError(
            f"cache_config['layout']='paged' is read only by the 'vkv_paged' attention, but the model uses "
            f"{workload.attention!r}: load it with attn_implementation='vkv_paged' (or call "
            f"model.set_attn_implementation('vkv_paged')), or leave 'layout' unset")
    if asked is None:
        if workload.compiling:
            return "static"
        if workload.attention == PAGED_ATTENTION:
            return "paged"
        asked = workload.inherited  # a store's memory: its layout ("contiguous": the device's default)
        if asked is not None and workload.device_type is not None:
            _check_store_rows(asked, workload)
    if asked is not None and asked != "contiguous":
        return asked
    if workload.device_type is None:
        return None
    policy = policy_for(workload.device_type)
    if asked is None and workload.device_type == "cpu" and workload.num_beams > 1 \
            and workload.prompt_tokens is not None and workload.prompt_tokens <= BEAM_TOKEN_MAJOR_MAX_PROMPT:
        return "token_major"
    if asked is None and policy.layout == "head_major" and policy.backend == "host":
        excess = head_major_excess(workload)
        if excess is not None and excess > MEMORY_LIMIT_SLACK and workload.prompt_tokens <= MEMORY_LIMIT_MAX_PROMPT:
            return "token_major"
        if _head_major_overflow(workload) is not None:
            return "token_major"
    return policy.layout


def _head_major_overflow(workload: Workload) -> int | None:
    """The mappings head-major's rows would need (:func:`head_major_mappings`) where that is more
    than the process has free (``workload.mappings_free``, by default as the process budget's
    :meth:`~hf_vkv.memory.map_budget.MapBudget.fits` says); ``None`` where they fit or are not known.
    Rule 7 and rule 4's store check (:func:`_check_store_rows`) both decide by it."""
    needed = head_major_mappings(workload)
    if needed is None:
        return None
    fits = PROCESS_MAP_BUDGET.fits(needed) if workload.mappings_free is None else needed <= workload.mappings_free
    return None if fits else needed


def _check_store_rows(layout: str, workload: Workload) -> None:
    """Rule 4 past rule 7's limit: rows that must take a prefix store's head-major layout (its
    own, or the host's default) and would need more kernel mappings than the process has free
    raise :class:`~hf_vkv.memory.map_budget.MappingLimitError` (``store_layout``) now, when the
    layout is chosen, not at a later step; ``generate`` then runs the call without the store."""
    policy = policy_for(workload.device_type)
    head_major = layout == "head_major" or (layout == "contiguous" and policy.layout == "head_major")
    if workload.num_beams > 1 and workload.new_tokens is None:
        # The store's rows cannot take another layout, and counting UNKNOWN_NEW_TOKENS would refuse
        # the store for every beam call: where the call's length is not known they are checked for
        # their first step, and may meet the limit later (MappingLimitError at that step).
        workload = dataclasses.replace(workload, new_tokens=1)
    needed = _head_major_overflow(workload) if head_major and policy.backend == "host" else None
    if needed is not None:
        budget = PROCESS_MAP_BUDGET
        raise MappingLimitError(needed=needed, held=budget.held, limit=budget.limit, others=budget.others(),
                                headroom=budget.headroom, store_layout=True)


def head_major_excess(workload: Workload, *, page_bytes: int | None = None) -> float | None:
    """The most head-major's partly written pages can add to the KV of ``workload``, as a share
    of its physical limit (rule 6 of :func:`choose_layout`); ``None`` when rows, prompt length,
    prompt repeats or item size are not known.

    A sub-row's pages hold ``t = page_bytes // item_bytes`` tokens (SmolLM2: 16 in float32, 32
    in bfloat16). Each row strands at most ``t - 1`` tokens in its last page of each sub-row, and
    where rows share a prompt whose length ``P`` is not a multiple of ``t``, each row's first write
    copies the prompt's last page: ``P mod t`` prompt tokens more per row. The limit, with ``k``
    prompts of ``rows / k`` rows each and ``G >= 1`` new tokens a row, is at least ``k * P + rows``
    tokens; so the share is at most ``rows * (t - 1 + P mod t) / (k * P + rows)`` for every ``G``
    (the same in bytes: every sub-row's token is ``item_bytes``)."""
    rows, prompt, repeats, item = workload.rows, workload.prompt_tokens, workload.prompt_repeats, workload.item_bytes
    if rows is None or prompt is None or repeats is None or item is None:
        return None
    per_page = max((page_bytes or HEAD_MAJOR_PAGE_BYTES) // item, 1)
    copied = prompt % per_page if repeats > 1 else 0
    prompts = max(rows // repeats, 1)
    return rows * (per_page - 1 + copied) / (prompts * prompt + rows)


def subrow_item_bytes(config: Any, dtype: torch.dtype) -> int | None:
    """Bytes of one token in one head-major sub-row of a model with ``config`` (its text part)
    in ``dtype``: the widest of its key and value head dims over its layers x the dtype's size
    (``None`` where the config names no head dim)."""
    dims = positive_ints(config, "head_dim", "qk_head_dim", "v_head_dim")  # per layer where they differ
    if not dims:
        hidden, heads = positive_ints(config, "hidden_size"), positive_ints(config, "num_attention_heads")
        if not hidden or not heads:
            return None
        dims = [max(hidden) // min(heads)]
    return max(dims) * dtype.itemsize


def head_major_written_pages(workload: Workload) -> int:
    """Pages a head-major sub-row of ``workload`` may write past its prompt's whole pages:
    ``ceil((P mod t + G) / t)`` for a P-token prompt (its partly written last page is copied or
    written on) and G new tokens (``workload.new_tokens``, :data:`UNKNOWN_NEW_TOKENS` where not
    known), ``t`` tokens a :data:`HEAD_MAJOR_PAGE_BYTES` page (one where the item size is not
    known; ``P mod t`` counted as ``t - 1`` where the prompt is not)."""
    per_page = max(HEAD_MAJOR_PAGE_BYTES // workload.item_bytes, 1) if workload.item_bytes else 1
    new = workload.new_tokens if workload.new_tokens is not None else UNKNOWN_NEW_TOKENS
    partial = workload.prompt_tokens % per_page if workload.prompt_tokens is not None else per_page - 1
    return -(-(partial + new) // per_page)


def head_major_mappings(workload: Workload) -> int | None:
    """Kernel mappings the head-major layout's rows may hold for ``workload`` at any step, the 2
    of a change included; ``None`` when rows or sub-rows are not known.

    * At most, whatever the rows do: ``2 + pages written`` a sub-row
      (:data:`HEAD_MAJOR_BEAM_SUBROW_MAPPINGS`, :func:`head_major_written_pages`), every page it
      writes a mapping of its own. Beam search reaches it (its reorders give rows each other's
      pages), so under beams that is the count: it grows with the new tokens, and where those are
      not known it counts :data:`UNKNOWN_NEW_TOKENS`.
    * Without beams, the lesser of that and the measured count: :data:`HEAD_MAJOR_SUBROW_MAPPINGS`
      a sub-row, and :data:`HEAD_MAJOR_SHARED_PROMPT_ROWS` rows' worth more per prompt that rows
      share (``prompt_repeats`` > 1), whatever the new tokens.

    The buffers count exactly and refuse a change past the limit
    (:class:`~hf_vkv.memory.map_budget.MappingLimitError`); this count is what lets the layout rule
    decide before the first step."""
    rows, subrows = workload.rows, workload.subrows
    if rows is None or subrows is None:
        return None
    every_page = rows * subrows * (HEAD_MAJOR_BEAM_SUBROW_MAPPINGS + head_major_written_pages(workload)) + 2
    if workload.num_beams > 1:
        return every_page
    repeats = workload.prompt_repeats or 1
    shared_prompts = -(-rows // repeats) if repeats > 1 else 0
    measured = rows * subrows * HEAD_MAJOR_SUBROW_MAPPINGS + shared_prompts * subrows * HEAD_MAJOR_SHARED_PROMPT_ROWS
    return min(measured, every_page)


def default_host_budget() -> int | None:
    """The budget of a host arena without ``budget_bytes``: :data:`HOST_BUDGET_FRACTION` of
    ``MemAvailable`` now (None, unbounded, where the kernel does not say)."""
    available = mem_available()
    return None if available is None else int(available * HOST_BUDGET_FRACTION)


def default_cuda_budget(free_bytes: int, total_bytes: int) -> int:
    """The KV budget on a CUDA device when ``cache_config`` gives none: the memory the driver
    reports free when the cache first sees the device (``torch.cuda.mem_get_info``; blocks held
    by torch's caching allocator count as used) minus a margin of
    ``max(CUDA_MIN_MARGIN_BYTES, CUDA_MARGIN_FRACTION * total_bytes)`` for torch's own
    allocations during generation. Pages are created on demand up to it, not up front."""
    return free_bytes - max(CUDA_MIN_MARGIN_BYTES, int(CUDA_MARGIN_FRACTION * total_bytes))


def arena_for_device(device: torch.device, *, page_bytes: int | None, budget_bytes: int | None) -> Arena:
    """A new :class:`Arena` for ``device``.

    ``page_bytes`` / ``budget_bytes`` come from ``cache_config``. ``None`` page size: the
    backend's default (host 256 KiB; CUDA the driver's allocation granularity, 2 MiB on
    H100/H200). ``None`` budget: on the CPU
    :func:`default_host_budget` (half of ``MemAvailable``), on CUDA
    :func:`default_cuda_budget`.
    """
    device = torch.device(device)
    if policy_for(device).backend == "host":
        backend = HostBackend(page_bytes=page_bytes or HOST_PAGE_BYTES)
        if budget_bytes is None:  # never unbounded: a share of the memory available now
            budget_bytes = default_host_budget()
        return Arena(backend, budget_bytes=budget_bytes)
    return _cuda_arena(device, page_bytes=page_bytes, budget_bytes=budget_bytes)


def _cuda_arena(device: torch.device, *, page_bytes: int | None, budget_bytes: int | None) -> Arena:
    from .cuda import CudaBackend, Driver  # lazy: the only place the package reaches for CUDA

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    driver = Driver(device.index)  # retains the primary context: released by the backend, or here on failure
    try:
        page = page_bytes or driver.granularity()
        if budget_bytes is None:
            free, total = torch.cuda.mem_get_info(device)
            budget_bytes = default_cuda_budget(free, total)
            if budget_bytes < page:
                raise KVCacheOutOfMemory(requested_bytes=page, free_bytes=max(budget_bytes, 0),
                                         budget_bytes=max(budget_bytes, 0), what=f"one KV page on {device}")
        if budget_bytes < page:
            raise CacheOptionError(f"cache_config['budget_bytes']={budget_bytes:,} is smaller than one page "
                                   f"({page:,} bytes) on {device}: give at least a page, or leave it unset")
        backend = CudaBackend(device, page_bytes=page, max_pages=budget_bytes // page, create_ahead=CUDA_CREATE_AHEAD,
                              driver=driver)
    except BaseException:
        driver.close()
        raise
    return Arena(backend, budget_bytes=budget_bytes)


def model_device(model: Any) -> torch.device | None:
    """The device a model's K/V will live on, where its parameters say it: ``model.device``, or
    ``None`` for parameters on the ``meta`` device (accelerate's ``cpu_offload`` /
    ``disk_offload`` keep the weights elsewhere and move them in at each forward: the K/V live
    where the forward runs, known at the cache's first update)."""
    device = model.device
    return None if device.type == "meta" else device


def layer_devices_of(model: Any) -> dict[int, torch.device] | None:
    """Execution device of each decoder layer when accelerate spread them over several devices.

    Offloaded layers ("cpu"/"disk" in ``hf_device_map``) run on the main device, so their KV
    lives there. Returns ``None`` when every layer runs on one device.
    """
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    accelerators = [_device(d) for d in device_map.values() if d not in ("cpu", "disk")]
    main = accelerators[0] if accelerators else torch.device("cpu")
    out: dict[int, torch.device] = {}
    for name, device in device_map.items():
        found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
        if found:
            out[int(found.group(1))] = main if device in ("cpu", "disk") else _device(device)
    return out if len(set(out.values())) > 1 else None


def _device(name: int | str | torch.device) -> torch.device:
    return torch.device("cuda", name) if isinstance(name, int) else torch.device(name)
