"""StrikePolicy: consecutive faults quarantine for a cool-down; time is passed in."""

from __future__ import annotations

import pytest

from trio_gpuworker._proto import Fault, StrikePolicy


def test_two_consecutive_strikes_quarantine() -> None:
    p = StrikePolicy()
    assert (p.max_strikes, p.cooldown_s) == (2, 600.0)
    assert p.strike(Fault.CRASH, now=100.0) is False
    assert p.cooldown_remaining(100.0) is None
    assert p.strike(Fault.HANG, now=110.0) is True
    assert p.strikes == 2 and p.last_fault is Fault.HANG
    assert p.quarantined_until == 710.0


def test_cooldown_remaining_counts_down() -> None:
    p = StrikePolicy(cooldown_s=600)
    p.strike(Fault.PROTOCOL, now=0.0)
    p.strike(Fault.PROTOCOL, now=10.0)
    assert p.cooldown_remaining(10.0) == 600.0
    assert p.cooldown_remaining(310.0) == 300.0
    assert p.cooldown_remaining(609.5) == pytest.approx(0.5)


def test_success_resets_strikes() -> None:
    p = StrikePolicy()
    p.strike(Fault.CRASH, now=0.0)
    p.success()
    assert p.strikes == 0
    assert p.strike(Fault.CRASH, now=1.0) is False
    assert p.cooldown_remaining(1.0) is None


def test_non_consecutive_strikes_never_quarantine() -> None:
    p = StrikePolicy()
    for t in range(10):
        assert p.strike(Fault.CRASH, now=float(t)) is False
        p.success()
    assert p.quarantined_until is None


def test_expiry_clears_to_zero_strikes() -> None:
    p = StrikePolicy(cooldown_s=60)
    p.strike(Fault.CRASH, now=0.0)
    p.strike(Fault.CRASH, now=1.0)
    assert p.cooldown_remaining(60.9) == pytest.approx(0.1)
    assert p.cooldown_remaining(61.0) is None  # expiry is inclusive
    assert p.strikes == 0 and p.quarantined_until is None
    assert p.strike(Fault.CRASH, now=62.0) is False  # a fresh worker starts from zero
    assert p.strike(Fault.CRASH, now=63.0) is True
    assert p.cooldown_remaining(63.0) == 60.0


def test_strikes_while_quarantined_do_not_extend_it() -> None:
    p = StrikePolicy(cooldown_s=60)
    p.strike(Fault.CRASH, now=0.0)
    assert p.strike(Fault.CRASH, now=0.0) is True
    assert p.strike(Fault.HANG, now=30.0) is False
    assert p.cooldown_remaining(30.0) == 30.0


def test_clear_lifts_quarantine_at_once() -> None:
    p = StrikePolicy()
    p.strike(Fault.CRASH, now=0.0)
    p.strike(Fault.CRASH, now=0.0)
    p.clear()
    assert p.cooldown_remaining(1.0) is None
    assert p.strikes == 0
    assert p.strike(Fault.CRASH, now=2.0) is False


def test_clear_forgets_a_single_strike() -> None:
    p = StrikePolicy()
    p.strike(Fault.CRASH, now=0.0)
    p.clear()
    assert p.strike(Fault.CRASH, now=1.0) is False


def test_configurable_threshold_and_cooldown() -> None:
    p = StrikePolicy(max_strikes=3, cooldown_s=5)
    assert not p.strike(Fault.CRASH, 0.0) and not p.strike(Fault.CRASH, 0.0)
    assert p.strike(Fault.CRASH, 0.0)
    assert p.cooldown_remaining(1.0) == 4.0
    one = StrikePolicy(max_strikes=1, cooldown_s=0)
    assert one.strike(Fault.HANG, 3.0)
    assert one.cooldown_remaining(3.0) is None  # a zero cool-down has already expired


@pytest.mark.parametrize(("max_strikes", "cooldown_s"), [(0, 600), (-1, 600), (2, -1)])
def test_bad_configuration(max_strikes: int, cooldown_s: float) -> None:
    with pytest.raises(ValueError):
        StrikePolicy(max_strikes, cooldown_s)


def test_strikes_after_an_unobserved_expiry_count_from_zero() -> None:
    p = StrikePolicy(cooldown_s=60)
    p.strike(Fault.CRASH, now=0.0)
    p.strike(Fault.CRASH, now=0.0)
    # nobody asked cooldown_remaining() after t=60; two fresh strikes must still quarantine
    assert p.strike(Fault.CRASH, now=100.0) is False
    assert p.strike(Fault.CRASH, now=101.0) is True
    assert p.cooldown_remaining(101.0) == 60.0
