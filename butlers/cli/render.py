"""The tables the commands print: one function per answer, the answer as the tool gave it.

Plain text for a person; `--json` prints the tool's answer instead and never comes here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from butlers.errors import CommandError

if TYPE_CHECKING:
    pass


def format_rows(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def print_rows(rows: Sequence[Sequence[str]], indent: str = "") -> None:
    for line in format_rows(rows, indent):
        print(line)


def print_rows_with_details(
    header: Sequence[str], rows: Sequence[tuple[Sequence[str], Sequence[str]]]
) -> None:
    """A table whose rows may each carry detail lines (an error), printed indented under it:
    too long for a column, and what the operator is looking for."""
    lines = format_rows([header, *(cells for cells, _ in rows)])
    print(lines[0])
    for line, (_, details) in zip(lines[1:], rows, strict=True):
        print(line)
        for detail in details:
            print(f"    {detail}")


def print_butlers(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("No butlers registered. Run `butlers discover` after adding config/butlers/<name>/.")
        return
    table = [("NAME", "ENDPOINT", "MODULES", "LAST SEEN", "DESCRIPTION")]
    for row in rows:
        description = row.get("description") or ""
        table.append(
            (
                row["name"],
                row["endpoint_url"],
                ",".join(row.get("modules") or []) or "-",
                ("stale, " if row.get("stale") else "")
                + (when(row["last_seen_at"]) if row.get("last_seen_at") else "never"),
                description if len(description) <= 60 else description[:59] + "…",
            )
        )
    print_rows(table)


def print_discover(report: dict[str, Any]) -> None:
    print(f"added:     {', '.join(report['added']) or '-'}")
    updated = [f"{u['name']} ({', '.join(u['changed'])})" for u in report["updated"]]
    print(f"updated:   {', '.join(updated) or '-'}")
    print(f"unchanged: {', '.join(report['unchanged']) or '-'}")
    print(f"stale:     {', '.join(report['stale']) or '-'}")
    if report.get("back"):
        print(f"back:      {', '.join(report['back'])} (stale before, found again)")
    for kept in report.get("kept", []):
        print(
            f"kept:      {kept['name']} at {kept['endpoint_url']}, where it answers "
            f"(not {kept['instead_of']})"
        )
    for error in report["errors"]:
        print(f"error:     {error['path']}: {error['key']}: {error['problem']}")
    if report["added"] or report.get("back"):  # registered is not running: up or run is
        which = "an added butler" if report["added"] else "a butler found again"
        print(
            f"note: {which} runs once started (restart `butlers up`, or "
            "`butlers run NAME`); until then route says it cannot reach it",
            file=sys.stderr,
        )
        for name, url in (report.get("added_endpoints") or {}).items():
            try:
                port = urlsplit(url).port
            except ValueError:  # not a port: nothing to suggest
                continue
            # Registered where this switchboard's --port-offset puts it; `run` would use the
            # butler.toml's port unless told.
            if port is not None:
                print(
                    f"note: {name} is registered at {url}: "
                    f"`butlers run {name} --port {port}` serves it there",
                    file=sys.stderr,
                )


def answer_failure(answer: dict[str, Any]) -> str | None:
    """Why `ask`'s message was not answered (exit 1, with or without --json), or None."""
    if answer.get("status") != "done":
        return f"message {answer.get('inbox_id')} failed: {answer.get('error')}"
    return None


def print_answer(answer: dict[str, Any]) -> None:
    if (failure := answer_failure(answer)) is not None:
        raise CommandError(failure)
    print(answer.get("reply") or "")
    if answer.get("routed_to"):
        print(f"(answered by {answer['routed_to']})", file=sys.stderr)


def print_result(result: Any) -> None:
    print(result if isinstance(result, str) else json.dumps(result, indent=2, ensure_ascii=False))


def print_forgotten(result: dict[str, Any]) -> None:
    print(f"memory {result['id']} forgotten")


def print_schedule_deleted(result: dict[str, Any]) -> None:
    name = cut(str(result["name"]), 100)
    print(f"schedule {name!r} of {result['butler']} deleted")


def print_trace(found: dict[str, Any]) -> None:
    print(found["url"])
    route = found["route"]
    if route:
        outcome = "ok" if route["success"] else f"failed: {route['error']}"
        print(
            f"({route['source_channel']} -> {route['routed_to']}.{route['tool_name']}, "
            f"{when(route['created_at'])}, {outcome})",  # (as `butlers log` shows it)
            file=sys.stderr,
        )


TABLE_TEXT_CHARS = 48  # an excerpt's share of a table line; --json has the tool's whole excerpt


def when(value: str | None) -> str:
    """A timestamp of the switchboard's (ISO 8601, UTC) in this machine's local time, with
    its zone: beside a time the bot gave in the owner's zone, an unlabelled one misled."""
    if not value:
        return "-"
    return datetime.fromisoformat(value).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def cut(text: str | None, limit: int = TABLE_TEXT_CHARS) -> str:
    """A cell of a table: other people's text (a memory, a prompt, a sender's name), so no
    control characters (a terminal escape would rewrite the operator's screen), one line,
    cut."""
    from butlers.text import printable

    return printable(text, limit)


def none_found(what: str, status: str | None) -> str:
    return f"No {status} {what}." if status else f"No {what}."


def print_inbox(rows: list[dict[str, Any]], status: str | None, limit: int | None = None) -> None:
    """The messages, newest first; a full page ends with how to ask for the one before it
    (on stderr: the table stays the table)."""
    if not rows:
        print(none_found("inbox messages", status))
        return
    table = []
    for row in rows:
        sender = cut(row.get("source_id") or "-", 32)
        if row.get("sender_name"):  # the name cut on its own: the id is never pushed out
            sender = f"{cut(row['sender_name'], max(8, 32 - len(sender) - 3))} ({sender})"
        text = row.get("excerpt") or ""
        if row.get("subject"):
            text = f"[{row['subject']}] {text}"
        if row.get("files"):  # a photo without words said nothing here
            text = f"{text} [files: {', '.join(row['files'])}]".strip()
        cells = (
            str(row["id"]),
            when(row.get("received_at")),
            row["channel"],
            sender,
            row["status"],
            # An album's photo joined to the message that answered them all.
            f"with #{row['album_of']}" if row.get("album_of") else row.get("routed_to") or "-",
            row.get("classified_via") or "-",
            cut(text),
        )
        # (A done message's error says what went wrong on its way: the classifier's fallback,
        # another butler that failed where one answered. Still an error: one may be there.)
        details = [f"error: {row['error']}"] if row.get("error") else []
        if row.get("error") and row.get("trace_url"):
            details.append(f"trace: {row['trace_url']}")
        if row.get("reply_status") == "failed":  # answered, but the answer never went out
            details.append(
                f"reply not delivered: {row.get('reply_error')} (`butlers outbox retry "
                f"{row.get('reply_id')}` sends it again once that is fixed)"
            )
        elif row.get("reply_status") == "pending" and row.get("reply_error"):
            # "done" while the channel keeps refusing its reply (a walkthrough read it as sent)
            details.append(
                f"reply not sent yet: {row['reply_error']} (the outbox keeps trying: `butlers "
                "outbox`)"
            )
        details += [
            f"approval #{a['id']}: {a['tool']} ({a['status']})" for a in row.get("approvals") or []
        ]
        details += [  # what it came to before `butlers retry` queued it again
            f"before retry {n}: {earlier.get('status')}"
            + (f": {earlier['error']}" if earlier.get("error") else "")
            for n, earlier in enumerate(row.get("retries") or [], start=1)
        ]
        table.append((cells, details))
    header = ("ID", "RECEIVED", "CHANNEL", "FROM", "STATUS", "ROUTED TO", "VIA", "TEXT")
    print_rows_with_details(header, table)
    print_next_page(rows, limit)


def print_next_page(rows: list[dict[str, Any]], limit: int | None) -> None:
    """After a full page of a listing, newest first: how to ask for the one before it (on
    stderr: the table stays the table)."""
    if limit is not None and rows and len(rows) >= limit:
        sys.stdout.flush()
        print(f"({len(rows)} shown; older ones: --before {rows[-1]['id']})", file=sys.stderr)


def print_routing_log(
    rows: list[dict[str, Any]], butler: str | None, limit: int | None = None
) -> None:
    if not rows:
        print(f"No routes to {butler!r} logged." if butler else "No routes logged.")
        return
    table = []
    for row in rows:
        duration = row.get("duration_ms")
        cells = (
            when(row.get("created_at")),
            row["source_channel"],
            cut(row.get("source_id") or "-", 32),
            f"{row['routed_to']}.{row.get('tool_name') or '?'}",
            "ok" if row.get("success") else "FAILED",
            "-" if duration is None else str(duration),
            str(row.get("inbox_id") or "-"),
            cut(row.get("prompt_summary")) or "-",
            row.get("trace_url") or "-",
        )
        table.append((cells, [f"error: {row['error']}"] if row.get("error") else []))
    header = ("WHEN", "CHANNEL", "FROM", "TO", "RESULT", "MS", "INBOX", "SUMMARY", "TRACE")
    print_rows_with_details(header, table)
    print_next_page(rows, limit)


def print_retry(answer: dict[str, Any]) -> None:
    earlier = (answer.get("retries") or [{}])[-1]
    why = f": {earlier['error']}" if earlier.get("error") else ""
    print(f"message {answer['id']} is queued again (it was {earlier.get('status', '?')}{why})")


def print_reply_retry(answer: dict[str, Any]) -> None:
    earlier = (answer.get("retries") or [{}])[-1]
    why = f": {earlier['error']}" if earlier.get("error") else ""
    print(
        f"outbox row {answer['id']} ({answer['kind']} to {cut(answer['recipient'], 60)} on "
        f"{answer['channel']}) is sent again (it failed{why})"
    )


def print_outbox(rows: list[dict[str, Any]], status: str | None, limit: int | None = None) -> None:
    if not rows:
        print(none_found("outbox rows", status) if status else "Nothing waiting in the outbox.")
        return
    table = []
    for row in rows:
        cells = (
            str(row["id"]),
            when(row.get("created_at")),
            row["kind"],
            row["channel"],
            cut(row["recipient"], 32),
            row["status"],
            str(row["attempts"]),
            when(row.get("sent_at")) if row["status"] == "sent" else _next_attempt(row),
            str(row.get("inbox_id") or "-"),
            row.get("butler") or "-",
            cut(row.get("excerpt")),
        )
        table.append((cells, [f"error: {row['error']}"] if row.get("error") else []))
    header = (
        "ID",
        "CREATED",
        "KIND",
        "CHANNEL",
        "TO",
        "STATUS",
        "ATTEMPTS",
        "SENT / NEXT TRY",
        "INBOX",
        "BUTLER",
        "TEXT",
    )
    print_rows_with_details(header, table)
    print_next_page(rows, limit)


def print_approvals(
    rows: list[dict[str, Any]], status: str | None, limit: int | None = None
) -> None:
    if not rows:
        print(none_found("approvals", status))
        return
    from butlers.text import escaped_disguises

    table = []
    for row in rows:
        # As the owner's question shows them: what could disguise them escaped, every space
        # kept (`cut` squeezed runs of spaces and dropped zero-width characters, so the call
        # shown was not the call that would run: a red team). JSON escapes the controls.
        arguments = escaped_disguises(
            json.dumps(row.get("arguments"), ensure_ascii=False, sort_keys=True)
        )
        if len(arguments) > TABLE_TEXT_CHARS:
            arguments = arguments[: TABLE_TEXT_CHARS - 1] + "…"
        cells = (
            str(row["id"]),
            when(row.get("requested_at")),
            row["butler"],
            row["tool"],
            row["status"],
            when(row.get("decided_at")),
            row.get("decided_by") or "-",
            arguments,
        )
        details = []
        if row["status"] == "pending":  # until when the owner may decide (then: expired)
            details.append(f"expires: {when(row.get('expires_at'))}")
        if row.get("conversation"):  # whom the asking session answered (people's own words)
            details.append(f"answering: {cut(row['conversation'], 80)}")
        if row.get("forwarded_from"):
            details.append(f"forwarded: the words of {cut(row['forwarded_from'], 80)}")
        if row.get("result"):
            details.append(f"result: {cut(row['result'], 200)}")
        table.append((cells, details))
    header = ("ID", "REQUESTED", "BUTLER", "TOOL", "STATUS", "DECIDED", "BY", "ARGUMENTS")
    print_rows_with_details(header, table)
    print_next_page(rows, limit)


def decision_failure(answer: dict[str, Any]) -> str | None:
    """Why `approvals approve|deny` did not do what it was asked (exit 1, with or without
    --json): nothing changed, or the approved call failed; None when it did."""
    if not answer.get("changed"):
        return f"approval {answer['id']} is {answer['status']} already: nothing changed"
    if answer["status"] == "failed":
        result = f": {cut(answer['result'], 200)}" if answer.get("result") else ""
        return f"approval {answer['id']} approved, and the call failed{result}"
    return None


def print_decision(answer: dict[str, Any]) -> None:
    """What `approvals approve|deny` did: the decision, and for an approval, how it ran."""
    if (failure := decision_failure(answer)) is not None:
        raise CommandError(failure)
    result = f": {cut(answer['result'], 200)}" if answer.get("result") else ""
    said = {"done": "approved and run", "denied": "denied"}.get(answer["status"])
    print(f"approval {answer['id']} {said or 'is ' + answer['status']}{result}")


def print_pairing(listing: dict[str, Any]) -> None:
    """Pending codes, then paired senders; names are the senders' own: cut (and cleaned
    when they were stored)."""
    if not listing.get("enabled"):
        print("Pairing is off ([switchboard.pairing] enabled = false): strangers get no code.")
    pending = listing.get("pending") or []
    if pending:
        rows: list[tuple[str, ...]] = [("CODE", "CHANNEL", "SENDER", "NAME", "ASKED", "EXPIRES")]
        rows += [
            (
                p["code"],
                p["channel"],
                cut(p["sender"], 40),
                cut(p.get("name"), 40) or "-",
                when(p.get("created_at")),
                when(p.get("expires_at")),
            )
            for p in pending
        ]
        print_rows(rows)
    else:
        print("No pending pairing codes.")
    paired = listing.get("paired") or []
    if paired:
        print()
        rows = [("PAIRED", "SENDER", "NAME", "APPROVED", "BY")]
        rows += [
            (
                p["channel"],
                cut(p["sender"], 40),
                cut(p.get("name"), 40) or "-",
                when(p.get("approved_at")),
                p.get("approved_by") or "-",
            )
            for p in paired
        ]
        print_rows(rows)


def print_paired(answer: dict[str, Any]) -> None:
    """What `pairing approve|deny|revoke` did."""
    who = f"{answer['channel']} {cut(answer['sender'], 40)}"
    if answer.get("name"):
        who += f" ({cut(answer['name'], 40)})"
    if answer.get("revoked"):
        print(f"{who} is no longer paired: a stranger again")
    elif answer["status"] == "approved":
        print(f"code {answer['code']} approved: {who} is paired; their next message is answered")
    else:
        print(f"code {answer['code']} denied: {who} is not let in")


def _next_attempt(row: dict[str, Any]) -> str:
    """When a row not sent yet is tried again (nothing for one that failed for good)."""
    return "-" if row["status"] == "failed" else when(row.get("next_attempt_at"))


def in_zone(value: str | None, zone: str | None) -> str:
    """A UTC timestamp shown on the butler's own wall clock (its time zone)."""
    if not value:
        return "-"
    from butlers.schedule_time import wall_clock

    return wall_clock(value, zone) or cut(value)


def print_schedules(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("No schedules.")
        return
    table: list[tuple[tuple[str, ...], list[str]]] = []
    for row in rows:
        if "error" in row:
            table.append(((row["butler"], "-", "-", "-", "-", "-", "-", "-"), [row["error"]]))
            continue
        zone = row.get("timezone")
        cells = (
            row["butler"],
            row["name"],
            row.get("cron") or "once",
            in_zone(row.get("next_run_at"), zone) if row.get("enabled", True) else "disabled",
            in_zone(row.get("last_run_at"), zone),
            row.get("origin", "tool"),
            cut(row.get("for"), 40) if row.get("for") else "you",  # whose message planted it
            cut(row.get("prompt")),
        )
        table.append((cells, []))
    header = ("BUTLER", "NAME", "WHEN", "NEXT (LOCAL)", "LAST (LOCAL)", "FROM", "FOR", "PROMPT")
    print_rows_with_details(header, table)


def whose_memory(row: dict[str, Any]) -> str:
    """Whose a memory is, as the list says it (a search does not: "-"): `you`, or the person
    whose message kept it (words you forwarded: your chat's id, not `you`), and `shared`."""
    if "person" not in row:
        return "-"
    who = "you" if row.get("from_owner", not row["person"]) else cut(row["person"], 32)
    return who if row.get("private", True) else f"{who}, shared"


def print_memories(rows: list[dict[str, Any]], limit: int | None = None) -> None:
    if not rows:
        print("No memories.")
        return
    table: list[tuple[tuple[str, ...], list[str]]] = []
    for row in rows:
        cells = (
            str(row["id"]),
            when(row.get("created_at")),
            whose_memory(row),
            cut(",".join(row.get("tags") or []), 64) or "-",
            f"{row['score']:.3f}" if "score" in row else "-",
            cut(row["text"]),
        )
        table.append((cells, []))
    print_rows_with_details(("ID", "REMEMBERED", "FOR", "TAGS", "SCORE", "TEXT"), table)
    print_next_page(rows, limit)
