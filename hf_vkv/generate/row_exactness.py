"""Row exactness: admitting, op by op, a forward on one row per prompt where it computes DynamicCache's bits.

Prefill once (:mod:`hf_vkv.generate.prefill_once`) runs ``generate``'s prefill on ``B`` prompts
where DynamicCache runs it on ``B*k`` rows (each prompt repeated ``k`` times). A row computed alone
equals the same row inside the taller tensor only where the kernel computes it the same way, and
that is decided by what the kernel branches on — shapes, strides, alignment, dtype, the number of
intra-op threads, the CPU's vector width — never by the values. So :class:`RowExactness` admits a
call (runs it on the ``B`` rows only) by a rule on those, never by a sample of values:

* **elementwise transcendental math and activations** (``silu``, ``gelu``, ``exp``, ``tanh``,
  ``rsqrt``, ``pow``, ...; :func:`lane_functions`): torch runs them as one loop over the
  contiguous elements of each thread's chunk, ``2 x`` a vector register at a time, and a scalar
  loop over the chunk's last ``n mod 2V`` elements; the vector and scalar paths round
  differently (SLEEF vs libm). A call is admitted when every operand and the result are
  contiguous and each element takes the same path alone as in DynamicCache's tensor and in each
  of its repeats (:func:`same_lanes`), for every vector width torch builds (16, 32, 64 bytes);
  with row lengths a multiple of 32 float32 (64 bfloat16) elements that is every call;
* **matmuls, attention, reductions and norms** (:func:`proved_functions`: BLAS / oneDNN split a
  small matmul along the reduction at >= 2 threads, a reduction splits its input when it has one
  output, ...): a call is admitted when its *signature* — the function, every operand's shape,
  strides, storage offset modulo 64, dtype and device, the other arguments, ``B``, ``k``, the
  thread count, the CPU capability and the matmul settings — is proved exact on synthetic
  operands of that layout: :data:`PROOF_DRAWS` draws (normal values; magnitudes over many decades
  with random signs; normal values with zeros, extremes and a few subnormals mixed in), each
  compared bit for bit with its expansion to ``B*k`` rows. The proof depends only on the key, so
  its verdict is kept for the process (:func:`clear_verdicts`) and on disk for later processes
  on the same software and machine (:mod:`hf_vkv.generate.proof_file`, ``HF_VKV_PROOF_CACHE``): a
  later call, in another layer, ``generate`` or process, finds the verdict the proof would give again;
* **a proved call not admitted on ``B`` rows** may be admitted on ``B*m`` rows (each prompt
  repeated ``m`` times, ``m`` a power of two, ``2m <= k``: :func:`repeat_ladder`): its proof goes
  on to compare the ``B*m``-row call's first repeat with the ``B*k`` rows on the same draws,
  smallest ``m`` first. At two threads a BLAS may split the reduction of a short product (the
  MLP of a 128-token prompt) between the threads but not a taller one's, so two repeats compute
  what ``k`` do, and the call costs ``m`` rows, not ``k`` (:attr:`RowExactness.partial` counts
  them);
* **anything not admitted** runs on DynamicCache's rows (the operands expanded to ``B*k`` rows,
  as DynamicCache holds them), every time: when the repeats of each prompt are equal bit for bit
  the call hands back one per prompt — DynamicCache's bits — (:attr:`RowExactness.expanded`
  counts them); when they differ among themselves (DynamicCache's own copies of a prompt differ),
  :class:`InexactRows` is raised and the caller prefills every row.

Other elementwise math (``+``, ``*``, comparisons, casts, gathers, ...) is correctly rounded or
exact, so the same bits whatever path computes an element: it is not watched. Where a rule or a
proof cannot decide (a non-contiguous operand, an operand whose rows it cannot place, a call that
fails on synthetic operands), the call runs on DynamicCache's rows.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .proof_file import digest, proof_file

__all__ = ["InexactRows", "PROOF_DRAWS", "PROOF_METHOD", "RowExactness", "Verdict", "clear_verdicts", "expand_operand",
           "lane_functions", "probed_functions", "proved_functions", "repeat_ladder", "same_lanes",
           "verdict_repeats"]

#: A proof's verdict: ``"exact"`` (the call runs on the ``B`` rows) or ``"repeats:<m>"`` (on
#: ``B*m`` rows: ``m`` of :func:`repeat_ladder`, or ``k``, DynamicCache's rows; :func:`verdict_repeats`).
#: ``"expanded"``, kept by versions before the ladder, is proved again.
Verdict = str

#: Proofs kept per process (the oldest forgotten first); a signature includes the prompt's length,
#: so a long-running server sees many. A forgotten proof is made again, with the same verdict.
_MAX_VERDICTS = 4096
_VERDICTS: OrderedDict[tuple, Verdict] = OrderedDict()
_LANE_FUNCTIONS: frozenset | None = None
_PROVED_FUNCTIONS: frozenset | None = None

#: Synthetic draws a signature's proof compares (see the module docstring).
PROOF_DRAWS = 3
#: The proof's method, in the proof file's keys: verdicts kept on disk by an earlier method are
#: proved again (2: one row's stride-0 dim 0 expands to rows that follow one another, see
#: :func:`expand_operand`).
PROOF_METHOD = 2
#: Elements per thread below which torch runs an elementwise loop on one thread
#: (``at::internal::GRAIN_SIZE``).
GRAIN_SIZE = 32768
#: Vector register widths (bytes) torch's CPU kernels are built for: SSE/NEON/VSX, AVX2, AVX-512.
VECTOR_BYTES = (16, 32, 64)


class InexactRows(Exception):
    """A call of the forward computes a repeated prompt's copies differently from each other at
    ``B*k`` rows, so no forward on ``B`` rows can give DynamicCache's bits (internal: prefill once
    catches it and prefills every row)."""


def repeat_ladder(repeats: int) -> list[int]:
    """The repeats ``m`` a proof tries after one (smallest first): powers of two with ``2m <= k``
    (a call on more than half of DynamicCache's rows spares too little to prove)."""
    out, m = [], 2
    while 2 * m <= repeats:
        out.append(m)
        m *= 2
    return out


def verdict_repeats(verdict: Verdict, repeats: int) -> int | None:
    """The repeats of each prompt a call with ``verdict`` runs on (``1``: the unique rows;
    ``repeats``: DynamicCache's), ``None`` for a verdict to prove again (unknown, or an
    ``"expanded"`` kept before the ladder was tried)."""
    if verdict == "exact":
        return 1
    if verdict.startswith("repeats:") and verdict[8:].isdigit():
        m = int(verdict[8:])
        return m if m == repeats or m in repeat_ladder(repeats) else None
    return None


def clear_verdicts() -> None:
    """Forget every proof kept in the process (tests; a process that swaps its BLAS). The proof
    file, if any, is not touched (``HF_VKV_PROOF_CACHE=off`` keeps proofs in the process only)."""
    _VERDICTS.clear()


#: Elementwise functions whose vectorized body and scalar tail may round differently (so an
#: element's bits depend on where the tensor's size puts it): transcendental math and activations.
_TRANSCENDENTAL = ("exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan", "tanh", "sigmoid",
                   "erf", "erfc", "erfinv", "atan", "asin", "acos", "sinh", "cosh", "pow", "rsqrt", "float_power")
_ACTIVATIONS = ("gelu", "silu", "mish", "softplus", "elu", "selu", "celu", "logsigmoid", "tanh", "sigmoid")


def lane_functions() -> frozenset:
    """The elementwise functions admitted by :func:`same_lanes` (transcendental math and
    activations, plain and in place, and ``**``)."""
    global _LANE_FUNCTIONS
    if _LANE_FUNCTIONS is None:
        F = torch.nn.functional
        T = torch.Tensor
        named = {getattr(owner, f"{name}{suffix}", None) for owner in (torch, T) for name in _TRANSCENDENTAL
                 for suffix in ("", "_")}
        named |= {getattr(F, name, None) for name in _ACTIVATIONS} | {T.__pow__, T.__rpow__, T.__ipow__}
        _LANE_FUNCTIONS = frozenset(named - {None})
    return _LANE_FUNCTIONS


def proved_functions() -> frozenset:
    """The functions admitted by a proof on synthetic operands: matmuls, attention, convolutions,
    reductions, norms and softmax (and the activations that reduce or split: ``glu``,
    ``normalize``)."""
    global _PROVED_FUNCTIONS
    if _PROVED_FUNCTIONS is None:
        F = torch.nn.functional
        T = torch.Tensor
        named = {
            F.linear, F.bilinear, F.scaled_dot_product_attention, F.conv1d, F.conv2d, F.conv3d,
            torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm,
            torch.addmm, T.addmm, torch.baddbmm, T.baddbmm, torch.einsum, torch.tensordot,
            F.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, T.softmax,
            torch.log_softmax, T.log_softmax, torch.mean, T.mean, torch.sum, T.sum, torch.var, T.var,
            torch.std, T.std, torch.norm, T.norm, torch.logsumexp, T.logsumexp, torch.cumsum, T.cumsum,
            getattr(F, "rms_norm", None), F.glu, F.normalize,
        }
        _PROVED_FUNCTIONS = frozenset(named - {None})
    return _PROVED_FUNCTIONS


def probed_functions() -> frozenset:
    """Every function :class:`RowExactness` watches (:func:`lane_functions` and
    :func:`proved_functions`)."""
    return lane_functions() | proved_functions()


def _tails(numel: int, block: int, threads: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of a contiguous elementwise loop over ``numel`` elements that
    the scalar tail computes: torch splits the range among ``min(threads, ceil(numel / GRAIN))``
    threads in chunks of ``ceil(numel / n)`` and each chunk runs ``block`` elements at a time."""
    n = max(1, min(threads, -(-numel // GRAIN_SIZE))) if threads > 1 and numel >= GRAIN_SIZE else 1
    chunk = -(-numel // n)
    out = []
    for begin in range(0, numel, chunk):
        length = min(chunk, numel - begin)
        if length % block:
            out.append((begin + length - length % block, begin + length))
    return out


def _tail_offsets(tails: list[tuple[int, int]], rows: int, row: int) -> list[frozenset[int]]:
    """For each of ``rows`` rows of ``row`` elements laid end to end: the offsets within it that a
    scalar tail computes."""
    out: list[set[int]] = [set() for _ in range(rows)]
    for start, end in tails:
        for i in range(start, end):
            out[i // row].add(i % row)
    return [frozenset(o) for o in out]


@functools.lru_cache(maxsize=1024)
def same_lanes(numel: int, itemsize: int, *, prompts: int, repeats: int, threads: int) -> bool:
    """Whether an elementwise loop over a contiguous ``numel`` elements laid out as ``prompts``
    rows computes each element on the same path (vector body or scalar tail) as the loop over the
    ``prompts * repeats`` rows of DynamicCache's tensor (each prompt's row ``repeats`` times in a
    row) computes each of its repeats, for every vector width in :data:`VECTOR_BYTES` — so the
    call gives DynamicCache's bits whatever the values."""
    if numel % prompts:
        return False
    row = numel // prompts
    for width in VECTOR_BYTES:
        block = max(1, 2 * width // itemsize)
        alone = _tail_offsets(_tails(numel, block, threads), prompts, row)
        tall = _tail_offsets(_tails(numel * repeats, block, threads), prompts * repeats, row)
        for p in range(prompts):
            if any(tall[p * repeats + i] != alone[p] for i in range(repeats)):
                return False
    return True


def expand_operand(t: torch.Tensor, prompts: int, k: int) -> torch.Tensor:
    """``t`` (dim 0 = ``prompts * r`` rows, ``r`` rows per prompt) as DynamicCache holds it: dim 0
    ``prompts * k * r``, each prompt's ``r`` rows repeated ``k`` times in a row, with ``t``'s
    strides and storage offset (a stride-0 dim 0 of several rows stays a broadcast).

    One row's dim 0 has no layout: a view may give it stride 0 (``repeat_kv``'s ``expand`` and
    ``reshape`` of one row's keys, ``[1, 1, T, D] -> [1, H, T, D]``, make strides ``(0, 0, D, 1)``
    where DynamicCache's rows get ``(T*D, 0, D, 1)``), and a matmul over a batch whose every
    stride is 0 takes another kernel (one ``mm``) than over rows that follow one another
    (``bmm``): there the rows follow one another, each one row's extent after the last."""
    n = t.shape[0]
    size = (n * k, *t.shape[1:])
    strides = t.stride()
    if strides[0] == 0 and n > 1:
        return t.as_strided(size, strides, t.storage_offset())
    if strides[0] == 0:
        strides = (_reach(t.shape[1:], strides[1:]), *strides[1:])
    values = t.reshape(prompts, n // prompts, *t.shape[1:]).repeat_interleave(k, dim=0).reshape(size)
    span = _reach(size, strides)
    storage = t.new_empty(t.storage_offset() + span)
    out = storage.as_strided(size, strides, t.storage_offset())
    # a stride-0 dim (a broadcast inside each row) holds one value along it: written once
    once = tuple(1 if st == 0 else s for s, st in zip(size, strides))
    if _overlaps(once, strides):
        # dim 0 is not the outermost in memory (a transposed [B, T, C] view of [T, B, C] states: the rows
        # of a sequence-first layer): at k x the rows its strides alias, and DynamicCache's own tensor
        # has other strides, which nothing here can know; no call here can be DynamicCache's
        raise InexactRows(f"an operand's rows are not its outermost dim (shape {list(t.shape)}, strides "
                          f"{list(t.stride())}): a layer that does not lay its activations out rows first")
    base = storage.as_strided(once, strides, t.storage_offset())
    base.copy_(values[tuple(slice(0, 1) if st == 0 else slice(None) for st in strides)])
    return out


def _overlaps(shape: Any, strides: Any) -> bool:
    """Whether a view of ``shape`` and ``strides`` may reach one element twice: ordered by stride,
    each dim (of more than one element) must step past everything the smaller ones reach."""
    reach = 0
    for stride, n in sorted((st, n) for n, st in zip(shape, strides) if n > 1):
        if stride <= reach:
            return True
        reach += (n - 1) * stride
    return False


def _reach(shape: Any, strides: Any) -> int:
    """Elements a view of ``shape`` and ``strides`` reaches from its first (none empty)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


def _describe(value: Any) -> Any:
    """A hashable stand-in for an argument: a tensor's layout (not its values), else the value."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride() if value.layout == torch.strided else None,
                value.storage_offset() % 64 if value.layout == torch.strided else None, value.dtype,
                value.device.type, isinstance(value, torch.nn.Parameter))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_describe(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _describe(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


@dataclass(slots=True)
class _Counts:
    probed: int = 0     # signatures compared in this forward
    expanded: int = 0   # calls that ran on the expanded rows (their signature is not exact)
    partial: int = 0    # calls that ran on some repeats of each prompt (proved for them, not for one)


class RowExactness(TorchFunctionMode):
    """While active (``with RowExactness(prompts=B, repeats=k):`` around a forward on ``B`` rows)
    and :attr:`watching` is set, every watched call (:func:`probed_functions`) runs on the ``B``
    rows where the module docstring's rule admits it, else on DynamicCache's ``B*k`` rows.

    Row-indexed operands are the tensors whose dim 0 is a multiple of ``prompts`` and that are not
    ``nn.Parameter``s (weights and biases are shared by all rows). A call with none, or whose
    result is not indexed by row, is not watched: the base model's activations have their rows
    first; a tensor with its rows elsewhere (multimodal rotary position ids ``[3, B, T]``, used
    in an outer product of one term, exact at any size) is not expanded along them.

    Invariant: a kept proof's verdict is the one its proof gives for its key; no verdict comes
    from the values of a call.
    """

    def __init__(self, *, prompts: int, repeats: int) -> None:
        super().__init__()
        self.prompts = prompts
        self.repeats = repeats
        self.watching = False
        self.base_calls = 0  # forwards of the watched module (the caller switches ``watching``)
        self.counts = _Counts()
        self._machine = _machine()  # read once: settings do not change inside one forward
        # the digests of the kept operands seen in this forward (an attention mask is one tensor passed to
        # every layer): tensor id -> (the tensor, kept alive so its id is not reused; its version; digest)
        self._digests: dict[int, tuple[torch.Tensor, int | None, tuple]] = {}

    @property
    def expanded(self) -> int:
        """Calls that ran on DynamicCache's rows (not admitted by the rule or a proof)."""
        return self.counts.expanded

    @property
    def partial(self) -> int:
        """Calls that ran on ``m`` repeats of each prompt, ``1 < m < k`` (admitted there by a proof)."""
        return self.counts.partial

    def _rows(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.dim() > 0
                and value.shape[0] % self.prompts == 0 and value.shape[0] > 0)

    def _expand(self, value: Any, repeats: int) -> Any:
        """``value``'s row operands expanded to ``repeats`` repeats of each prompt."""
        if self._rows(value):
            return expand_operand(value, self.prompts, repeats)
        if isinstance(value, (tuple, list)):
            return type(value)(self._expand(v, repeats) for v in value)
        return value

    def _call_on(self, func: Any, args: tuple, kwargs: dict, repeats: int) -> Any:
        """``func`` on its operands expanded to ``repeats`` repeats of each prompt."""
        return func(*self._expand(args, repeats), **{name: self._expand(v, repeats) for name, v in kwargs.items()})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.watching or func not in probed_functions():
            return func(*args, **kwargs)
        operands = [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (tuple, list)) else (a,))]
        if not any(self._rows(a) for a in operands):
            return func(*args, **kwargs)
        repeats = self._repeats_for(func, args, kwargs, operands)
        if repeats == 1:
            return func(*args, **kwargs)
        return self._on_repeats(func, args, kwargs, repeats)

    # ----------------------------------------------------------------------------- the rule
    def _repeats_for(self, func: Any, args: tuple, kwargs: dict, operands: list[Any]) -> int:
        """The repeats of each prompt the call runs on: 1 where admitted on the unique rows, ``m``
        where a proof admits ``m`` repeats, else ``k`` (DynamicCache's rows)."""
        if func in lane_functions():
            return 1 if self._same_lanes(operands) else self.repeats
        if _values_decide_rows(func, args, kwargs):
            return self.repeats
        key = (func, _describe(args), _describe(kwargs), self.prompts, self.repeats, torch.get_num_threads(),
               self._machine, self._fixed_values(func, args, kwargs))
        verdict = _VERDICTS.get(key)
        if verdict is None:
            kept = proof_file()
            stable = _portable(key) if kept is not None else None  # None: not kept across processes
            verdict = kept.get(stable) if stable is not None else None
            if verdict is None or verdict_repeats(verdict, self.repeats) is None:
                self.counts.probed += 1
                verdict = self._prove(func, args, kwargs)
                if stable is not None:
                    kept.put(stable, verdict)
            _remember(key, verdict)
        return verdict_repeats(verdict, self.repeats) or self.repeats  # a verdict it cannot read: every row

    def _same_lanes(self, operands: list[Any]) -> bool:
        """An elementwise call: every row operand contiguous and of one shape, every other tensor
        operand one element, and :func:`same_lanes` for its loop."""
        rows = [a for a in operands if self._rows(a)]
        others = [a for a in operands if isinstance(a, torch.Tensor) and not self._rows(a)]
        first = rows[0]
        if any(not t.is_contiguous() or t.shape != first.shape or t.dtype != first.dtype for t in rows) \
                or any(t.numel() != 1 for t in others):
            return False
        return same_lanes(first.numel(), first.element_size(), prompts=self.prompts, repeats=self.repeats,
                          threads=torch.get_num_threads())

    def _prove(self, func: Any, args: tuple, kwargs: dict) -> Verdict:
        """The verdict of :data:`PROOF_DRAWS` synthetic draws of the call's operands (same layout,
        other values), each run on the ``B`` rows and on their expansion to ``B*k``; where the
        ``B`` rows differ, the same draws on ``B*m`` rows for the ``m`` of :func:`repeat_ladder`,
        smallest first (the smallest ``m`` that matches a draw is the only one the next draw tries)."""
        keep = _real_operands(func, args, kwargs)
        ladder: list[int] | None = None  # None: the unique rows hold so far
        for phase in ("unique", "ladder"):
            generator = torch.Generator().manual_seed(0)  # both phases see the same draws
            for draw in range(PROOF_DRAWS):
                def fake(value: Any) -> Any:
                    return _synthetic(value, generator, draw, keep=keep)

                try:
                    fake_args = tuple(fake(a) for a in args)
                    fake_kwargs = {name: fake(v) for name, v in kwargs.items()}
                    big = self._call_on(func, fake_args, fake_kwargs, self.repeats)
                    if phase == "ladder":
                        ladder = next(([m] for m in ladder or () if self._same_as_first_repeats(
                            self._call_on(func, fake_args, fake_kwargs, m), big, m)), [])
                        if not ladder:
                            return self._every_row
                        continue
                    out = func(*fake_args, **fake_kwargs)
                except Exception:  # noqa: BLE001 - a call the synthetic operands do not fit: DynamicCache's rows
                    return self._every_row
                if not self._rows(out):
                    return "exact"  # a result not indexed by row: nothing per row to compare
                if not self._same_as_first_repeats(out, big, 1):
                    ladder = repeat_ladder(self.repeats)
                    if not ladder:
                        return self._every_row
                    break
            if ladder is None:
                return "exact"
        return f"repeats:{ladder[0]}"

    @property
    def _every_row(self) -> Verdict:
        """The verdict that runs a call on DynamicCache's ``B*k`` rows."""
        return f"repeats:{self.repeats}"

    def _fixed_values(self, func: Any, args: tuple, kwargs: dict) -> tuple:
        """The values of the operands a proof keeps (:func:`_real_operands`): part of its key
        (each tensor hashed once per forward while its version stands)."""
        keep = _real_operands(func, args, kwargs)
        out = []
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor) and id(v) in keep:
                version = _version_of(v)
                seen = self._digests.get(id(v))
                if seen is None or seen[0] is not v or version is None or seen[1] != version:
                    seen = self._digests[id(v)] = (v, version, _digest(v))
                out.append(seen[2])
        return tuple(out)

    # ----------------------------------------------------------------------------- DynamicCache's rows
    def _on_repeats(self, func: Any, args: tuple, kwargs: dict, repeats: int) -> Any:
        """The call on its operands expanded to ``repeats`` repeats of each prompt (``k``:
        DynamicCache's rows; fewer where a proof admits them); one repeat per prompt handed back,
        in the unique call's layout, when the repeats are equal. Fewer repeats that differ among
        themselves (a proof's draws did not show it) run again on DynamicCache's ``k``; ``k``
        repeats that differ raise :class:`InexactRows`."""
        try:  # first: an in-place function changes its operand
            big = self._call_on(func, args, kwargs, repeats)
        except Exception as exc:  # the operands are not laid out as this module assumes
            raise InexactRows(f"{_name(func)} could not be run on the expanded rows ({type(exc).__name__})") from exc
        # the unique call still runs, for its output's layout (DynamicCache's call lays its output out the
        # same way, and later calls may take another path for another layout) and an in-place operand
        out = func(*args, **kwargs)
        if not self._rows(out):  # a result not indexed by row: no row to hand back
            return out
        if not (isinstance(big, torch.Tensor) and big.shape[1:] == out.shape[1:]
                and big.shape[0] == out.shape[0] * repeats):
            raise InexactRows(f"{_name(func)} did not return one tensor of the expanded rows")
        grouped = self._grouped(big, repeats)
        if not _bits_equal(grouped, grouped[:, :1].expand_as(grouped)):
            if repeats < self.repeats:  # the proof's fewer repeats differ among themselves on these values
                return self._on_repeats(func, args, kwargs, self.repeats)  # (2-core AMD EPYC): DynamicCache's rows
            raise InexactRows(f"{_name(func)} computes a prompt's repeats differently from each other at "
                              f"{torch.get_num_threads()} thread(s)")
        if repeats == self.repeats:
            self.counts.expanded += 1
        else:
            self.counts.partial += 1
        return out.copy_(grouped[:, 0].reshape(-1, *big.shape[1:]))  # DynamicCache's bits

    def _grouped(self, big: torch.Tensor, repeats: int) -> torch.Tensor:
        return big.reshape(self.prompts, repeats, -1, *big.shape[1:])

    def _same_as_first_repeats(self, out: Any, big: Any, repeats: int) -> bool:
        """Whether every repeat in ``big`` (``k`` repeats of each prompt) equals the first repeat
        of ``out`` (``repeats`` repeats) bit for bit."""
        if not (isinstance(out, torch.Tensor) and isinstance(big, torch.Tensor) and out.dim() > 0
                and big.shape[1:] == out.shape[1:] and big.shape[0] * repeats == out.shape[0] * self.repeats):
            return False
        grouped = self._grouped(big, self.repeats)  # [B, k, r, ...]
        return _bits_equal(grouped, self._grouped(out, repeats)[:, :1].expand_as(grouped))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bits (NaNs of one pattern compare equal, ``-0.0`` and ``0.0`` not)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def _machine() -> tuple:
    """What a kernel's choice depends on besides the call: the CPU capability and matmul settings."""
    return (torch.backends.cpu.get_cpu_capability(), torch.get_float32_matmul_precision(),
            torch.backends.mkldnn.enabled, torch.are_deterministic_algorithms_enabled())


#: Floating-point types narrower than the accumulators of the host's kernels (float32).
_HALF = (torch.bfloat16, torch.float16)


def _values_decide_rows(func: Any, args: tuple, kwargs: dict) -> bool:
    """Calls whose result on the unique rows can differ from DynamicCache's rows for some values
    and not for others, so that no proof by synthetic draws settles them: they run on every row.
    Measured on the host (2-core machines):

    * a half-precision call of a proved function (a matmul, attention, a norm, a reduction), at any
      thread count: its kernel accumulates in float32 and rounds the result to bfloat16 / float16,
      which hides a different summation order in all but the few results that sit near a rounding
      boundary (a tiny bfloat16 Llama's ``v_proj`` on an Intel Xeon with AVX512-BF16, 2 prompt
      tokens on one row against two: 1 of 100 random inputs differed, its real input did, and the
      first logits of 2 samples were 0.002 from DynamicCache's where three draws had agreed);
    * at more than one intra-op thread, SDPA with an explicit mask (T5's cross-attention on an AMD
      EPYC, AVX2: three draws agreed, the real keys and queries of a 3-prompt batch gave logits
      2.4e-7 apart), or SDPA that is not causal, mask or not (an encoder-decoder's cross-attention
      at its first decoder step, one query over the unpadded source: on an Intel Xeon, one row
      against four differed in 32 of 100 random draws of a float32 shape of 2 heads, 23 keys and
      head dim 16, up to 100 of 100 for others, for 1 to 3 queries and odd batches; a tiny
      Marian's first logits with prefill once were 2.4e-7 from DynamicCache's where three draws had
      agreed). Causal SDPA, the self-attention of a prompt, differed in none of the same scan."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or tensors[0].device.type != "cpu":
        return False
    if func in proved_functions() and any(t.dtype in _HALF for t in tensors):
        return True
    if func is not torch.nn.functional.scaled_dot_product_attention or torch.get_num_threads() < 2:
        return False
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    return isinstance(mask, torch.Tensor) or not causal


def _real_operands(func: Any, args: tuple, kwargs: dict) -> frozenset[int]:
    """Ids of the operands a proof keeps as they are: an attention's mask (its values decide which
    keys a query reads) and every tensor that is not floating point (indices, boolean masks)."""
    keep = {id(v) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and not v.is_floating_point()}
    if func is torch.nn.functional.scaled_dot_product_attention:
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if isinstance(mask, torch.Tensor):
            keep.add(id(mask))
    return frozenset(keep)


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change), or ``None`` for an inference
    tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _digest(t: torch.Tensor) -> tuple:
    """``t``'s shape, dtype and a digest of its bytes (the same in every process: a proof's key
    may be kept on disk, :mod:`hf_vkv.generate.proof_file`)."""
    flat = t.detach().cpu().reshape(-1).clone()
    if flat.is_floating_point():
        flat = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    return tuple(t.shape), str(t.dtype), hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).hexdigest()


def _portable(key: tuple) -> str | None:
    """The proof file's key for a signature (:func:`proof_file.digest`), or ``None`` where the
    signature's text is not the same in every process (an argument shown by its address)."""
    func, *rest = key
    text = repr((f"{getattr(func, '__module__', '')}.{_name(func)}", *rest))
    return None if " at 0x" in text else digest((text, PROOF_DRAWS, PROOF_METHOD))


def _synthetic(value: Any, generator: torch.Generator, draw: int, *, keep: frozenset[int]) -> Any:
    """``value`` with every floating-point tensor (not in ``keep``) replaced by one of the same
    shape, strides, dtype and device, and the same storage offset modulo 64 elements (what the
    proof's key holds of it: the alignment; a view into a cache's reservation sits far into it),
    holding draw ``draw``'s values."""
    if isinstance(value, (tuple, list)):
        return type(value)(_synthetic(v, generator, draw, keep=keep) for v in value)
    if not isinstance(value, torch.Tensor) or id(value) in keep or not value.is_floating_point():
        return value
    span = _reach(value.shape, value.stride()) if value.numel() else 0
    offset = value.storage_offset() % 64
    storage = _draw(offset + span, value.dtype, generator, draw).to(value.device)
    out = storage.as_strided(value.shape, value.stride(), offset)
    return torch.nn.Parameter(out, requires_grad=False) if isinstance(value, torch.nn.Parameter) else out


def _draw(n: int, dtype: torch.dtype, generator: torch.Generator, draw: int) -> torch.Tensor:
    """``n`` values in ``dtype``: draw 0 normal; 1 magnitudes log-uniform over up to 12 decades
    (products stay normal numbers), random signs; 2 normal with zeros (10 %), extremes (0.5 %) and
    subnormals (0.02 %: a few per row) mixed in. Subnormals are few on purpose: an operation on one
    costs the CPU ~100 cycles, and a matmul over many took 10x its real call."""
    info = torch.finfo(dtype)
    large = 2.0 ** (math.log2(info.max) / 4)  # products and sums of a few thousand stay finite
    wide = torch.float64 if dtype == torch.float64 else torch.float32  # subnormals of float32 and narrower fit
    normal = torch.randn(n, generator=generator, dtype=wide)
    if draw == 0:
        values = normal
    elif draw == 1:
        decades = min(6.0, math.log10(large) / 2)
        magnitude = 10 ** (decades * (2 * torch.rand(n, generator=generator, dtype=wide) - 1))
        values = torch.where(torch.rand(n, generator=generator) < 0.5, -magnitude, magnitude)
    else:
        pick = torch.rand(n, generator=generator, dtype=wide)
        values = torch.where(pick < 0.1, 0.0, normal)
        subnormal = info.tiny * torch.rand(n, generator=generator, dtype=torch.float64)
        values = torch.where((pick >= 0.1) & (pick < 0.1002), subnormal.to(wide), values)
        values = torch.where((pick >= 0.1002) & (pick < 0.105), large * normal.sign(), values)
    return values.to(dtype)


def _remember(key: tuple, verdict: Verdict) -> None:
    _VERDICTS[key] = verdict
    while len(_VERDICTS) > _MAX_VERDICTS:
        _VERDICTS.popitem(last=False)


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
