"""Channel modules (butlers.channels: telegram, email): each adds tools to its butler and
may run an intake.

A module that is declared but cannot run here (its credentials' variables not set) is
`skipped`, one that tried and failed (a token or login refused) `failed`, each with why, in
`status()`, /health and the dashboard (butlers.core_tools.module_report); neither stops its
butler from starting.

Where this package sits among the others, and a message's path through them:
docs/architecture.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastmcp import FastMCP
from starlette.routing import BaseRoute

from butlers.channels import CHANNELS, ChannelContext
from butlers.channels.base import ChannelModule
from butlers.config import ButlerConfig
from butlers.context import ModuleStatus

if TYPE_CHECKING:
    from butlers.core_store import CoreStore
    from butlers.settings import Settings
    from butlers.switchboard.worker import InboxWorker

logger = logging.getLogger(__name__)


@dataclass
class Modules:
    """The channel modules of one butler, and the status of every declared one: `channels`
    are those built (each says in its status whether it runs, waits or failed), `skipped`
    those that could not be tried here. One component (butlers.lifecycle): the switchboard
    opens them between its worker and its leadership, another butler with the daemon."""

    channels: list[ChannelModule] = field(default_factory=list)
    skipped: list[ModuleStatus] = field(default_factory=list)
    # Routes that arrive through reverse proxies and carry their own secrets (see butlers.http).
    webhooks: list[BaseRoute] = field(default_factory=list)

    def statuses(self) -> list[ModuleStatus]:
        return [m.status for m in self.channels] + self.skipped

    async def open(self) -> None:
        for module in self.channels:
            await module.open()

    async def close(self) -> None:
        for module in reversed(self.channels):
            try:
                await module.close()
            except Exception:
                logger.exception("module %s did not stop cleanly", module.name)


def build_modules(
    config: ButlerConfig,
    mcp: FastMCP,
    worker: InboxWorker | None,
    settings: Settings,
    store: CoreStore | None = None,
) -> Modules:
    """Build each channel the butler.toml declares (butlers.channels: the registry) and
    register its tools and routes; nothing connects until open(). `worker`: the
    switchboard's inbox, which their messages go to (None: a butler that only sends); the
    switchboard hands them its desks (Switchboard.use_channels).

    Credentials come from the variables the butler.toml names, looked up in `settings`;
    what a channel keeps across starts goes to `store` (the butler's state table)."""
    modules = Modules()
    context = ChannelContext(settings=settings, worker=worker, store=store)
    for spec in CHANNELS:
        table = config.channels.get(spec.name)
        if table is None:
            continue
        missing = [
            name for name in spec.required_variables(table) if settings.variable(name) is None
        ]
        if missing:
            modules.skipped.append(_not_configured(spec.name, missing))
            continue
        module = spec.open(table, context)
        module.register(mcp)
        modules.webhooks.extend(module.webhook_routes())
        modules.channels.append(module)
    for status in modules.skipped:
        logger.warning(
            "butler %s: module %s %s: %s",
            config.name,
            status.name,
            status.status,
            status.detail,
            extra={"action": "module_skipped"},
        )
    return modules


def _not_configured(name: str, missing: list[str]) -> ModuleStatus:
    """Skipped, not failed: nothing was tried. The detail names the variables to set."""
    return ModuleStatus(name, "skipped", f"{', '.join(missing)} not set", tuple(missing))
