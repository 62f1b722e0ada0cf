"""How long to wait before the next attempt: one schedule type for every retry loop.

The loops that retry (Telegram's getUpdates and getMe, the IMAP connection, a tool server's
restart, the outbox's deliveries) each keep their own count of failures, because what resets
it differs (a connection that lasted, a stored update, a server that ran a minute) and each
reports the delay in its status and log. What they share is only this: a schedule of delays,
the last one repeated. tenacity was considered and not taken: its retry decorators own the
loop and the count, which here are the interesting part, and the schedule is a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays in seconds: `delay(0)` before the first retry, the last one for good."""

    steps: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.steps or any(step < 0 for step in self.steps):
            raise ValueError(f"a backoff needs delays of 0 s or more, got {self.steps!r}")

    def delay(self, failures: int) -> float:
        """The wait after `failures` failed attempts in a row (0: the first retry)."""
        return self.steps[min(max(failures, 0), len(self.steps) - 1)]

    @classmethod
    def doubling(cls, first_s: float, most_s: float) -> Backoff:
        """`first_s`, twice that, ... up to `most_s`."""
        steps = [first_s]
        while steps[-1] * 2 < most_s:
            steps.append(steps[-1] * 2)
        return cls((*steps, most_s))


# Reconnecting to a service that is down (the Bot API, an IMAP server).
RECONNECT = Backoff((1, 2, 5, 10, 30, 60))
