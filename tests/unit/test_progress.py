"""``hf_vkv.ab.progress``: a bar on a terminal, one plain line per bar elsewhere, nothing when off."""

from __future__ import annotations

import io

from hf_vkv.ab.progress import is_terminal, progress_bar


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_one_line_at_close_and_no_carriage_returns() -> None:
    stream = io.StringIO()
    bar = progress_bar(total=50, label="    vkv", unit="step", stream=stream)
    for _ in range(50):
        bar.update(1)
    assert stream.getvalue() == ""  # nothing while running
    bar.close()
    bar.close()  # idempotent
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("  vkv: 50 steps in ") and "\r" not in stream.getvalue()


def test_disabled_writes_nothing() -> None:
    stream = io.StringIO()
    bar = progress_bar(total=3, label="vkv", unit="step", enabled=False, stream=stream)
    bar.update(3)
    bar.close()
    assert stream.getvalue() == ""


def test_on_a_terminal_a_tqdm_bar() -> None:
    stream = _Tty()
    assert is_terminal(stream) and not is_terminal(io.StringIO()) and not is_terminal(None)
    bar = progress_bar(total=2, label="vkv", unit="step", stream=stream)
    bar.update(2)
    bar.close()
    assert "\r" in stream.getvalue()  # tqdm redraws in place: right on a terminal
