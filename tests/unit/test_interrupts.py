"""Ctrl-C held while hf_vkv's bookkeeping is half done (``hf_vkv.memory.interrupts``): a SIGINT that
comes inside a section is raised as the outermost one ends; the handler that was in place before
is back afterwards; a handler that is not Python's is left alone; other threads count nothing."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from hf_vkv.memory import SectionLock, guarded, section
from hf_vkv.memory.interrupts import held_now, register_critical


def _busy(seconds: float) -> None:
    """Run bytecodes for ``seconds`` (where a pending SIGINT is raised)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_sigint_in_a_section_is_raised_as_the_outermost_section_ends() -> None:
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with section():
            with section():
                signal.raise_signal(signal.SIGINT)
                _busy(0.01)
                done.append("inner")
            _busy(0.01)
            done.append("outer")  # the inner section's end raised nothing
    assert done == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is before
    assert not held_now()


def test_a_section_without_sigint_raises_nothing_and_puts_the_handler_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with section():
        assert held_now()
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_a_guarded_scope_holds_nothing_outside_its_sections() -> None:
    before = signal.getsignal(signal.SIGINT)
    with guarded():
        assert not held_now()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            _busy(0.01)
        with pytest.raises(KeyboardInterrupt):
            with section():
                signal.raise_signal(signal.SIGINT)
                _busy(0.01)
        assert signal.getsignal(signal.SIGINT) is not before  # installed for the whole scope
    assert signal.getsignal(signal.SIGINT) is before


def test_holding_a_section_lock_holds_sigint() -> None:
    lock = SectionLock()
    done = []
    with pytest.raises(KeyboardInterrupt):
        with lock:
            signal.raise_signal(signal.SIGINT)
            _busy(0.01)
            done.append("held")
        _busy(0.01)
    assert done == ["held"]
    assert lock._lock.acquire(blocking=False)  # released before the interrupt was raised
    lock._lock.release()


def test_an_ignored_sigint_stays_ignored() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with section():
            assert not held_now()
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            _busy(0.01)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_user_handler_is_called_once_after_the_section() -> None:
    calls = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with section():
            signal.raise_signal(signal.SIGINT)
            _busy(0.01)
            assert calls == []
        _busy(0.01)
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_sigint_in_a_critical_function_comes_after_it_returns() -> None:
    """A finalizer's first bytecodes run before its section: a SIGINT there is raised again once
    it has run (a finalizer's exception would be printed and lost)."""
    done = []

    @register_critical
    def finalizer() -> None:
        signal.raise_signal(signal.SIGINT)
        _busy(0.01)
        done.append("finalizer")

    with guarded():
        with pytest.raises(KeyboardInterrupt):
            finalizer()
            assert done == ["finalizer"]
            _busy(2.0)  # the SIGINT comes again a few ms later
    assert done == ["finalizer"]


def test_other_threads_count_nothing() -> None:
    seen = []

    def work() -> None:
        with section():
            seen.append(held_now())
        with SectionLock():
            seen.append(held_now())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [False, False]
    assert not held_now()
