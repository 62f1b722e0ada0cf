"""discover(): keep butler_registry in step with the config directory.

New butlers are inserted, changed ones updated, and everything found is stamped as seen.
Nothing is ever deleted: a butler whose directory vanished keeps its old `last_seen_at` and
is marked stale (`missing_since`), which `route` refuses until a discover sees it again. One
broken butler.toml is reported, never fatal (that butler is stale until it loads).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from butlers.config import Placement, load_config_dir
from butlers.switchboard.routing_store import RegistryEntry, RoutingStore

logger = logging.getLogger(__name__)


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
