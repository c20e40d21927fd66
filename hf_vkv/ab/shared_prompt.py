"""The shared-prompt benchmark: time to first token and decode step of ``generate()``
when its rows share one prompt (n=8 sampling, 4 beams), greedy beside them.

A cell is a prompt length x a workload (:data:`WORKLOADS`, the generation arguments of
:data:`hf_vkv.ab.bench.MODES`). One random prompt (``[1, P]``, :func:`~hf_vkv.ab.bench.prompt_ids`)
is generated from with ``max_new_tokens = 1 + decode_steps`` (``min_new_tokens`` the same, so no
row stops early) by each cache of :data:`CACHES`:

* ``dynamic``: ``DynamicCache`` (generate expands the prompt to N rows and prefills all of them);
* ``vkv``: the cache ``cache_implementation="vkv"`` builds (``VKVCache.for_generate``), prefill
  once on as by default;
* ``vkv_cascade``: the same cache read by the ``"vkv_cascade"`` attention (shared-prefix decode
  attention), when that name is registered with transformers' ``AttentionInterface`` (else the
  column is skipped and the report says why);
* ``ideal``: TTFT, a one-row ``DynamicCache`` generate of the prompt (one row's prefill per unique
  prompt, the limit of prefill once: 1/N of DynamicCache's rows); decode, the benchmark's
  :class:`~hf_vkv.ab.ideal.IdealCache` (K/V preallocated, narrow views) holding that prefill's
  first ``P - 1`` tokens in all N rows, generating the workload (its first forward is the prompt's
  last token; beams reorder it by copying, as DynamicCache is reordered). It is the contiguous
  ideal cache: each row reads its own copy of the prompt.

**Timing** (:data:`METHOD`): a :class:`~hf_vkv.ab.probes.StepProbe` in ``logits_processor``
marks each step; TTFT is step 0 (from the ``generate()`` call to the first logits: set-up,
prefill, output head), a decode step is the time between two probe calls (token choice, cache
reorder, one forward). Per run: the median decode step; per cache: the median over ``rounds``
rounds of TTFT and of that median. The caches run interleaved (a round runs each cache once, the
ideal first, the others rotated by round), on ``threads`` intra-op threads.

**Checks**: each run's sequences and per-step logits against the reference (DynamicCache; where
DynamicCache was skipped, vkv): tokens identical, share of equal generated tokens, max
|Δlogit|. DynamicCache is skipped in a cell when ``dynamic_limit_s`` is set and N x the ideal's
measured one-row TTFT exceeds it (the skip and the estimate are recorded); DynamicCache and the
ideal cache, which hold a copy of the prompt per row, are skipped where that K/V exceeds the
memory available (recorded too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from .bench import mode_kwargs, prompt_ids
from .decode import Prompt, load_prompt
from .ideal import IdealCache
from ..kv_records import CASCADE_ATTENTION
from ..generate import cache_kwarg
from ..memory.errors import ArgumentError
from .probes import StepProbe, kv_bytes_per_token

__all__ = [
    "CACHES", "CASCADE_ATTENTION", "DEFAULT_PROMPTS", "METHOD", "SHARED_PROMPT_SCHEMA_VERSION", "WORKLOADS",
    "SharedPromptGrid", "cascade_attention_available", "format_shared_prompt", "run_shared_prompt",
    "shared_prompt_report",
]

SHARED_PROMPT_SCHEMA_VERSION = "hf_vkv.shared_prompt/1"
#: Every cache a cell can time, in report order.
CACHES = ("dynamic", "vkv", "vkv_cascade", "ideal")
#: The workloads: n=8 sampling, 4 beams, greedy (one row).
WORKLOADS = ("sample8", "beam4", "greedy")
#: The prompt lengths of the shared-prompt grid.
DEFAULT_PROMPTS = (512, 2048, 8192)
#: How the numbers are taken (written into the JSON).
METHOD = (
    "one generate() per cache per round, max_new_tokens = min_new_tokens = 1 + decode_steps, a StepProbe in "
    "logits_processor: TTFT = from the generate() call to the first logits (set-up, prefill, output head); "
    "decode step = time between two probe calls (token choice, cache reorder, one forward), median over the "
    "run's decode steps; per cache the median over rounds; caches interleaved in one process (ideal first, "
    "the others rotated by round). Ideal TTFT: a one-row DynamicCache generate of the prompt "
    "(max_new_tokens=1); ideal decode: IdealCache (hf_vkv/ab/ideal.py) preloaded with that prefill's first "
    "P-1 tokens in all rows, generating the workload (first forward = the last prompt token)."
)


def cascade_attention_available() -> bool:
    """Whether ``"vkv_cascade"`` is registered with transformers' ``AttentionInterface``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return CASCADE_ATTENTION in ALL_ATTENTION_FUNCTIONS


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedPromptGrid:
    """What to run: every prompt length x workload, with ``caches`` (``dynamic`` among them).

    ``dynamic_limit_s``: skip DynamicCache in a cell whose estimated run (rows x the ideal's
    one-row TTFT of the first round) exceeds it (``None``: never skip).
    """

    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPTS
    workloads: tuple[str, ...] = WORKLOADS
    decode_steps: int = 8
    rounds: int = 3
    caches: tuple[str, ...] = CACHES
    dynamic_limit_s: float | None = None
    seed: int = 1234
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.prompt_lengths or any(isinstance(p, bool) or not isinstance(p, int) or p < 2
                                          for p in self.prompt_lengths):
            raise ArgumentError(f"prompt_lengths must be ints >= 2, got {self.prompt_lengths!r}")
        for name, low in (("decode_steps", 1), ("rounds", 1), ("threads", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        if not self.workloads:
            raise ArgumentError("workloads must not be empty")
        for workload in self.workloads:
            mode_kwargs(workload)  # ValueError naming it
        if not self.caches or set(self.caches) - set(CACHES):
            raise ArgumentError(f"caches must be some of {list(CACHES)}, got {list(self.caches)!r}")
        if "dynamic" not in self.caches:
            raise ArgumentError("caches must include 'dynamic' (the reference of tokens and logits)")
        if self.dynamic_limit_s is not None and not self.dynamic_limit_s > 0:
            raise ArgumentError(f"dynamic_limit_s must be > 0 seconds or None, got {self.dynamic_limit_s!r}")

    def cells(self) -> list[tuple[int, str]]:
        """``(prompt_length, workload)`` in run order."""
        return [(p, w) for p in self.prompt_lengths for w in self.workloads]


# --------------------------------------------------------------------------------------- runs
@dataclass(slots=True)
class _Run:
    """One generate() of one cache: its times and outputs (CPU)."""

    ttft_s: float
    step_s: float | None  # median decode step
    sequences: torch.Tensor  # [rows, P + new]
    logits: list[torch.Tensor]  # per step [rows, vocab]
    kv_peak_bytes: int
    stats: dict[str, Any] | None = None  # vkv: prefill-once figures


@dataclass(slots=True)
class _Column:
    """A cache's rounds in one cell."""

    ttft_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    runs: list[_Run] = field(default_factory=list)


@contextlib.contextmanager
def _attention(model: PreTrainedModel, name: str | None) -> Iterator[None]:
    """The model's attention implementation set to ``name`` (``None``: unchanged), then restored."""
    if name is None:
        yield
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _generate(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, *, new_tokens: int, seed: int,
              pad_token_id: int | None, **kwargs: Any) -> _Run:
    """``generate`` ``new_tokens`` tokens from ``ids`` ``[1, P]`` into ``cache``, timed by a probe."""
    probe = StepProbe(cache)
    torch.manual_seed(seed)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collection inside a timed step
    try:
        probe.start()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(): cache},
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_token_id,
                                 logits_processor=LogitsProcessorList([probe]), output_logits=True,
                                 return_dict_in_generate=True, **kwargs)
    finally:
        if gc_was_enabled:
            gc.enable()
    steps = probe.times[1:]
    return _Run(ttft_s=probe.times[0], step_s=statistics.median(steps) if steps else None,
                sequences=out.sequences.cpu(), logits=[x.float().cpu() for x in out.logits],
                kv_peak_bytes=max(probe.kv_bytes))


def _run_cache(model: PreTrainedModel, name: str, ids: torch.Tensor, workload: str, *, decode_steps: int, seed: int,
               pad_token_id: int | None) -> _Run:
    """One round of cache ``name`` (see the module docstring)."""
    kwargs = mode_kwargs(workload)
    rows = max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    common = dict(seed=seed, pad_token_id=pad_token_id)
    if name == "ideal":
        return _ideal_run(model, ids, rows, workload, decode_steps=decode_steps, **common)
    if name == "dynamic":
        return _generate(model, ids, DynamicCache(config=model.config), new_tokens=1 + decode_steps, **common,
                         **kwargs)
    from ..cache import VKVCache

    with _attention(model, CASCADE_ATTENTION if name == "vkv_cascade" else None):
        # built under the attention it is read by: a cache tags shared prefixes for the attention it was built for
        # the workload generate's own cache would see (the layout rule reads it)
        cache = VKVCache.for_generate(model, batch_size=1, expand=rows, max_length=ids.shape[1] + decode_steps + 1,
                                      cache_config=None, num_beams=kwargs.get("num_beams", 1),
                                      prompt_tokens=ids.shape[1])
        try:
            run = _generate(model, ids, cache, new_tokens=1 + decode_steps, **common, **kwargs)
            s = cache.stats()
            run.stats = dict(prompt_tokens_computed=s.prompt_tokens_computed, prompt_tokens_saved=s.prompt_tokens_saved,
                             prefill_once=s.prefill_once, cascade=s.cascade)
        finally:
            cache.close()
    return run


def _ideal_run(model: PreTrainedModel, ids: torch.Tensor, rows: int, workload: str, *, decode_steps: int, seed: int,
               pad_token_id: int | None) -> _Run:
    """TTFT of one row's prefill; decode of an :class:`IdealCache` preloaded with it (module docstring)."""
    one = DynamicCache(config=model.config)
    first = _generate(model, ids, one, new_tokens=1, seed=seed, pad_token_id=pad_token_id, do_sample=False)
    one.crop(-1)  # P - 1 tokens: the ideal run's first forward is the prompt's last token
    prompt = Prompt(keys=tuple(layer.keys for layer in one.layers), values=tuple(layer.values for layer in one.layers),
                    first_tokens=first.sequences[:, -1])
    ideal = IdealCache(model.config, capacity=ids.shape[1] + decode_steps + 1)
    load_prompt({"ideal": ideal}, prompt, rows)
    del one, prompt
    run = _generate(model, ids, ideal, new_tokens=1 + decode_steps, seed=seed, pad_token_id=pad_token_id,
                    **mode_kwargs(workload))
    run.ttft_s = first.ttft_s
    return run


# -------------------------------------------------------------------------------------- cells
def _order(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order: the ideal first (its one-row TTFT sizes DynamicCache's skip), the
    others rotated by the round."""
    rest = [n for n in names if n != "ideal"]
    k = r % len(rest)
    return (["ideal"] if "ideal" in names else []) + rest[k:] + rest[:k]


def _compare(run: _Run, ref: _Run) -> dict[str, Any]:
    """Tokens identical, share of equal generated tokens, max |Δlogit| of ``run`` against ``ref``."""
    same_shape = run.sequences.shape == ref.sequences.shape
    agreement = float((run.sequences == ref.sequences).float().mean()) if same_shape else 0.0
    diffs = [float((a - b).abs().max()) for a, b in zip(run.logits, ref.logits) if a.shape == b.shape]
    return dict(tokens_identical=same_shape and torch.equal(run.sequences, ref.sequences), token_agreement=agreement,
                max_abs_logit_diff=max(diffs) if diffs else None)


def _paired(a: _Column, b: _Column | None, key: str) -> float | None:
    """Median over rounds of ``a``'s / ``b``'s time of the same round (they share its noise)."""
    if b is None or not getattr(b, key):
        return None
    pairs = [(x, y) for x, y in zip(getattr(a, key), getattr(b, key)) if x is not None and y]
    return statistics.median(x / y for x, y in pairs) if pairs else None


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def run_cell(model: PreTrainedModel, prompt: int, workload: str, grid: SharedPromptGrid, *,
             skipped: dict[str, str], progress: bool = False) -> dict[str, Any]:
    """Every round of one cell; a JSON-able dict (see :func:`_cell_result`). ``skipped`` names the
    caches not run anywhere (with why); the cell adds its own skips."""
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    kwargs = mode_kwargs(workload)
    rows = max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    ids = prompt_ids(model, prompt, 1).to(model.device)
    names = [n for n in grid.caches if n not in skipped]
    skips = {n: skipped[n] for n in grid.caches if n in skipped}
    columns = {n: _Column() for n in names}
    load = os.getloadavg()
    before = torch.get_num_threads()
    torch.set_num_threads(grid.threads)
    try:
        for r in range(grid.rounds):
            for name in _order(names, r):
                if name in skips:
                    continue
                if name in ("dynamic", "ideal") and (why := _beyond_memory(model, rows, prompt, grid.decode_steps)):
                    skips[name] = why  # a cache of a copy of the prompt per row that this machine cannot hold
                    continue
                if name == "dynamic" and grid.dynamic_limit_s is not None and columns.get("ideal", _Column()).ttft_s:
                    estimate = rows * columns["ideal"].ttft_s[0]
                    if estimate > grid.dynamic_limit_s:
                        skips[name] = (f"estimated {estimate:.0f} s per run ({rows} rows x the one-row TTFT "
                                       f"{columns['ideal'].ttft_s[0]:.1f} s) > limit {grid.dynamic_limit_s:.0f} s")
                        continue
                try:
                    run = _run_cache(model, name, ids, workload, decode_steps=grid.decode_steps, seed=grid.seed,
                                     pad_token_id=pad)
                except (MemoryError, RuntimeError) as e:  # a cache this machine cannot hold: recorded, not a crash
                    if name == "vkv" or not ("alloc" in str(e).lower() or isinstance(e, MemoryError)):
                        raise
                    gc.collect()
                    skips[name] = f"out of memory: {type(e).__name__}: {str(e)[:200]}"
                    continue
                col = columns[name]
                col.ttft_s.append(run.ttft_s)
                col.step_s.append(run.step_s)
                col.runs.append(run)
                if progress:
                    step = "-" if run.step_s is None else f"{1e3 * run.step_s:.1f} ms"
                    print(f"  prompt {prompt} {workload} round {r} {name}: TTFT {run.ttft_s:.2f} s, decode step "
                          f"{step}", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(before)
    for name in skips:
        columns.pop(name, None)
    return _cell_result(prompt, workload, rows, grid, columns, skips, load)


def _beyond_memory(model: PreTrainedModel, rows: int, prompt: int, decode_steps: int) -> str | None:
    """Why a cache holding every row's own copy of the prompt (DynamicCache, the ideal) cannot run
    here: its K/V, ``rows x (prompt + decode_steps + 1)`` tokens, exceed the memory available on
    the model's device now (Linux ``MemAvailable``, or CUDA's free memory); ``None`` if it fits or
    this cannot tell. Skipped before it starts: such a run would be killed (the kernel's OOM
    killer on the host) or spend its prefill of every row before it fails."""
    need = rows * (prompt + decode_steps + 1) * kv_bytes_per_token(model)
    if model.device.type == "cuda":
        available = torch.cuda.mem_get_info(model.device)[0]
    else:
        try:
            with open("/proc/meminfo") as f:
                available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return None
    if need <= available:
        return None
    return (f"not enough memory: {rows} rows x {prompt + decode_steps + 1} tokens need {need / 2**30:.1f} GiB of "
            f"K/V, {available / 2**30:.1f} GiB available")


def _cell_result(prompt: int, workload: str, rows: int, grid: SharedPromptGrid, columns: dict[str, _Column],
                 skips: dict[str, str], load: tuple[float, float, float]) -> dict[str, Any]:
    reference = "dynamic" if "dynamic" in columns else "vkv" if "vkv" in columns else None
    ref = columns[reference].runs[0] if reference else None
    caches = {}
    for name, col in columns.items():
        checks = [_compare(run, ref) for run in col.runs] if ref is not None and name != reference else []
        caches[name] = dict(
            ttft_s=_median(col.ttft_s), round_ttft_s=col.ttft_s,
            decode_step_ms=None if _median(col.step_s) is None else 1e3 * _median(col.step_s),
            round_decode_step_ms=[None if s is None else 1e3 * s for s in col.step_s],
            kv_peak_bytes=max(run.kv_peak_bytes for run in col.runs),
            tokens_identical=all(c["tokens_identical"] for c in checks) if checks else None,
            token_agreement=min(c["token_agreement"] for c in checks) if checks else None,
            max_abs_logit_diff=max((c["max_abs_logit_diff"] for c in checks if c["max_abs_logit_diff"] is not None),
                                   default=None),
            vkv_stats=col.runs[0].stats,
        )
    ratios: dict[str, dict[str, float | None]] = {}
    for name in ("vkv", "vkv_cascade"):
        if name in columns:
            for base in ("dynamic", "ideal"):
                ratios[f"{name}/{base}"] = dict(ttft=_paired(columns[name], columns.get(base), "ttft_s"),
                                               decode_step=_paired(columns[name], columns.get(base), "step_s"))
    ttft = ratios.get("vkv/dynamic", {}).get("ttft")
    target = None if rows == 1 or ttft is None or prompt < 512 else ttft <= 1.2 / rows
    return dict(prompt=prompt, workload=workload, generate_kwargs=mode_kwargs(workload), rows=rows,
                decode_steps=grid.decode_steps, rounds=grid.rounds, load_average_at_start=list(load),
                reference=reference, caches=caches, skipped=skips, ratios=ratios,
                ttft_target_met=target, ttft_target="vkv TTFT <= 1.2/N x DynamicCache's (N = rows, prompt >= 512)")


def run_shared_prompt(model: PreTrainedModel, grid: SharedPromptGrid, *,
                      progress: bool = False) -> list[dict[str, Any]]:
    """Every cell of ``grid``; one JSON-able dict each."""
    skipped = {} if cascade_attention_available() else {
        "vkv_cascade": f"the {CASCADE_ATTENTION!r} attention is not registered with transformers' AttentionInterface "
                       "(this build has no cascade attention)"}
    cells = []
    for prompt, workload in grid.cells():
        if progress:
            print(f"cell prompt {prompt} {workload}: {', '.join(n for n in grid.caches if n not in skipped)}",
                  file=sys.stderr, flush=True)
        cells.append(run_cell(model, prompt, workload, grid, skipped=skipped, progress=progress))
        if progress:
            print(format_shared_prompt(cells[-1:], header=False), file=sys.stderr, flush=True)
        gc.collect()
    return cells


def shared_prompt_report(cells: Sequence[dict[str, Any]], *, grid: SharedPromptGrid, model: str, command: str,
                         environment: dict[str, str]) -> dict[str, Any]:
    """The JSON object: schema, command, model, environment (with the load now), method, grid, cells."""
    return dict(schema=SHARED_PROMPT_SCHEMA_VERSION, command=command, model=model,
                environment={**environment, "timed_threads": str(grid.threads),
                             "load_average_at_end": " ".join(f"{x:.2f}" for x in os.getloadavg())},
                method=METHOD, cascade_available=cascade_attention_available(), grid=dataclasses.asdict(grid),
                cells=list(cells))


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


_SHORT = {"dynamic": "dyn", "vkv": "vkv", "vkv_cascade": "casc", "ideal": "ideal"}


def format_shared_prompt(cells: Sequence[dict[str, Any]], *, header: bool = True) -> str:
    """One line per cell: TTFT (s) and decode step (ms) per cache, vkv's ratios (median of the
    per-round ratios), vkv's tokens against the reference, the cascade's max |Δlogit|."""
    cols = ([f"TTFT {_SHORT[n]}" for n in CACHES] + [f"ms {_SHORT[n]}" for n in CACHES]
            + ["TTFT v/d", "TTFT v/i", "step v/d", "step v/i", "tokens", "casc|dl|"])
    head = f"{'prompt':>6s} {'workload':8s} " + " ".join(f"{c:>10s}" for c in cols)
    lines = [head, "-" * len(head)] if header else []
    for c in cells:
        caches, ratios = c["caches"], c["ratios"]
        values = [_fmt(caches.get(n, {}).get("ttft_s"), ".3f") for n in CACHES]
        values += [_fmt(caches.get(n, {}).get("decode_step_ms"), ".1f") for n in CACHES]
        values += [_fmt(ratios.get(f"vkv/{base}", {}).get(key), ".3f")
                   for key in ("ttft", "decode_step") for base in ("dynamic", "ideal")]
        values.append({None: "-", True: "identical", False: "DIFFERENT"}[caches.get("vkv", {}).get("tokens_identical")])
        values.append(_fmt(caches.get("vkv_cascade", {}).get("max_abs_logit_diff"), ".2g"))
        lines.append(f"{c['prompt']:6d} {c['workload']:8s} " + " ".join(f"{v:>10s}" for v in values))
    return "\n".join(lines)
