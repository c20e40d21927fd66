"""``run_ab``: the same ``generate()`` with DynamicCache and with vkv, compared step by step.

Both runs get a cache built here and passed under the running transformers' cache keyword
(:func:`hf_vkv.generate.cache_kwarg`: ``cache``, or ``past_key_values`` before 5.24) (``DynamicCache(config=...)``
and ``VKVCache(config, batch_size=rows, prompt_repeats=k)``, sized and configured as
``cache_implementation="vkv"`` would size it), the same seed, and a :class:`~.probes.StepProbe`
in ``logits_processor``; with ``tee=True`` an :class:`~.probes.UpdateTee` on each cache. Logits
come from ``output_logits=True``. The comparison is exact: the A/B is an oracle, so any difference
in tokens, logits or K/V is a divergence (there is no tolerance).

Beam search reorders rows between steps: row ``i`` of one run is compared with row ``i`` of the
other at the same step, which is right as long as both made the same choices so far, i.e. up to
the first divergence, the only place reported precisely.

With a prefix store (``prefix_store=``) the vkv run prefills only what the store does not hold,
and the reference is by default what transformers computes when a user reuses a cache by hand: a
DynamicCache holding the same history (``reference_cache=``, cut to the columns the vkv run took
from the store), continued over the rest of the prompt (``reference="continued"``; the vkv run
goes first, so that those columns are known). The verdict stays exact. ``reference="prefill"``
compares against DynamicCache prefilling the whole prompt instead (a different sum: tokens
compared, max |Δlogit| reported).
"""

from __future__ import annotations

import contextlib
import gc
import math
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import torch
from transformers import LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from ..cache import CacheOptions, ReuseReport, VKVCache
from ..generate import cache_kwarg, reuse
from ..kv_records import CASCADE_ATTENTION, PAGED_ATTENTION
from ..memory.errors import ArgumentError, ArgumentTypeError
from ..prefix import PrefixStore
from ..version import __version__
from .deterministic import deterministic_kernels
from .progress import progress_bar
from .probes import StepProbe, UpdateTee, kv_bytes
from .records import ABReport, AttentionPath, Divergence, Reference, RunSummary, StepReport

__all__ = [
    "AttentionPath", "PAGED_ATTENTION", "Reference", "VKVCacheFactory", "describe_environment",
    "paged_attention_available", "run_ab",
]

#: The attention implementation of each attention path that is not the model's own.
_PATH_ATTENTION = {"paged": PAGED_ATTENTION, "cascade": CASCADE_ATTENTION}
#: Builds the cache under test: ``factory(config, batch_size=rows, prompt_repeats=k, options=...)``.
VKVCacheFactory = type[VKVCache]

# run_ab sets these itself; a caller passing them would change what is compared
_RESERVED = ("past_key_values", "cache", "cache_implementation", "cache_config", "logits_processor", "output_logits",
             "return_dict_in_generate", "streamer", "assistant_model", "prompt_lookup_num_tokens", "max_new_tokens",
             "input_ids", "attention_mask")


def paged_attention_available() -> bool:
    """Whether ``"vkv_paged"`` is registered with transformers' ``AttentionInterface``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return PAGED_ATTENTION in ALL_ATTENTION_FUNCTIONS


@dataclass(slots=True)
class _Run:
    """What one generate() left behind (tensors on the CPU)."""

    sequences: torch.Tensor  # [returned rows, prompt + new]
    logits: list[torch.Tensor]  # per step: [rows, vocab] float32
    probe: StepProbe
    tee: UpdateTee | None
    wall_s: float
    final_kv_bytes: int  # after generate() returned (beam search reorders once more after the last step)


def run_ab(
    model: PreTrainedModel,
    inputs: Mapping[str, torch.Tensor],
    *,
    max_new_tokens: int = 32,
    layout: AttentionPath = "contiguous",
    tee: bool = True,
    seed: int = 0,
    cache_config: Mapping[str, Any] | None = None,
    vkv_cache_factory: VKVCacheFactory | None = None,
    progress: bool = False,
    prefix_store: PrefixStore | None = None,
    reference: Reference = "continued",
    reference_cache: DynamicCache | None = None,
    **generate_kwargs: Any,
) -> ABReport:
    """Run ``model.generate(**inputs, **generate_kwargs)`` with DynamicCache, then with vkv; compare.

    Args:
        model: a causal LM (any architecture ``cache_implementation="vkv"`` supports).
        inputs: ``input_ids`` ``[batch, prompt]`` (int64) and optionally ``attention_mask``
            ``[batch, prompt]`` (left padding), on the model's device.
        max_new_tokens: tokens to generate per row.
        layout: the :data:`~.records.AttentionPath` of the vkv run (whatever the cache's own layout):
            ``"contiguous"`` (the model's attention reads what ``update`` returns), ``"paged"`` (the
            ``"vkv_paged"`` attention reads the pages) or ``"cascade"`` (the ``"vkv_cascade"``
            attention reads shared prefixes once: see :attr:`ABReport.passed`); the model's own
            attention is restored afterwards.
        tee: record every layer's K/V at every step in both runs and compare them (costs a
            digest of each update; excluded from the step times).
        seed: ``torch.manual_seed(seed)`` before each run (sampling draws the same numbers).
        cache_config: options of the vkv cache (as ``generate(cache_config=...)``).
        vkv_cache_factory: a :class:`VKVCache` subclass whose ``for_generate`` builds the cache of
            the vkv run (tests use it to inject faults); default :class:`VKVCache`.
        progress: show each run's progress on stderr: a bar on a terminal, one line per run
            otherwise (see :func:`~hf_vkv.ab.progress.progress_bar`).
        prefix_store: the vkv run reuses this store's prefixes, as ``generate(cache_config=
            {"prefix_store": store})`` does, and inserts its finished rows afterwards. What the
            DynamicCache run does is ``reference``.
        reference: with a prefix store, the DynamicCache run to compare with (the report's
            ``reference``). ``"continued"`` (default): ``reference_cache`` holding the same history
            as the vkv run's rows took from the store, continued over the rest of the prompt, as a
            user reuses a cache by hand; the vkv run goes first, and the verdict is exact
            (:attr:`ABReport.identical`). ``"prefill"``: DynamicCache prefills the whole prompt, a
            different sum: the verdict is the tokens, with each step's max |Δlogit|
            (:attr:`ABReport.passed`), and ``tee`` must be False.
        reference_cache: with ``reference="continued"``, the DynamicCache of the conversation so
            far: its columns hold the first tokens of ``inputs`` (the same left padding), as the
            previous turn's ``generate`` or ``run_ab`` left it; ``None``: an empty history (the
            store must then lend nothing). Continued in place, as ``generate`` continues a cache
            passed to it: it is cut to the columns the vkv run took from the store, its first row
            of each prompt is kept (a chat continues with the first sequence) and repeated for
            ``num_beams`` / ``num_return_sequences``, and afterwards it holds this call's history,
            ready for the next turn. Pass one ``DynamicCache(config=model.config)`` to every turn.
        **generate_kwargs: the generation mode: ``do_sample``, ``num_beams``,
            ``num_return_sequences``, ``temperature``, ... (not the ones this function sets:
            caches, logits processors, output options).

    On a CUDA model both runs use deterministic kernels (:func:`~.deterministic.deterministic_kernels`:
    GPU attention kernels need not repeat themselves bit for bit, and then no A/B could pass);
    ``report.environment["deterministic_algorithms"]`` says whether they were in force.

    Returns:
        An :class:`ABReport`; ``report.identical`` is the verdict, ``report.first_divergence``
        says where a difference started.

    Raises:
        ValueError / TypeError: bad arguments (named in the message); ``layout="paged"`` when
            ``"vkv_paged"`` is not registered; ``reference`` or ``reference_cache`` without a prefix
            store, ``reference_cache`` with ``reference="prefill"``, ``tee=True`` with
            ``reference="prefill"``; a ``reference_cache`` whose rows are not a multiple of the
            batch, or that holds fewer columns than the store lends (:func:`reference_history`).
    """
    _check_arguments(model, inputs, max_new_tokens=max_new_tokens, layout=layout, tee=tee, seed=seed,
                     generate_kwargs=generate_kwargs)
    CacheOptions.from_dict(dict(cache_config or {}))  # bad options fail before either run
    _check_reference(prefix_store, reference, reference_cache, tee=tee)
    config = model.generation_config
    num_beams = int(generate_kwargs.get("num_beams", config.num_beams) or 1)
    num_return = int(generate_kwargs.get("num_return_sequences", config.num_return_sequences) or 1)
    do_sample = bool(generate_kwargs.get("do_sample", config.do_sample))
    batch, prompt_len = inputs["input_ids"].shape
    expand = max(num_beams, num_return)
    rows = batch * expand
    factory = vkv_cache_factory or VKVCache
    continued = prefix_store is not None and reference == "continued"
    if continued:  # what the store lends now (a batch's common prefix, prefilled by the call, may add to it)
        lent = _lent_columns(prefix_store, inputs)
        reference_history(reference_cache, columns=lent, batch=batch, expand=expand, check_only=True)

    def dynamic_cache() -> Cache:
        if continued:  # the history the vkv run started from (known: it ran first)
            column = made[-1].start_column if made and made[-1].refusal is None else 0
            history = reference_history(reference_cache, columns=column, batch=batch, expand=expand)
            return DynamicCache(config=model.config) if history is None else history
        return DynamicCache(config=model.config)

    made: list[ReuseReport] = []

    def vkv_cache() -> Cache:  # as generate(cache_implementation="vkv") builds it
        options = dict(cache_config or {})
        refusal = None if prefix_store is None else reuse.model_refusal(model, prefix_store)
        memory = None if prefix_store is None or refusal is not None else reuse.memory_for(model, prefix_store, options)
        cache = factory.for_generate(model, batch_size=batch, expand=expand, max_length=prompt_len + max_new_tokens + 1,
                                     cache_config=options, num_beams=num_beams, prompt_tokens=prompt_len,
                                     memory_of=memory)
        if prefix_store is not None:  # the call's record, as generate's hook makes it: reuse, then insertion
            eos = generate_kwargs.get("eos_token_id", config.eos_token_id)
            reuse.attach(cache, prefix_store, model, owned=False, rows=rows, num_beams=num_beams, eos_token_id=eos,
                         refusal=refusal)
            assert cache.reuse is not None
            made.append(cache.reuse)
        return cache

    common = dict(inputs, max_new_tokens=max_new_tokens, **generate_kwargs)
    beams = num_beams > 1
    def run_vkv() -> _Run:
        previous = model.config._attn_implementation
        attention = _PATH_ATTENTION.get(layout)
        if attention is not None:
            model.set_attn_implementation(attention)
        try:
            return _generate(model, vkv_cache, common, seed=seed, tee=tee, source=_source(layout), label="vkv",
                             progress=progress, histories=beams)
        finally:
            if attention is not None:
                model.set_attn_implementation(previous)

    def run_dynamic() -> _Run:
        return _generate(model, dynamic_cache, common, seed=seed, tee=tee, source=_source(layout), label="dynamic",
                         progress=progress, histories=beams)

    with deterministic_kernels(model.device) as deterministic:  # a GPU reference must repeat itself
        if continued:  # vkv first: the reference holds the history its rows took from the store
            got = run_vkv()
            gc.collect()
            ref = run_dynamic()
        else:
            ref = run_dynamic()
            gc.collect()
            got = run_vkv()
    reused = asdict(made.pop()) if made else None  # the call inserted its finished rows as it ended
    gc.collect()

    steps, first = _compare(ref, got, tee=tee)
    kwargs_json = {k: v for k, v in {**generate_kwargs, "max_new_tokens": max_new_tokens}.items()
                   if isinstance(v, (bool, int, float, str, type(None)))}
    return ABReport(
        model=str(getattr(model.config, "name_or_path", "") or type(model).__name__),
        layout=layout,
        mode="beam" if num_beams > 1 else "sample" if do_sample else "greedy",
        tee=tee, seed=seed, generate_kwargs=kwargs_json, prompt_tokens=int(prompt_len), batch=int(batch),
        rows=rows, tokens_identical=_same_tensor(ref.sequences, got.sequences), first_divergence=first,
        dynamic=_summary("dynamic", ref), vkv=_summary("vkv", got), steps=steps,
        generated_dynamic=_generated(ref.sequences, prompt_len), generated_vkv=_generated(got.sequences, prompt_len),
        environment={**describe_environment(model), "deterministic_algorithms": str(deterministic)},
        prefix_reuse=reused, reference=reference if prefix_store is not None else None,
    )


def _check_reference(store: Any, reference: Any, reference_cache: Any, *, tee: bool) -> None:
    """The prefix-store arguments of :func:`run_ab`, checked before either run."""
    if reference not in get_args(Reference):
        raise ArgumentError(f"reference must be one of {list(get_args(Reference))}, got {reference!r}")
    if reference_cache is not None and not isinstance(reference_cache, DynamicCache):
        raise ArgumentTypeError(f"reference_cache must be a transformers DynamicCache (the conversation's history), got "
                                f"{type(reference_cache).__name__}")
    if store is None:
        if reference != "continued" or reference_cache is not None:
            raise ArgumentError("reference= and reference_cache= choose what a prefix store's vkv run is compared with: "
                                "pass prefix_store=store too (without a store both runs prefill the whole prompt)")
        return
    if not isinstance(store, PrefixStore):
        raise ArgumentTypeError(f"prefix_store must be a hf_vkv.PrefixStore, got {type(store).__name__}")
    if reference == "prefill":
        if reference_cache is not None:
            raise ArgumentError("reference='prefill' prefills the whole prompt in a new DynamicCache: drop "
                                "reference_cache, or compare with reference='continued'")
        if tee:
            raise ArgumentError("tee=True compares every layer's K/V at every step, but with reference='prefill' the vkv "
                                "prefill computes only the tokens not stored: pass tee=False (tokens and logits are "
                                "compared), or compare with reference='continued'")


def _lent_columns(store: PrefixStore, inputs: Mapping[str, torch.Tensor]) -> int:
    """The column every row of ``inputs`` would start from with what ``store`` holds now (the
    smallest left padding + stored prefix of a row); the call's own common prefix not counted."""
    ids = inputs["input_ids"].to("cpu")
    mask = inputs.get("attention_mask")
    pads = [0] * ids.shape[0] if mask is None else [int(p) for p in (mask.to("cpu") == 0).sum(dim=1).tolist()]
    return min(pad + store.longest_prefix(ids[row, pad:].tolist()) for row, pad in enumerate(pads))


def reference_history(cache: DynamicCache | None, *, columns: int, batch: int, expand: int,
                      check_only: bool = False) -> DynamicCache | None:
    """``cache`` (in place; ``None`` stays ``None``: an empty history) made the history the DynamicCache run of
    ``run_ab(reference="continued")`` continues: its first ``columns`` columns, the first row of
    each of the ``batch`` prompts, repeated ``expand`` times (beams, returned sequences).

    Raises:
        ValueError: ``cache`` holds fewer than ``columns`` columns (the store lent more history
            than the reference has: its K/V would have to be computed in other chunks than the
            stored ones), or its rows are not a multiple of ``batch``.
    """
    held = 0 if cache is None else cache.get_seq_length()
    if held < columns:
        raise ArgumentError(
            f"the prefix store lends the vkv run {columns} columns of history, but reference_cache holds {held}: the "
            "continued reference must hold the same history, computed as the store's was. Pass the DynamicCache that "
            "ran the conversation so far (run_ab continues reference_cache in place, turn after turn), or compare "
            "with reference='prefill'")
    layers = [] if cache is None else [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    for layer in layers:
        if layer.keys.shape[0] % batch:
            raise ArgumentError(f"reference_cache holds {layer.keys.shape[0]} rows, not a multiple of the batch's {batch} "
                                "prompts (one row per prompt, or the rows of the previous turn's sequences)")
    if check_only or cache is None:
        return cache
    for layer in layers:
        keep = torch.arange(0, layer.keys.shape[0], layer.keys.shape[0] // batch, device=layer.keys.device)
        for name in ("keys", "values"):
            kept = getattr(layer, name).index_select(0, keep)[..., :columns, :]
            setattr(layer, name, kept.repeat_interleave(expand, dim=0) if expand > 1 else kept.contiguous())
    return cache


def _check_arguments(model: Any, inputs: Any, *, max_new_tokens: Any, layout: Any, tee: Any, seed: Any,
                     generate_kwargs: dict[str, Any]) -> None:
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "config"):
        raise ArgumentTypeError(f"model must be a transformers model with generate(), got {type(model).__name__}")
    if not isinstance(inputs, Mapping) or not isinstance(inputs.get("input_ids"), torch.Tensor):
        raise ArgumentTypeError("inputs must be a mapping with an 'input_ids' tensor [batch, prompt] "
                                "(e.g. dict(tokenizer(texts, return_tensors='pt', padding=True)))")
    if inputs["input_ids"].dim() != 2:
        raise ArgumentError(f"inputs['input_ids'] must be [batch, prompt], got shape {tuple(inputs['input_ids'].shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ArgumentError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if layout not in get_args(AttentionPath):
        raise ArgumentError(f"layout must be one of {list(get_args(AttentionPath))}, got {layout!r}")
    if layout == "paged" and not paged_attention_available():
        raise ArgumentError(
            f"layout='paged' needs the {PAGED_ATTENTION!r} attention implementation, which this hf_vkv does not "
            "register (transformers.AttentionInterface has no such name); use layout='contiguous'"
        )
    if not isinstance(tee, bool):
        raise ArgumentTypeError(f"tee must be a bool, got {tee!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentTypeError(f"seed must be an int, got {seed!r}")
    reserved = sorted(set(generate_kwargs) & set(_RESERVED))
    if reserved:
        raise ArgumentError(f"run_ab sets {reserved} itself (caches, probes and outputs it compares); leave them out, "
                            "and pass the vkv options as cache_config=..., the length as max_new_tokens=...")


def _source(layout: AttentionPath) -> Literal["returned", "stored"]:
    # the paged attention reads pages, not what update returns: compare what the layers store
    return "stored" if layout == "paged" else "returned"


def _generate(model: PreTrainedModel, make_cache: Callable[[], Cache], kwargs: dict[str, Any], *, seed: int,
              tee: bool, source: Literal["returned", "stored"], label: str, progress: bool,
              histories: bool = False) -> _Run:
    cache = make_cache()
    recorder = UpdateTee(source=source) if tee else None
    if recorder is not None:
        recorder.attach(cache)
    bar = progress_bar(total=kwargs["max_new_tokens"], label=f"{label:>7s}", unit="step", enabled=progress)
    probe = StepProbe(cache, tee=recorder, progress=bar, histories=histories)
    try:
        torch.manual_seed(seed)
        probe.start()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**kwargs, **{cache_kwarg(): cache}, logits_processor=LogitsProcessorList([probe]),
                                 output_logits=True, return_dict_in_generate=True)
        wall = time.perf_counter() - t0
    finally:
        bar.close()
        UpdateTee.detach(cache)
    final = kv_bytes(cache)
    logits = [step.detach().float().cpu() for step in out.logits]
    sequences = out.sequences.detach().cpu()
    probe.cache = None  # the runs' caches go as soon as the outputs do
    return _Run(sequences=sequences, logits=logits, probe=probe, tee=recorder, wall_s=wall, final_kv_bytes=final)


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def _step_tokens(run: _Run, step: int) -> torch.Tensor | None:
    """``[rows]`` tokens chosen at ``step``: the last ids the probe sees one step later; for the
    last step, the last column of the returned sequences."""
    if step + 1 < len(run.probe.last_ids):
        return run.probe.last_ids[step + 1]
    if step + 1 == len(run.probe.last_ids):
        return run.sequences[:, -1]
    return None


def _differing_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    """Rows ``i`` with ``a[i] != b[i]`` anywhere (NaN equals NaN); all rows when shapes differ."""
    if a.shape != b.shape:
        return tuple(range(max(a.shape[0], b.shape[0])))
    same = a == b
    if a.is_floating_point():
        same |= a.isnan() & b.isnan()
    return tuple(int(i) for i in (~same.reshape(a.shape[0], -1)).any(dim=1).nonzero().flatten())


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return 0.0
    return float((a - b).abs()[~same].max())  # nan where one side is nan


def _as_rows(digests: tuple[bytes, ...], rows: int) -> tuple[bytes, ...]:
    """A prefill-once step's digests (one row per prompt: :mod:`hf_vkv.prefill_once`) stand for
    the ``rows // len(digests)`` rows DynamicCache computed for each prompt; others are as they are."""
    if digests and rows > len(digests) and rows % len(digests) == 0:
        return tuple(d for d in digests for _ in range(rows // len(digests)))
    return digests


def _kv_differences(ref: UpdateTee, got: UpdateTee, step: int) -> list[tuple[int, int, str]]:
    """(layer, row, "keys"/"values") that differ at ``step``, in computation order."""
    out = []
    for layer in sorted(set(ref.digests) | set(got.digests)):
        a = ref.digests.get(layer, [])
        b = got.digests.get(layer, [])
        if step >= len(a) and step >= len(b):
            continue
        if step >= len(a) or step >= len(b):
            out.append((layer, 0, "keys"))
            continue
        for row in range(max(len(a[step].keys), len(b[step].keys))):
            for name in ("keys", "values"):
                da, db = getattr(a[step], name), _as_rows(getattr(b[step], name), len(getattr(a[step], name)))
                if row >= len(da) or row >= len(db) or da[row] != db[row]:
                    out.append((layer, row, name))
                    break
    return out


def _compare(ref: _Run, got: _Run, *, tee: bool) -> tuple[tuple[StepReport, ...], Divergence | None]:
    n_ref, n_got = len(ref.probe.times), len(got.probe.times)
    steps: list[StepReport] = []
    first: Divergence | None = None
    for t in range(max(n_ref, n_got)):
        both = t < n_ref and t < n_got
        kv_diff = _kv_differences(ref.tee, got.tee, t) if tee and ref.tee and got.tee else []
        tokens_equal = logit_diff = None
        rows: tuple[int, ...] = ()
        found: Divergence | None = None
        if kv_diff:
            layer, row, name = kv_diff[0]
            found = Divergence(step=t, kind="kv", layer=layer, row=row, tensor=name,
                               detail=f"layer {layer}'s {name} of row {row} differ from DynamicCache's")
        unmatched = None
        if both:
            logit_diff = _max_abs_diff(ref.logits[t], got.logits[t])
            if ref.probe.histories is not None and got.probe.histories is not None:
                logit_diff, unmatched = _beam_logit_diff(ref, got, t)
            logit_rows = _differing_rows(ref.logits[t], got.logits[t])
            if logit_rows and found is None:
                found = Divergence(step=t, kind="logits", layer=None, row=logit_rows[0], tensor=None,
                                   detail=f"logits differ (max |difference| {logit_diff:.3g})")
            a, b = _step_tokens(ref, t), _step_tokens(got, t)
            token_rows = _differing_rows(a, b) if a is not None and b is not None else ()
            tokens_equal = not token_rows
            rows = tuple(sorted(set(token_rows) | set(logit_rows)))
            if token_rows and found is None:
                r = token_rows[0]
                found = Divergence(step=t, kind="tokens", layer=None, row=r, tensor=None,
                                   detail=f"token {_token_at(got, t, r)} instead of {_token_at(ref, t, r)}")
        elif found is None:
            longer = "vkv" if t < n_got else "DynamicCache"
            found = Divergence(step=t, kind="steps", layer=None, row=None, tensor=None,
                               detail=f"only the {longer} run has this step ({n_ref} steps vs {n_got})")
        if first is None:
            first = found
        steps.append(StepReport(
            step=t, tokens_equal=tokens_equal, rows_differing=rows, max_abs_logit_diff=logit_diff,
            kv_equal=(not kv_diff) if tee else None, layers_differing=tuple(sorted({d[0] for d in kv_diff})),
            kv_bytes_dynamic=ref.probe.kv_bytes[t] if t < n_ref else None,
            kv_bytes_vkv=got.probe.kv_bytes[t] if t < n_got else None,
            time_dynamic_s=ref.probe.times[t] if t < n_ref else None,
            time_vkv_s=got.probe.times[t] if t < n_got else None, beams_unmatched=unmatched,
        ))
    if first is None and not _same_tensor(ref.sequences, got.sequences):
        # every step agreed but the returned sequences differ (beam search's final selection)
        rows_ = _differing_rows(ref.sequences, got.sequences)
        first = Divergence(step=max(n_ref, n_got) - 1, kind="tokens", layer=None, row=rows_[0] if rows_ else None,
                           tensor=None, detail="the returned sequences differ")
    return tuple(steps), first


def _beam_logit_diff(ref: _Run, got: _Run, step: int) -> tuple[float, int]:
    """Beam search's ``(max |Δlogit|, unmatched rows)`` at ``step``: each vkv row against the
    DynamicCache row with the same token history (the same beam: each run orders its beams
    itself, and a near-tie may put a different candidate in a beam); rows of vkv whose history
    the DynamicCache run does not hold are counted, not compared. Row by row when the runs hold
    the same histories in the same order, so an exact run still reads 0.0."""
    a, b = ref.probe.histories[step], got.probe.histories[step]
    if a.shape != b.shape:
        return float("inf"), b.shape[0]
    mine = [tuple(row) for row in a.tolist()]
    index = {row: i for i, row in reversed(list(enumerate(mine)))}  # the first row of each history
    worst, unmatched = 0.0, 0
    for i, row in enumerate(tuple(r) for r in b.tolist()):
        j = i if mine[i] == row else index.get(row)  # the same row first (rows of one prompt are alike)
        if j is None:
            unmatched += 1
            continue
        diff = _max_abs_diff(ref.logits[step][j], got.logits[step][i])
        worst = diff if math.isnan(diff) else max(worst, diff)
    return worst, unmatched


def _token_at(run: _Run, step: int, row: int) -> int | None:
    tokens = _step_tokens(run, step)
    return int(tokens[row]) if tokens is not None and row < tokens.shape[0] else None


def _summary(cache: Literal["dynamic", "vkv"], run: _Run) -> RunSummary:
    times = run.probe.times
    kv = run.probe.kv_bytes
    return RunSummary(
        cache=cache, steps=len(times), wall_s=run.wall_s, prefill_s=times[0] if times else 0.0,
        decode_step_s=sum(times[1:]) / (len(times) - 1) if len(times) > 1 else None,
        kv_peak_bytes=max([*kv, run.final_kv_bytes]), kv_final_bytes=run.final_kv_bytes,
    )


def _generated(sequences: torch.Tensor, prompt_len: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(x) for x in row) for row in sequences[:, prompt_len:])


def describe_environment(model: PreTrainedModel | None = None, *, device: torch.device | str | None = None,
                         command: str | None = None) -> dict[str, str]:
    """The machine, the libraries and the command of a run: the one place every JSON report
    (``run_ab``, ``hf-vkv bench``/``demo``, ``benchmarks/*.py``) takes them from.

    Args:
        model: the model that ran; gives ``device`` and ``dtype`` (its first parameter's).
        device: the device when there is no model (default: the model's, else the CPU).
        command: the command line to record (default: this process's, ``python`` and ``sys.argv``).

    Returns:
        Strings (the reports' schemas want strings): ``device`` (``"cpu: x86_64"``, ``"cuda: NAME"``),
        ``dtype`` (with a model), ``torch``, ``transformers``, ``hf_vkv``, ``python``, ``torch_threads``,
        ``platform``, ``kernel``, ``processor``, ``cpu_model``, ``cpu_count``, ``command``; ``triton``
        and ``cuda_bindings`` where installed; on a CUDA device also ``device_memory_bytes``,
        ``torch_cuda_version`` and ``driver_cuda_version``.
    """
    import importlib.metadata
    import os
    import sys

    import transformers

    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    device = torch.device(device)
    processor = platform.processor() or platform.machine()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else processor
    env = {"device": f"{device.type}: {name}"}
    if model is not None:
        env["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    env.update({
        "torch": torch.__version__, "transformers": transformers.__version__, "hf_vkv": __version__,
        "python": platform.python_version(), "torch_threads": str(torch.get_num_threads()),
        "platform": platform.platform(), "kernel": platform.release(), "processor": processor,
        "cpu_model": _cpu_model() or processor, "cpu_count": str(os.cpu_count()),
        "command": command if command is not None else " ".join([os.path.basename(sys.executable), *sys.argv]),
    })
    for dist, key in (("triton", "triton"), ("cuda-bindings", "cuda_bindings")):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[key] = importlib.metadata.version(dist)
    if device.type == "cuda":
        env["device_memory_bytes"] = str(torch.cuda.get_device_properties(device).total_memory)
        env["torch_cuda_version"] = str(torch.version.cuda)
        env["driver_cuda_version"] = _driver_cuda_version(device)
    return env


def _cpu_model() -> str | None:
    """The CPU's marketing name (``model name`` in ``/proc/cpuinfo``), where Linux says it."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return None


def _driver_cuda_version(device: torch.device) -> str:
    """The CUDA version the driver supports (``"13.0"``), or ``"?"`` without cuda-bindings."""
    try:
        from ..cuda import Driver

        driver = Driver(device.index if device.index is not None else torch.cuda.current_device())
        try:
            version = driver.driver_version()
        finally:
            driver.close()
    except Exception:  # noqa: BLE001  (a report must not fail on a missing binding; "?" says so)
        return "?"
    return f"{version // 1000}.{version % 1000 // 10}"
