"""discover(): keep butler_registry in step with the config directory.

New butlers are inserted, changed ones updated, and everything found is stamped as seen.
Nothing is ever deleted: a butler whose directory vanished keeps its old `last_seen_at` and
is marked stale (`missing_since`), which `route` refuses until a discover sees it again. One
broken butler.toml is reported, never fatal (that butler is stale until it loads).

An endpoint that still answers is kept. The endpoint discover computes is where this process
thinks a butler listens (its butler.toml's port, this process's `--port-offset`, the
environment's template); another process of the fleet may know better. A switchboard replica
started without the fleet's `--port-offset` rewrote every endpoint to ports where nothing
listened, and every route failed. So a registered endpoint whose /health answers as that
butler, on the same database of the same PostgreSQL server as this switchboard's config says
(`database_identity`: not someone else's fleet that now has the port), stays, and the change
is reported as `kept`; one that does not answer so is replaced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from butlers.config import Placement, load_config_dir
from butlers.core_store import database_identity
from butlers.switchboard.routing_store import RegistryEntry, RoutingStore

logger = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 1.5  # for a registered endpoint's /health, asked only when it would change


def _changes(row: dict[str, Any], entry: RegistryEntry) -> list[str]:
    changed = []
    if row["endpoint_url"] != entry.endpoint_url:
        changed.append("endpoint_url")
    if (row["description"] or "") != entry.description:
        changed.append("description")
    if list(row["modules"] or []) != entry.modules:
        changed.append("modules")
    if row["is_switchboard"] != entry.is_switchboard:
        changed.append("is_switchboard")
    return changed


async def discover(store: RoutingStore, config_dir: Path, placement: Placement) -> dict[str, Any]:
    """Scan `config_dir` and update the registry; returns what was added, updated and stale.
    `placement`: the endpoints the environment gives butlers whose butler.toml names none."""
    fleet = await asyncio.to_thread(load_config_dir, config_dir, placement)
    known = {row["name"]: row for row in await store.registry()}
    entries = [
        RegistryEntry(b.name, b.endpoint_url, b.description, b.modules, b.is_switchboard)
        for b in fleet.butlers
    ]
    databases = {b.name: b.database for b in fleet.butlers}
    entries, kept = await _keep_answering_endpoints(entries, known, store, databases)
    added: list[str] = []
    updated: list[dict[str, Any]] = []
    unchanged: list[str] = []
    for entry in entries:
        row = known.get(entry.name)
        if row is None:
            added.append(entry.name)
        elif changed := _changes(row, entry):
            updated.append({"name": entry.name, "changed": changed})
        else:
            unchanged.append(entry.name)
    await store.record_discovery(entries)
    found = {entry.name for entry in entries}
    stale = sorted(name for name in known if name not in found)
    report = {
        "added": added,
        "updated": updated,
        "unchanged": unchanged,
        "stale": stale,
        "kept": kept,
        "errors": [{"path": str(e.path), "key": e.key, "problem": e.problem} for e in fleet.errors],
    }
    logger.info(
        "discover: %d added, %d updated, %d stale, %d errors",
        len(added),
        len(updated),
        len(stale),
        len(fleet.errors),
        extra={"action": "discover"},
    )
    return report


async def _keep_answering_endpoints(
    entries: list[RegistryEntry],
    known: dict[str, dict[str, Any]],
    store: RoutingStore,
    databases: dict[str, str],
) -> tuple[list[RegistryEntry], list[dict[str, str]]]:
    """`entries` with each registered endpoint that still answers as its butler (on its
    database of our server) kept in place of the new one; and those kept (name, the endpoint
    kept, the one not taken)."""
    moving = [
        (index, entry, known[entry.name]["endpoint_url"])
        for index, entry in enumerate(entries)
        if entry.name in known
        and not known[entry.name]["stale"]
        and known[entry.name]["endpoint_url"] != entry.endpoint_url
    ]
    if not moving:
        return entries, []
    started = await store.server_started()
    answers = await asyncio.gather(
        *(
            _answers_as(old, entry.name, database_identity(started, databases[entry.name]))
            for _, entry, old in moving
        )
    )
    entries = list(entries)
    kept: list[dict[str, str]] = []
    for (index, entry, old), answered in zip(moving, answers, strict=True):
        if not answered:
            continue
        entries[index] = dataclasses.replace(entry, endpoint_url=old)
        kept.append({"name": entry.name, "endpoint_url": old, "instead_of": entry.endpoint_url})
        logger.warning(
            "discover: %s stays at %s, where it answers, not %s (what this process's config "
            "gives: another --port-offset or BUTLERS_ENDPOINT_URL_TEMPLATE?); once nothing "
            "answers there, discover moves it",
            entry.name,
            old,
            entry.endpoint_url,
            extra={"action": "discover_kept"},
        )
    return entries, kept


async def _answers_as(endpoint_url: str, name: str, identity: str) -> bool:
    """Whether the butler `name` answers /health beside `endpoint_url`, on the database
    `identity` names."""
    import aiohttp

    parts = urlsplit(endpoint_url)
    health = urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
    try:
        timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(health) as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    if not isinstance(body, dict) or body.get("name") != name:
        return False
    database = body.get("database")
    return isinstance(database, dict) and database.get("id") == identity
