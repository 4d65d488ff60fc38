"""The stop-signal handling of `batchrl run` (batchrl/pipeline/interrupts.py), with real signals sent to this
process: one KeyboardInterrupt, never one inside clean-up, and handlers that ray.init replaces put back."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest

from batchrl.pipeline import interrupts


@pytest.fixture
def installed(monkeypatch):
    """The CLI's handlers, with fresh state; pytest's own handlers are put back afterwards."""
    before = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}
    monkeypatch.setattr(interrupts, "_State", type("_State", (), dict(received=None, raised=False, deferring=0)))
    interrupts.install()
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def signal_self(signum: int) -> None:
    """Sends ``signum`` to this process and gives Python the moment to run its handler (between bytecodes)."""
    os.kill(os.getpid(), signum)
    time.sleep(0.05)


def test_the_first_stop_signal_raises_keyboard_interrupt_and_later_ones_are_only_logged(installed, caplog):
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        signal_self(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger=interrupts.__name__):
        signal_self(signal.SIGINT)  # e.g. ^C while the run cleans up: no second KeyboardInterrupt
        signal_self(signal.SIGTERM)
    assert interrupts.received() == "SIGTERM"
    assert [r.getMessage().split(" ")[0] for r in caplog.records] == ["SIGINT", "SIGTERM"]


def test_a_signal_during_deferred_clean_up_is_raised_when_the_clean_up_ends(installed):
    finished = []
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        with interrupts.deferred():
            with interrupts.deferred():
                signal_self(signal.SIGINT)
                finished.append("inner")
            finished.append("outer")
    assert finished == ["inner", "outer"]


def test_a_handler_replaced_inside_kept_across_is_put_back_and_a_sigterm_it_got_is_passed_on(installed):
    with interrupts.kept_across("a stand-in for ray.init"):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs
    assert signal.getsignal(signal.SIGTERM) is interrupts._on_signal

    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interrupts.kept_across("a stand-in for ray.init"):
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
            signal_self(signal.SIGTERM)  # Ray's handler exits with 15; the run must exit 4 as for any SIGTERM
    assert signal.getsignal(signal.SIGTERM) is interrupts._on_signal


def test_an_exit_from_ray_init_with_absls_abort_alarm_armed_is_taken_for_the_sigterm_it_was_and_disarmed(installed):
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interrupts.kept_across("a stand-in for ray.init"):
            signal.alarm(3)  # what absl's failure handler arms on SIGTERM, before Ray's handler exits...
            sys.exit(1)  # ...with 1 when it fired in a wait inside Ray's C++
    assert signal.alarm(0) == 0  # disarmed: it would have aborted the clean-up (exit 134)
