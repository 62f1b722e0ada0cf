"""Cron on the butler's wall clock, daylight saving days, one-shot `at` times and the last
due run (butlers.schedule_time): pure functions, checked against the zone database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from butlers.schedule_time import BadTime, last_due, local_now, next_run, parse_at


def runs(cron: str, start: datetime, end: datetime, zone: str) -> list[datetime]:
    found, moment = [], start
    while (moment := next_run(cron, moment, zone)) < end:
        found.append(moment)
    return found


def test_eight_in_tokyo_is_twenty_three_utc() -> None:
    after = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    assert next_run("0 8 * * *", after, "Asia/Tokyo") == datetime(2026, 11, 26, 23, 0, tzinfo=UTC)
    assert next_run("0 8 * * *", after, "UTC") == datetime(2026, 11, 27, 8, 0, tzinfo=UTC)


def test_spring_forward_runs_a_skipped_time_once_at_the_end_of_the_gap() -> None:
    # Europe/Berlin, 2026-03-29: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
    day = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)
    found = runs("30 2 * * *", day, day + timedelta(days=3), "Europe/Berlin")
    assert found == [
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),  # 03:00 CEST: the gap's end
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),  # 02:30 CEST
        datetime(2026, 3, 31, 0, 30, tzinfo=UTC),
    ]
    # Every 15 minutes: the four skipped times are one run at 03:00, not four.
    quarter = runs(
        "*/15 * * * *",
        datetime(2026, 3, 29, 0, 40, tzinfo=UTC),
        datetime(2026, 3, 29, 1, 20, tzinfo=UTC),
        "Europe/Berlin",
    )
    assert quarter == [
        datetime(2026, 3, 29, 0, 45, tzinfo=UTC),  # 01:45 CET
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),  # 03:00 CEST
        datetime(2026, 3, 29, 1, 15, tzinfo=UTC),
    ]


def test_fall_back_runs_a_repeated_time_once() -> None:
    # Europe/Berlin, 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 happens twice.
    day = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)
    found = runs("30 2 * * *", day, day + timedelta(days=2), "Europe/Berlin")
    assert found == [
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),  # its first occurrence, 02:30 CEST
        datetime(2026, 10, 26, 1, 30, tzinfo=UTC),  # 02:30 CET
    ]


def test_at_without_an_offset_is_local_and_the_past_is_refused() -> None:
    now = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    assert parse_at("2026-11-27T09:00", "Europe/Berlin", now) == datetime(
        2026, 11, 27, 8, 0, tzinfo=UTC
    )
    assert parse_at("2026-11-27T09:00+09:00", "Europe/Berlin", now) == datetime(
        2026, 11, 27, 0, 0, tzinfo=UTC
    )
    with pytest.raises(BadTime, match="in the past"):
        parse_at("2026-11-26T12:30", "Europe/Berlin", now)  # 11:30 UTC
    with pytest.raises(BadTime, match="ISO 8601") as refused:
        parse_at("tomorrow at nine", "UTC", now)
    assert "no such date" not in str(refused.value)
    # The right form with no such day: said so, not only "not an ISO 8601 date-time".
    with pytest.raises(BadTime, match=r"no such date or time \(day is out of range for month"):
        parse_at("2027-02-31T09:00", "UTC", now)


def test_last_due_is_the_latest_run_not_after_now() -> None:
    now = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    assert last_due("0 8 * * *", now, "Europe/Berlin") == datetime(2026, 11, 26, 7, 0, tzinfo=UTC)
    assert last_due("0 12 * * *", now, "UTC") == now


def test_a_session_is_told_the_local_time_and_zone() -> None:
    now = datetime(2026, 7, 1, 12, 5, tzinfo=UTC)
    assert (
        local_now("Europe/Berlin", now) == "Wednesday 2026-07-01 14:05 (Europe/Berlin, UTC+02:00)"
    )


@pytest.mark.parametrize(
    "at", ["9999-12-31T23:59+00:00", "9999-12-31T23:59-12:00", "0001-01-01T00:00+14:00"]
)
def test_an_at_out_of_range_is_refused_not_a_crash(at: str) -> None:
    now = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    with pytest.raises(BadTime, match=r"years|past|range"):
        parse_at(at, "Europe/Berlin", now)


def test_a_time_the_clock_skips_or_shows_twice_is_said_so() -> None:
    """`at` 02:30 on the night the clocks skip it ran at 03:00, and nothing said so (a
    walkthrough); the answer now says what became of it, in the butler's zone."""
    from datetime import UTC, datetime

    from butlers.schedule_time import moved_by_clock, parse_at

    now = datetime(2026, 11, 27, tzinfo=UTC)

    def said(at: str) -> str | None:
        return moved_by_clock(at, parse_at(at, "Europe/Berlin", now), "Europe/Berlin")

    assert said("2027-03-28T02:30") == (
        "2027-03-28 02:30 does not exist in Europe/Berlin (the clocks skip it that night): "
        "it runs at 2027-03-28 03:00 CEST"
    )
    assert said("2027-10-31T02:30") == (
        "2027-10-31 02:30 happens twice in Europe/Berlin that night (the clocks go back): "
        "it runs at the first, 2027-10-31 02:30 CEST"
    )
    assert said("2027-01-01T09:00") is None
    assert said("2027-03-28T02:30+01:00") is None  # an offset given: as given


def test_the_shortest_gap_is_measured_on_the_butlers_wall_clock() -> None:
    """`min_schedule_interval_s` was checked on UTC runs: in Berlin, `30 2,3 * * *` is an
    hour apart in UTC, but on the spring's jump day 02:30 does not exist and runs at 03:00,
    half an hour before 03:30 (a walkthrough)."""
    from butlers.core_tools import shortest_gap_s

    before_the_jump = datetime(2027, 3, 20, tzinfo=UTC)  # Berlin springs on 2027-03-28
    assert shortest_gap_s("30 2,3 * * *", before_the_jump) == 3600
    assert shortest_gap_s("30 2,3 * * *", before_the_jump, zone="Europe/Berlin") == 1800
    # Two wall times the jump moves to one instant run once: not a gap of 0.
    assert shortest_gap_s("0,30 2 * * *", before_the_jump, zone="Europe/Berlin") == 1800
    # The autumn's repeated hour runs each wall time once (its first occurrence).
    autumn = datetime(2027, 10, 25, tzinfo=UTC)  # Berlin falls back on 2027-10-31
    assert shortest_gap_s("0 * * * *", autumn, zone="Europe/Berlin") == 3600


def test_last_due_in_the_hour_the_clock_goes_back_finds_its_first_pass() -> None:
    """At 02:40 of the second pass through 02:00-03:00 (Berlin, 25 October), 02:45 came 55
    minutes earlier, in the first pass: it was yesterday's (a walkthrough)."""
    second_pass = datetime(2026, 10, 25, 1, 40, tzinfo=UTC)  # 02:40 CET
    assert last_due("45 2 * * *", second_pass, "Europe/Berlin") == datetime(
        2026, 10, 25, 0, 45, tzinfo=UTC
    )
    # In the first pass, 02:45 is still ahead: yesterday's.
    first_pass = datetime(2026, 10, 25, 0, 40, tzinfo=UTC)  # 02:40 CEST
    assert last_due("45 2 * * *", first_pass, "Europe/Berlin") == datetime(
        2026, 10, 24, 0, 45, tzinfo=UTC
    )
    # New York, 1 November: 01:40 EST (the second pass); 01:30 EDT was 05:30Z.
    assert last_due("30 1 * * *", datetime(2026, 11, 1, 6, 40, tzinfo=UTC), "America/New_York") == (
        datetime(2026, 11, 1, 5, 30, tzinfo=UTC)
    )
