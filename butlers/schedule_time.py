"""When a schedule runs: cron read on the butler's wall clock, one-shot `at` times, and the
run missed while the butler was down.

Cron is evaluated in the butler's IANA zone, not in UTC, so "0 8 * * *" means 08:00 where
the owner lives, in summer and in winter. croniter walks naive wall-clock times; each is then
placed in the zone here, because the two days a year the clock jumps need a rule:
- spring forward: a time that does not exist that day (02:30 in Europe/Berlin) runs once, at
  the end of the gap (03:00);
- fall back: a time that exists twice (02:30) runs once, at its first occurrence.
Every time is returned timezone-aware, in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import CroniterError, croniter

# A wall-clock gap (spring forward) is an hour almost everywhere (30 minutes on Lord Howe
# Island); `next_run` starts this far back so that a run placed at a gap's end is not missed.
_LOOKBACK = timedelta(hours=3)


# A one-time reminder further ahead is refused: nobody means it, and a time near year 9999
# cannot be shown in a zone east of UTC.
MAX_AHEAD_YEARS = 10


CRON_NICKNAMES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
# A cron's five fields, with what each takes (croniter's refusal names no field).
_CRON_FIELDS = (
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day-of-month", "1-31"),
    ("month", "1-12 or jan-dec"),
    ("day-of-week", "0-7 or sun-sat"),
)


def cron_problem(cron: str) -> str | None:
    """What is wrong with `cron` in words, or None when it is five fields (minute resolution)
    or a nickname such as @daily. croniter also takes a sixth field, seconds, which would run
    a session every second: refused. A bad field is named with what it takes ('61 8 * * *':
    minute '61', 0-59), not just "five fields", which it has."""
    if cron.strip().lower() in CRON_NICKNAMES:
        return None
    fields = cron.split()
    if len(fields) != 5:
        return (
            f"expected five fields 'minute hour day-of-month month day-of-week' (got "
            f"{len(fields)}), e.g. '0 8 * * *' for 08:00 daily, or {', '.join(CRON_NICKNAMES[3:])}"
        )
    for index, (field, takes) in enumerate(_CRON_FIELDS):
        alone = ["*"] * 5
        alone[index] = fields[index]
        if not croniter.is_valid(" ".join(alone)):
            return (
                f"its {field} {fields[index]!r} is not valid: it takes {takes} (lists, ranges "
                "and */steps of them too)"
            )
    if not croniter.is_valid(cron):
        return "its fields do not make a schedule together, e.g. '0 8 * * *' for 08:00 daily"
    try:
        croniter(cron, datetime(2000, 1, 1)).get_next(datetime)
    except CroniterError:  # e.g. "0 0 31 2 *": valid fields, but no such day
        return "it never comes round (no such date)"
    return None


class BadTime(ValueError):
    """An `at` that is not an ISO 8601 date-time, or lies in the past."""


def _exists(naive: datetime, zone: ZoneInfo) -> bool:
    aware = naive.replace(tzinfo=zone)
    return aware.astimezone(UTC).astimezone(zone).replace(tzinfo=None) == naive


def place(naive: datetime, zone: ZoneInfo) -> datetime:
    """A wall-clock time in `zone`, as an instant in UTC: a time skipped by the clock is moved
    to the end of the gap, a time that happens twice is its first occurrence."""
    if _exists(naive, zone):
        return naive.replace(tzinfo=zone, fold=0).astimezone(UTC)
    # In a gap: the first minute after it. fold=1 reads the wall time with the offset after
    # the jump, which lands before the jump: the jump itself lies between the two readings.
    low = naive.replace(tzinfo=zone, fold=1).astimezone(UTC)
    high = naive.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if low > high:
        low, high = high, low
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) / 2
        if middle.astimezone(zone).replace(tzinfo=None) < naive:
            low = middle
        else:
            high = middle
    # Within a second after the jump (clocks jump on whole minutes).
    return high.replace(microsecond=0)


def next_run(cron: str, after: datetime, zone: str = "UTC") -> datetime:
    """The first run of `cron` (on the wall clock of `zone`) strictly after `after`."""
    tz = ZoneInfo(zone)
    wall = after.astimezone(tz).replace(tzinfo=None)
    # From a little earlier: a run in a gap is placed at the gap's end, which may come after
    # `after` while its wall time is before it.
    runs = croniter(cron, wall - _LOOKBACK)
    while True:
        moment = place(runs.get_next(datetime), tz)
        if moment > after:
            return moment


def last_due(cron: str, now: datetime, zone: str = "UTC") -> datetime | None:
    """The latest run of `cron` at or before `now` (None when there is none within a year)."""
    tz = ZoneInfo(zone)
    local = now.astimezone(tz)
    wall = local.replace(tzinfo=None) + timedelta(minutes=1)
    first_pass, second_pass = local.replace(fold=0).utcoffset(), local.utcoffset()
    if local.fold and first_pass is not None and second_pass is not None:
        # The hour the clock goes back: its first pass, wall times up to an hour ahead of
        # now's, is over (02:45 was missed at 02:40 of the second pass).
        wall += first_pass - second_pass
    runs = croniter(cron, wall)
    for _ in range(2000):
        candidate = runs.get_prev(datetime)
        moment = place(candidate, tz)
        if moment <= now:
            return moment
        if now - moment > timedelta(days=366):
            break
    return None


def parse_at(at: str, zone: str, now: datetime) -> datetime:
    """An ISO 8601 date-time for a one-shot schedule, in UTC. Without an offset it is the
    butler's local time (`zone`). Refused when it lies in the past (a minute's grace for the
    time the request took)."""
    try:
        moment = datetime.fromisoformat(at.strip())
        if moment.tzinfo is None:
            moment = place(moment, ZoneInfo(zone))
        else:
            moment = moment.astimezone(UTC)
    except ValueError as exc:
        # The form is right but a field is not ("day is out of range for month", "hour must
        # be in 0..23"): said so, rather than "not an ISO 8601 date-time".
        said = str(exc)
        no_such = "" if said.startswith("Invalid isoformat") else f": no such date or time ({said})"
        raise BadTime(
            f"at {at!r} is not an ISO 8601 date-time such as '2026-12-24T09:00' (local time) "
            f"or '2026-12-24T09:00+01:00'{no_such}"
        ) from None
    except OverflowError:  # year 1 with a positive offset, 9999 with a negative one
        raise BadTime(
            f"at {at!r} is out of range: give a time within {MAX_AHEAD_YEARS} years"
        ) from None
    if moment < now - timedelta(minutes=1):
        local = now.astimezone(ZoneInfo(zone)).isoformat(timespec="minutes")
        raise BadTime(f"at {at!r} is in the past (it is now {local} in {zone}): give a future time")
    if moment > now + timedelta(days=366 * MAX_AHEAD_YEARS):
        raise BadTime(f"at {at!r} is more than {MAX_AHEAD_YEARS} years away")
    return moment


def moved_by_clock(at: str, placed: datetime, zone: str) -> str | None:
    """What to tell whoever asked for `at` (a local time, no offset) when the clock made it
    another (`placed`, from `parse_at`): a time the clocks skip that night, or one they show
    twice. None otherwise (an offset given, or an ordinary time)."""
    given = datetime.fromisoformat(at.strip())
    if given.tzinfo is not None:
        return None
    tz = ZoneInfo(zone)
    shown = placed.astimezone(tz)
    wall = f"{shown:%Y-%m-%d %H:%M %Z}"
    if shown.replace(tzinfo=None, second=0, microsecond=0) != given.replace(
        second=0, microsecond=0
    ):
        return (
            f"{given:%Y-%m-%d %H:%M} does not exist in {zone} (the clocks skip it that night): "
            f"it runs at {wall}"
        )
    if given.replace(tzinfo=tz, fold=0).utcoffset() != given.replace(tzinfo=tz, fold=1).utcoffset():
        return (
            f"{given:%Y-%m-%d %H:%M} happens twice in {zone} that night (the clocks go back): "
            f"it runs at the first, {wall}"
        )
    return None


def wall_clock(value: str, zone: str | None) -> str | None:
    """A stored time (ISO 8601, with its offset) as read on `zone`'s wall clock (this
    machine's when None), with the zone's abbreviation: "2026-11-27 08:00 JST". None when it
    cannot be read or shown (written by hand, an older version, a year out of range)."""
    try:
        moment = datetime.fromisoformat(value).astimezone(ZoneInfo(zone) if zone else None)
        return moment.strftime("%Y-%m-%d %H:%M %Z")
    except (ValueError, OverflowError, KeyError):  # ZoneInfoNotFoundError is a KeyError
        return None


def local_now(zone: str, now: datetime | None = None) -> str:
    """What a session is told: 'Thursday 2026-11-26 14:05 (Europe/Berlin, UTC+01:00)'."""
    moment = (now or datetime.now(UTC)).astimezone(ZoneInfo(zone))
    offset = moment.strftime("%z")
    return f"{moment:%A %Y-%m-%d %H:%M} ({zone}, UTC{offset[:3]}:{offset[3:]})"
