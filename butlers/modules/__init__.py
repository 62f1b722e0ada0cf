"""Channel modules (telegram, email): each adds tools to its butler and may run an intake.

A module that is declared but cannot run here (no credentials, not built yet) is reported in
`status()` and /health and skipped; it never stops its butler from starting.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fastmcp import FastMCP
from starlette.routing import BaseRoute

from butlers.config import ButlerConfig
from butlers.context import ModuleStatus

if TYPE_CHECKING:
    from butlers.switchboard import Switchboard

logger = logging.getLogger(__name__)


class RunningModule(Protocol):
    name: str
    status: ModuleStatus

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class Modules:
    """The modules of one butler: those that run, and the status of every declared one."""

    running: list[RunningModule] = field(default_factory=list)
    skipped: list[ModuleStatus] = field(default_factory=list)
    # Routes that arrive through reverse proxies and carry their own secrets (see butlers.http).
    webhooks: list[BaseRoute] = field(default_factory=list)

    def statuses(self) -> list[ModuleStatus]:
        return [m.status for m in self.running] + self.skipped

    async def start(self) -> None:
        for module in self.running:
            await module.start()

    async def stop(self) -> None:
        for module in reversed(self.running):
            try:
                await module.stop()
            except Exception:
                logger.exception("module %s did not stop cleanly", module.name)


def _missing_env(names: list[str]) -> list[str]:
    return [name for name in names if not os.environ.get(name)]


def build_modules(config: ButlerConfig, mcp: FastMCP, switchboard: Switchboard | None) -> Modules:
    """Register each declared module's tools and routes; nothing connects until start()."""
    modules = Modules()
    if config.telegram is not None:
        if missing := _missing_env([config.telegram.token_env]):
            modules.skipped.append(_not_configured("telegram", missing))
        else:
            from butlers.modules.telegram import TelegramModule

            worker = switchboard.worker if switchboard is not None else None
            telegram = TelegramModule(
                config.telegram,
                os.environ[config.telegram.token_env],
                worker,
                webhook_secret=os.environ.get(config.telegram.webhook_secret_env) or None,
            )
            telegram.register(mcp)
            modules.webhooks.extend(telegram.webhook_routes())
            if switchboard is not None:
                switchboard.outbox.channels["telegram"] = telegram
            modules.running.append(telegram)
    if config.email is not None:
        if missing := _missing_env([config.email.username_env, config.email.password_env]):
            modules.skipped.append(_not_configured("email", missing))
        else:
            from butlers.modules.email import WEBHOOK_TOKEN_ENV, EmailModule

            worker = switchboard.worker if switchboard is not None else None
            mail = EmailModule(
                config.email,
                os.environ[config.email.username_env],
                os.environ[config.email.password_env],
                worker,
                webhook_token=os.environ.get(WEBHOOK_TOKEN_ENV) or None,
            )
            mail.register(mcp)
            modules.webhooks.extend(mail.webhook_routes())
            if switchboard is not None:
                switchboard.outbox.channels["email"] = mail
            modules.running.append(mail)
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
    return ModuleStatus(name, "skipped", f"not configured: {', '.join(missing)} not set")
