"""Every SQL statement on the core tables (state, scheduled_tasks, sessions, limit_notices: in
every butler's database), by name, for butlers.core_store; and the two types that
butlers.switchboard.queries, the switchboard's statements, is written with too.

One module of named statements per store's database, like procrastinate's `sql/queries.sql`:
one place to read (and review) what touches a table.

- A statement is an upper-case `str`, its parameters `$1`, `$2`, ... in the order its store
  passes them, with a comment saying what it does (and why, where that is not obvious).
- A `Fragment` is a piece of statements (a column list, a condition): composed into them
  here, once, at import; never run alone, never joined per call.
- A `Filtered` statement has a WHERE that holds only the filters given (the dashboard's
  pages): its text is assembled per call from its named fragments.

A Python module rather than a `.sql` file: statements share column lists and conditions (an
f-string composes them once, at import, where a file would need templating of its own beside
SQL's own braces), a module costs no file read, parse or `importlib.resources` (about 3 ms)
at import, and mypy and ruff see every name a store uses. tests/test_queries.py PREPAREs
every statement against a migrated database, so a typo in one that no other test runs still
fails.
"""

from __future__ import annotations

from typing import Any


class Fragment(str):
    """A piece of statements (a column list, a condition, a key): composed into them, never
    run alone (the PREPARE test tells statements from pieces by this type)."""

    __slots__ = ()


class Filtered:
    """A statement whose WHERE holds only the filters given, each one a fixed fragment: one
    text per combination, so that each is planned for the index that serves it
    (`$1 IS NULL OR status = $1` would be planned once for any value, and read the whole
    table newest first to find a rare status).

    `head` + WHERE + `tail`; the fixed parameters ($1 .. $`fixed`) come first, the filters'
    after them, numbered in the order given. A plain class, not a dataclass: every butler
    imports this module (through butlers.core_store), and making a frozen dataclass costs
    about a millisecond at import."""

    __slots__ = ("filters", "fixed", "head", "tail")

    def __init__(self, *, head: str, filters: tuple[str, ...], tail: str, fixed: int) -> None:
        self.head = head
        self.filters = filters  # one condition each, `{}` where its parameter goes
        self.tail = tail
        self.fixed = fixed  # how many parameters head and tail take

    def build(self, *values: Any) -> tuple[str, list[Any]]:
        """The statement for these filter values (one per filter, None: not filtered on),
        and the values to pass after the fixed parameters."""
        given = [
            (condition, value)
            for condition, value in zip(self.filters, values, strict=True)
            if value is not None
        ]
        conditions = [
            condition.format(f"${n}")
            for n, (condition, _) in enumerate(given, start=self.fixed + 1)
        ]
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        return f"{self.head}\n{where}\n{self.tail}", [value for _, value in given]


# -- health ---------------------------------------------------------------------------------

# Also which server and database answered (core_store.database_identity): the same for
# every process on one server, different on another one.
PING = "SELECT extract(epoch FROM pg_postmaster_start_time())::text, current_database()"

# -- state ----------------------------------------------------------------------------------

STATE_GET = "SELECT key, value, updated_at FROM state WHERE key = $1"
STATE_SET = """
    INSERT INTO state (key, value, updated_at) VALUES ($1, $2, now())
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()
    RETURNING updated_at
"""
STATE_DELETE = "DELETE FROM state WHERE key = $1"
# The keys starting with $1: starts_with() needs no escaping of LIKE's % and _.
# Every key starting with $1, in order; at most $2 (NULL: all). STATE_KEYS leaves the values
# out: a page that shows the keys fetched 2000 values (8 MB at worst) every 10 s.
STATE_LIST = """
    SELECT key, value, updated_at FROM state WHERE starts_with(key, $1) ORDER BY key LIMIT $2
"""
STATE_KEYS = "SELECT key, updated_at FROM state WHERE starts_with(key, $1) ORDER BY key LIMIT $2"

# -- scheduled_tasks ------------------------------------------------------------------------

# What the schedule statements return of a task.
_SCHEDULE_COLUMNS = Fragment(
    "id, name, cron, prompt, enabled, next_run_at, last_run_at, created_at, routed, once, declared"
)

# Held while counting and inserting (or declaring): two creations cannot both pass the cap.
SCHEDULE_LOCK = "LOCK TABLE scheduled_tasks IN SHARE ROW EXCLUSIVE MODE"
# Disabled ones are not counted: a person's, disabled once they might no longer write, kept
# using up the people's caps until someone deleted them by hand (a walkthrough).
SCHEDULE_COUNT = "SELECT count(*) FROM scheduled_tasks WHERE enabled"
# The tasks people's messages planted (not the owner's, persons $2, unless forwarded: another's
# words): those of person $1 (`telegram:<chat>`, any topic; `email:<address>`, any thread: a
# mail's thread root is its sender's to choose; '' for no conversation), and all of them.
# A conversation's person in SQL, lower-cased, as butlers.memory.person_of reads it in
# Python: `telegram:<chat>` (any topic), `email:<address>` (any thread); '' for none.
PERSON_OF_CONVERSATION = Fragment(
    "coalesce(lower(split_part(conversation, ':', 1) || ':' "
    "|| split_part(conversation, ':', 2)), '')"
)
SCHEDULE_COUNT_ROUTED = f"""
    SELECT count(*) FILTER (WHERE person = $1) AS theirs, count(*) AS everyones
    FROM (
        SELECT {PERSON_OF_CONVERSATION} AS person,
               forwarded_from
        FROM scheduled_tasks WHERE routed AND enabled
    ) AS planted
    WHERE forwarded_from IS NOT NULL OR NOT person = ANY($2::text[])
"""
# A new task, unless the name is taken; no cron ($2): it runs once, at $4.
SCHEDULE_CREATE = f"""
    INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at, routed, once, conversation,
                                 forwarded_from, due_at)
    VALUES ($1, $2, $3, $4, $5, $2::text IS NULL, $6, $7,
            CASE WHEN $2::text IS NULL THEN $4::timestamptz END)
    ON CONFLICT (name) DO NOTHING
    RETURNING {_SCHEDULE_COLUMNS}
"""
SCHEDULE_LIST = (
    f"SELECT {_SCHEDULE_COLUMNS}, conversation, forwarded_from FROM scheduled_tasks "
    "ORDER BY next_run_at NULLS LAST, name"
)
# $2: only one a routed message's session planted (not declared).
SCHEDULE_DELETE = (
    "DELETE FROM scheduled_tasks WHERE name = $1 AND (NOT $2 OR (routed AND NOT declared))"
)
# A one-time reminder due again at $2; its attempt not counted unless $3.
SCHEDULE_ONCE_AGAIN = """
    UPDATE scheduled_tasks SET next_run_at = $2,
           attempts = attempts - CASE WHEN $3 THEN 0 ELSE 1 END
    WHERE id = $1 AND once
"""
SCHEDULE_RAN_ONCE = "DELETE FROM scheduled_tasks WHERE id = $1 AND once"
# The declared schedules and those named like one ($1): what `[[schedules]]` replaces.
SCHEDULE_DECLARED = """
    SELECT name, cron, prompt, declared, routed, conversation FROM scheduled_tasks
    WHERE declared OR name = ANY($1::text[])
"""
SCHEDULE_DECLARE_NEW = """
    INSERT INTO scheduled_tasks (name, cron, prompt, next_run_at, declared)
    VALUES ($1, $2, $3, $4, true)
"""
# A declared schedule changed: a changed cron starts over from $4, an unchanged one keeps its
# next run (a run missed while down is still seen). One a tool made under its name becomes
# the owner's whole: no one's conversation (a person's would get its runs' answers), no
# attempts counted.
SCHEDULE_DECLARE_CHANGED = """
    UPDATE scheduled_tasks SET prompt = $3, declared = true,
           once = false, routed = false, enabled = true, conversation = NULL, attempts = 0,
           forwarded_from = NULL,
           next_run_at = CASE WHEN cron IS DISTINCT FROM $2 THEN $4 ELSE next_run_at END,
           cron = $2
    WHERE name = $1
"""
SCHEDULE_DECLARE_GONE = "DELETE FROM scheduled_tasks WHERE declared AND name = ANY($1::text[])"
# The tasks due at $1, locked for this tick (two ticks never run a task twice); `due_at`:
# when it was due (a one-time reminder: when it was asked for, however often it was retried).
SCHEDULE_DUE = """
    SELECT id, name, cron, prompt, routed, once, conversation, attempts, forwarded_from,
           next_run_at,
           CASE WHEN once THEN coalesce(due_at, next_run_at) ELSE next_run_at END AS due_at
    FROM scheduled_tasks
    WHERE enabled AND next_run_at <= $1
    ORDER BY next_run_at, name FOR UPDATE SKIP LOCKED
"""
# A one-shot task claimed at $2, due again at $3 should this process die in its run.
SCHEDULE_CLAIM_ONCE = """
    UPDATE scheduled_tasks SET last_run_at = $2, next_run_at = $3, attempts = attempts + 1
    WHERE id = $1
"""
# A cron that cannot be read: disabled rather than failing every tick.
SCHEDULE_DISABLE = "UPDATE scheduled_tasks SET enabled = false WHERE id = $1"
# A missed run not caught up: on to the next one; or a run moved to another zone's clock.
SCHEDULE_SET_NEXT = "UPDATE scheduled_tasks SET next_run_at = $2 WHERE id = $1"
# The zone the recurring schedules' next runs were reckoned in (None before the first start).
SCHEDULE_CLOCK = "SELECT zone FROM schedule_clock"
SCHEDULE_CLOCK_SET = """
    INSERT INTO schedule_clock (id, zone) VALUES (1, $1)
    ON CONFLICT (id) DO UPDATE SET zone = EXCLUDED.zone
"""
# The recurring schedules whose next run is still ahead of $1 (one due already is the
# tick's to run or skip, as a run missed while down).
SCHEDULE_AHEAD = """
    SELECT id, name, cron, next_run_at FROM scheduled_tasks
    WHERE NOT once AND next_run_at > $1 ORDER BY name
"""
SCHEDULE_RAN = "UPDATE scheduled_tasks SET last_run_at = $2, next_run_at = $3 WHERE id = $1"
# A one-shot task's claim renewed as its run starts ($2: the claim as this process left it; a
# claim that ran out meanwhile and was taken by another process is not).
SCHEDULE_RENEW_ONCE = """
    UPDATE scheduled_tasks SET next_run_at = $3 WHERE id = $1 AND once AND next_run_at = $2
"""
# A claimed run that did not happen (the butler stopped first): due again at $3, a one-shot's
# attempt not counted; unless the row moved on meanwhile ($2: as the claim left it).
SCHEDULE_GIVE_BACK = """
    UPDATE scheduled_tasks SET next_run_at = $3,
           attempts = attempts - CASE WHEN once THEN 1 ELSE 0 END
    WHERE id = $1 AND next_run_at = $2
"""

# -- sessions -------------------------------------------------------------------------------

SESSION_START = """
    INSERT INTO sessions (trigger_source, prompt, trace_id, person)
    VALUES ($1, $2, $3, $4) RETURNING id
"""
SESSION_FINISH = """
    UPDATE sessions SET result = $2, success = $3, error = $4, tool_calls = $5,
           duration_ms = $6, cost_usd = $7, finished_at = now()
    WHERE id = $1
"""
# At start: sessions left unfinished that started over $1 seconds ago (longer than any session
# may run: none of them runs any more, in this process or a replica's), marked interrupted.
SESSIONS_ABANDONED = """
    UPDATE sessions SET success = false, error = $2, finished_at = now()
    WHERE finished_at IS NULL AND started_at < now() - make_interval(secs => $1)
"""
# Retention: finished sessions that started over $1 days ago.
SESSIONS_PRUNE = """
    DELETE FROM sessions WHERE started_at < now() - make_interval(days => $1)
    AND finished_at IS NOT NULL
"""
_SESSION_COLUMNS = Fragment(
    "id, trigger_source, prompt, success, error, duration_ms, cost_usd, trace_id, started_at, "
    "finished_at"
)
# The newest $1 sessions (of trace $2; NULL: any).
SESSIONS_LIST = f"""
    SELECT {_SESSION_COLUMNS}
    FROM sessions WHERE $2::text IS NULL OR trace_id = $2
    ORDER BY started_at DESC LIMIT $1
"""
# The same, with each one's result and tool calls.
SESSIONS_LIST_DETAIL = f"""
    SELECT {_SESSION_COLUMNS}, result, tool_calls
    FROM sessions WHERE $2::text IS NULL OR trace_id = $2
    ORDER BY started_at DESC LIMIT $1
"""
# The sessions of the last $1 hours: how many, how many failed, median duration, cost.
SESSIONS_SUMMARY = """
    SELECT count(*) AS count,
           count(*) FILTER (WHERE success IS FALSE) AS failed,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS median_ms,
           sum(cost_usd) AS cost_usd
    FROM sessions WHERE started_at > now() - make_interval(hours => $1)
"""
# Scheduled sessions (`schedule:<name>`) started in the last $1 seconds: all, and those of
# schedules people's messages planted.
SCHEDULED_RUNS_SINCE = """
    SELECT count(*) AS everyones, count(person) AS peoples FROM sessions
    WHERE started_at > now() - make_interval(secs => $1)
    AND starts_with(trigger_source, 'schedule:')
"""
# What the sessions of the last $1 seconds cost, by Claude Code's figures.
SPEND_SINCE = """
    SELECT coalesce(sum(cost_usd), 0)::float8 FROM sessions
    WHERE started_at > now() - make_interval(secs => $1)
"""
SESSION_GET = "SELECT * FROM sessions WHERE id = $1"

# -- limit_notices --------------------------------------------------------------------------

# Notices of past days no longer matter.
NOTICES_FORGET = "DELETE FROM limit_notices WHERE window_start < now() - interval '2 days'"
# The first claim of kind $1 in the current (UTC) hour or day ($2) returns true.
NOTICE_CLAIM = """
    INSERT INTO limit_notices (kind, window_start)
    VALUES ($1, date_trunc($2, now(), 'UTC'))
    ON CONFLICT DO NOTHING RETURNING true
"""
