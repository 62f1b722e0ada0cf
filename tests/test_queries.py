"""The named queries (butlers.queries: the core tables; butlers.switchboard.queries: the
switchboard's): every statement PREPAREs against a migrated database, every one is some
store's, and the dashboard reads the registry with the switchboard's own statements.

PREPARE parses and plans a statement without running it: a typo in a column, a table or a
parameter's type fails here even for a statement no other test runs (a retention prune, a
sweep's rare branch). A `Filtered` statement is prepared with none and with all of its
filters, and must take as many parameters as its store passes.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from butlers import queries as core_queries
from butlers.dashboard.store import DashboardStore
from butlers.db import create_pool
from butlers.queries import Filtered, Fragment
from butlers.switchboard import queries as switchboard_queries
from butlers.switchboard.routing_store import RegistryEntry, RoutingStore

BUTLERS = Path(core_queries.__file__).parent
# Each module, with the database its statements run on: the core branch's tables are in
# every butler's database, the switchboard's only in its own.
MODULES = {"core": core_queries, "switchboard": switchboard_queries}


def statements(module: ModuleType) -> dict[str, str]:
    """The statements among a module's names: upper-case plain strings (a `Fragment` is a
    piece of them, never run alone)."""
    return {
        name: value for name, value in vars(module).items() if name.isupper() and type(value) is str
    }


def filtered(module: ModuleType) -> dict[str, Filtered]:
    return {name: v for name, v in vars(module).items() if isinstance(v, Filtered)}


def test_the_modules_name_statements_and_pieces_apart() -> None:
    """Sanity of the split the other tests rely on: the registry's and the inbox's statements
    are statements, the shared column lists and the trace fragment are pieces."""
    found = statements(switchboard_queries)
    assert {"REGISTRY", "REGISTRY_TARGET", "INBOX_CLAIM_NEXT", "OUTBOX_CLAIM"} <= found.keys()
    assert isinstance(switchboard_queries.TRACE_OF_CONTEXT, Fragment)
    assert "TRACE_OF_CONTEXT" not in found and "HELD_KEY" not in found
    assert "_REGISTRY_COLUMNS" not in found
    assert filtered(switchboard_queries).keys() == {"DASHBOARD_MESSAGES", "DASHBOARD_ROUTES"}
    assert {"STATE_SET", "SCHEDULE_DUE", "SESSIONS_LIST"} <= statements(core_queries).keys()
    assert "_SCHEDULE_COLUMNS" not in statements(core_queries)


def test_filters_are_numbered_after_the_fixed_parameters_in_the_order_given() -> None:
    routes = switchboard_queries.DASHBOARD_ROUTES
    text, values = routes.build(None, True, "then")
    assert "WHERE success = $2 AND created_at < $3" in text
    assert "routed_to =" not in text
    assert values == [True, "then"]
    text, values = routes.build(None, None, None)
    assert "WHERE" not in text and values == []
    with pytest.raises(ValueError):  # one value per filter, never silently fewer
        routes.build("general")


def test_every_named_statement_is_used_by_a_store() -> None:
    """A statement nobody runs is a leftover: it would be kept in step with the schema for
    nothing."""
    source = "\n".join(p.read_text() for p in BUTLERS.rglob("*.py") if p.name != "queries.py")
    used = set(re.findall(r"\b[A-Z][A-Z0-9_]+\b", source))
    unused = {
        f"{module.__name__}.{name}"
        for module in MODULES.values()
        for name in statements(module).keys() | filtered(module).keys()
        if name not in used
    }
    assert not unused, f"named but never run: {sorted(unused)}"


@pytest.mark.parametrize("branch", sorted(MODULES))
async def test_every_named_statement_prepares_on_a_migrated_database(
    branch: str,
    make_database: Any,
    core_template: str,
    switchboard_template: str,
    db_conn: Any,
) -> None:
    template = switchboard_template if branch == "switchboard" else core_template
    conn = await db_conn(await make_database(template))
    failed: dict[str, str] = {}
    for name, text in statements(MODULES[branch]).items():
        try:
            await conn.prepare(text)
        except Exception as exc:  # every failure named at once, not the first only
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed


@pytest.mark.parametrize("name", sorted(filtered(switchboard_queries)))
async def test_a_filtered_statement_prepares_with_none_and_with_all_its_filters(
    name: str, make_database: Any, switchboard_template: str, db_conn: Any
) -> None:
    conn = await db_conn(await make_database(switchboard_template))
    query = filtered(switchboard_queries)[name]
    for given in ([None] * len(query.filters), ["value"] * len(query.filters)):
        text, values = query.build(*given)
        prepared = await conn.prepare(text)
        # The store passes the fixed parameters, then the filters' values.
        assert len(prepared.get_parameters()) == query.fixed + len(values), text


async def test_the_dashboard_reads_the_registry_as_the_switchboard_does(
    pg_server: Any, make_database: Any, switchboard_template: str
) -> None:
    """The fleet page and a butler's page read what list_butlers reads (one statement, not a
    copy of it): the same rows, a stale butler and the switchboard marked as such."""
    pool = await create_pool(pg_server, await make_database(switchboard_template))
    try:
        routing = RoutingStore(pool)
        await routing.record_discovery(
            [
                RegistryEntry("switchboard", "http://127.0.0.1:1/sse", "front door", [], True),
                RegistryEntry("gone", "http://127.0.0.1:2/sse", "will go", ["email"]),
            ]
        )
        await routing.record_discovery(
            [RegistryEntry("switchboard", "http://127.0.0.1:1/sse", "front door", [], True)]
        )
        dashboard = DashboardStore(pool)
        rows = await routing.registry()
        assert [(r["name"], r["stale"], r["is_switchboard"]) for r in rows] == [
            ("gone", True, False),
            ("switchboard", False, True),
        ]
        assert await dashboard.registry() == rows
        assert await dashboard.butler("gone") == rows[0]
        assert await dashboard.butler("nobody") is None
    finally:
        await pool.close()


async def test_approvals_and_notifications_are_found_through_their_indexes(
    make_database: Any, switchboard_template: str, db_conn: Any
) -> None:
    """Each message listed (`inbox_list`, a message's page) asks for its approvals by trace
    id: they were found by a scan of every approval (36 ms at 3000: a year of data's
    walkthrough). The index is on the queries' own expression; one written otherwise is
    never used, which this sees."""
    conn = await db_conn(await make_database(switchboard_template))
    await conn.execute("SET enable_seqscan = off")  # what the planner does with many rows
    for text, argument, index in (
        (switchboard_queries.OPERATOR_APPROVALS_BY_TRACE, ["0" * 32], "approvals_trace_id"),
        (switchboard_queries.DASHBOARD_MESSAGE_APPROVALS, "0" * 32, "approvals_trace_id"),
        # Each notify's hourly count of its butler's notifications (a scan of the outbox).
        (switchboard_queries.OUTBOX_NOTIFICATIONS_LAST_HOUR, "health", "outbox_notifications"),
    ):
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN {text}", argument))
        assert index in plan, plan
