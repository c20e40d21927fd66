"""Progress output that suits where it goes.

* on a terminal: a ``tqdm`` bar that erases itself when done;
* anywhere else (CI logs, ``2> file``): no carriage-return updates at all, one plain line per
  bar when it closes (``"  vkv: 16 steps in 3.2 s"``);
* ``enabled=False`` (``--quiet``): nothing.

Every progress bar of :mod:`hf_vkv.ab` and the CLI goes through :func:`progress_bar`, so this is
the one place that decides what reaches stderr while a run is going on.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Protocol

__all__ = ["Progress", "is_terminal", "progress_bar", "quiet_library_progress"]


class Progress(Protocol):
    """What a progress bar offers its producer."""

    def update(self, n: int = 1) -> Any:
        """Advance by ``n`` units."""

    def close(self) -> Any:
        """Finish (a plain-line bar writes its one line here)."""


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` is an interactive terminal (a closed or odd stream counts as not one)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


class _Silent:
    """No output at all."""

    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to write."""


class _OneLine:
    """Counts silently; on :meth:`close` writes one line with the count and the elapsed time."""

    def __init__(self, *, label: str, unit: str, stream: IO[str]) -> None:
        self.label = label
        self.unit = unit
        self.stream = stream
        self.count = 0
        self._t0 = time.perf_counter()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.count += n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        elapsed = time.perf_counter() - self._t0
        plural = "" if self.count == 1 else "s"
        print(f"  {self.label}: {self.count} {self.unit}{plural} in {elapsed:.1f} s", file=self.stream, flush=True)


def progress_bar(*, total: int | None, label: str, unit: str, enabled: bool = True,
                 stream: IO[str] | None = None) -> Progress:
    """A progress bar for ``total`` units (``None``: unknown) on ``stream`` (default stderr).

    A ``tqdm`` bar when ``stream`` is a terminal, one line at :meth:`~Progress.close` otherwise,
    nothing when ``enabled`` is false.
    """
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return _Silent()
    if not is_terminal(stream):
        return _OneLine(label=label.strip(), unit=unit, stream=stream)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit=unit, file=stream, leave=False)


def quiet_library_progress(*, quiet: bool, stream: IO[str] | None = None) -> None:
    """Turn off transformers' own bars (``Loading weights: ...``) with ``quiet`` or off a terminal."""
    if quiet or not is_terminal(sys.stderr if stream is None else stream):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
