"""Channel modules (telegram, email): each adds tools to its butler and may run an intake.

A module that is declared but cannot run here (no credentials, not built yet) is reported in
`status()` and /health and skipped; it never stops its butler from starting.
"""

from __future__ import annotations

import logging
import os

from fastmcp import FastMCP

from butlers.config import ButlerConfig
from butlers.context import ButlerContext, ModuleStatus

logger = logging.getLogger(__name__)


def _missing_env(names: list[str]) -> list[str]:
    return [name for name in names if not os.environ.get(name)]


def start_modules(config: ButlerConfig, mcp: FastMCP, ctx: ButlerContext) -> list[ModuleStatus]:
    statuses: list[ModuleStatus] = []
    if config.telegram is not None:
        missing = _missing_env([config.telegram.token_env])
        statuses.append(_not_available("telegram", missing))
    if config.email is not None:
        missing = _missing_env([config.email.username_env, config.email.password_env])
        statuses.append(_not_available("email", missing))
    for status in statuses:
        logger.warning(
            "butler %s: module %s %s: %s",
            config.name,
            status.name,
            status.status,
            status.detail,
            extra={"action": "module_skipped"},
        )
    return statuses


def _not_available(name: str, missing: list[str]) -> ModuleStatus:
    if missing:
        return ModuleStatus(name, "skipped", f"not configured: {', '.join(missing)} not set")
    return ModuleStatus(name, "skipped", "the channel intake is not part of this version yet")
