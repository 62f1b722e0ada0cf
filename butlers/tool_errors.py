"""ToolRefusal, the tool-answer class: a message for the caller instead of a result.

Kept apart from butlers.errors (whose docstring draws the whole tree) because it subclasses
FastMCP's ToolError, and importing FastMCP takes seconds: only modules that serve tools
import this one.
"""

from __future__ import annotations

import logging

from fastmcp.exceptions import ToolError


class ToolRefusal(ToolError):
    """A tool call answered with a message for the caller instead of a result.

    FastMCP logs every ToolError at ERROR, which reads like a crash in the butler's log. A
    caller's mistake (empty text, no such name) is routine and logged at INFO; sites where
    something failed that an operator may want to see pass `log_level=logging.WARNING`.
    """

    def __init__(self, *args: object, log_level: int = logging.INFO) -> None:
        super().__init__(*args, log_level=log_level)
