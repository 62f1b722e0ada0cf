"""One schedule of delays for every retry loop (butlers.backoff)."""

from __future__ import annotations

import pytest

from butlers.backoff import RECONNECT, Backoff


def test_the_last_delay_repeats() -> None:
    backoff = Backoff((1, 2, 5))
    assert [backoff.delay(n) for n in range(5)] == [1, 2, 5, 5, 5]
    assert backoff.delay(-1) == 1  # never before the first


def test_doubling_stops_at_its_most() -> None:
    assert Backoff.doubling(1.0, 60.0).steps == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
    assert Backoff.doubling(5.0, 5.0).steps == (5.0, 5.0)


def test_reconnecting_waits_at_most_a_minute() -> None:
    assert RECONNECT.delay(0) == 1 and RECONNECT.delay(100) == 60


@pytest.mark.parametrize("steps", [(), (1, -1)])
def test_a_schedule_without_delays_or_with_a_negative_one_is_refused(steps: tuple) -> None:
    with pytest.raises(ValueError, match="a backoff needs delays of 0 s or more"):
        Backoff(steps)
