"""Row-exactness proofs kept on disk: a process does not prove again what an earlier one proved.

A proof's verdict (:mod:`hf_vkv.generate.row_exactness`) depends only on its signature — the
function, the operands' layouts, the rows, the thread count, the CPU capability and matmul
settings, the values of the operands it keeps (masks, indices) — and on the software and machine
that run the kernel. So it can be kept across processes when its key holds all of that too: this
module's key is a SHA-256 over the signature (in a form that is the same in every process) and
:func:`environment`: the versions of torch and hf_vkv, torch's build configuration (its BLAS and
oneDNN), the CPU's model name, the number of proof draws. A signature proved once on a machine is
then never proved again there, so only a machine's first call of a shape pays for the proof.

The file is a list of JSON lines ``{"key": <hex>, "verdict": "exact" | "repeats:<m>"}``, appended
with one ``write`` per verdict (``O_APPEND``: concurrent processes interleave whole lines). A
line that does not parse, or names another verdict, is ignored; a file that cannot be read or
written (a read-only home) only means proving again: it never fails a ``generate``.

Where: ``HF_VKV_PROOF_CACHE`` names the file; ``off`` (or ``0``, or empty) keeps proofs in the
process only. Default: ``$XDG_CACHE_HOME/hf_vkv/row_proofs.jsonl`` (``~/.cache/...``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
from pathlib import Path

import torch

from ..memory.process import ProcessLock

__all__ = ["ENV_VAR", "ProofFile", "digest", "environment", "proof_file"]

#: The environment variable naming the file (``off``: none).
ENV_VAR = "HF_VKV_PROOF_CACHE"


def _is_verdict(value: object) -> bool:
    """``value`` is a verdict this module keeps: ``exact``, ``repeats:<m>`` (``m > 1``) or, from
    versions before the repeat ladder, ``expanded`` (which row exactness proves again)."""
    return isinstance(value, str) and (value in ("exact", "expanded") or (
        value.startswith("repeats:") and value[8:].isdigit() and int(value[8:]) > 1))


@functools.cache
def environment() -> str:
    """What a kept verdict depends on besides its signature, as one string: torch's version and
    build configuration (BLAS, oneDNN, compiler flags), hf_vkv's version, the machine and CPU model."""
    from ..version import __version__

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    config = hashlib.sha256(torch.__config__.show().encode()).hexdigest()
    return repr((torch.__version__, config, __version__, platform.machine(), model or platform.processor()))


class ProofFile:
    """The verdicts kept in one file (module docstring). Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._known: dict[str, str] | None = None
        self._lock = ProcessLock()  # the process's one object for its path: unheld in a forked child

    def _load(self) -> dict[str, str]:
        if self._known is None:
            known: dict[str, str] = {}
            with contextlib.suppress(OSError), open(self.path, encoding="utf-8") as f:  # no file: nothing kept yet
                for line in f:
                    try:
                        item = json.loads(line)
                        if _is_verdict(item["verdict"]) and isinstance(item["key"], str):
                            known[item["key"]] = item["verdict"]
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn or foreign line: that verdict is proved again
            self._known = known
        return self._known

    def get(self, key: str) -> str | None:
        """The verdict kept for ``key``, or ``None``."""
        with self._lock:
            return self._load().get(key)

    def put(self, key: str, verdict: str) -> None:
        """Keep ``verdict`` for ``key`` (appended; a failure to write is ignored)."""
        if not _is_verdict(verdict):
            return
        with self._lock:
            known = self._load()
            if known.get(key) == verdict:
                return
            known[key] = verdict
            line = (json.dumps({"key": key, "verdict": verdict}) + "\n").encode()
            with contextlib.suppress(OSError):  # an unwritable file: the verdict stays in the process
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)


_FILES: dict[Path, ProofFile] = {}
_FILES_LOCK = ProcessLock()  # unheld in a forked child


def proof_file() -> ProofFile | None:
    """The file ``HF_VKV_PROOF_CACHE`` names now (its default when unset), or ``None`` when it
    says ``off``. One :class:`ProofFile` per path in a process."""
    value = os.environ.get(ENV_VAR)
    if value is not None and value.strip().lower() in ("", "0", "off", "false", "no"):
        return None
    if value is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = base / "hf_vkv" / "row_proofs.jsonl"
    else:
        path = Path(value).expanduser()
    with _FILES_LOCK:
        if path not in _FILES:
            _FILES[path] = ProofFile(path)
        return _FILES[path]


def digest(signature: object) -> str:
    """The file's key for a signature whose ``repr`` is the same in every process."""
    return hashlib.sha256(repr((environment(), signature)).encode()).hexdigest()
