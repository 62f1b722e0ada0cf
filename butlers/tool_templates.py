"""A tool registered by every butler from the same `def`: its schema parsed once per process.

Every butler registers the core tools (butlers.core_tools), each a closure over that butler's
own context. FastMCP derives a tool's input and output schemas from its function's signature
with pydantic, and closures made by one `def` have one signature: `butlers up` with the four
shipped butlers parsed the same seventeen signatures four times, 90 ms of a one-second warm
start (14 ms a butler once pydantic is warm; bench/startup.py). Here the first closure is parsed
as `@mcp.tool` parses it, and the others get a copy of that tool with their own function.

A later closure reuses the parse only when everything the schema is made of is the same: the
code object, the name, the docstring, the defaults and the annotations. Anything else (a
function of its own, defaults that cannot be compared, a wrapper) is parsed as FastMCP always
did.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any, TypeVar

from fastmcp import FastMCP
from fastmcp.tools import FunctionTool

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class _Signature:
    """What FastMCP reads from a function to build its tool (the code object aside)."""

    name: str
    doc: str | None
    defaults: tuple[Any, ...] | None
    kwdefaults: tuple[tuple[str, Any], ...] | None
    annotations: tuple[tuple[str, Any], ...]


def _detached() -> None:
    """What a template holds instead of the first closure (which would keep its butler's
    context alive for the life of the process)."""


# code object -> (the signature it was parsed with, that tool without its function). A memo of
# FastMCP's parse: what it holds is derived from source code, never from a butler's state.
_templates: dict[CodeType, tuple[_Signature, FunctionTool]] = {}


def _signature(fn: Callable[..., Any]) -> _Signature | None:
    """The parts of `fn` its tool is built from; None when they cannot be compared (such a
    function is parsed every time): defaults that do not hash, FastMCP metadata set on the
    function, or a wrapper (`functools.wraps`: one wrapper's code serves many functions, and
    the signature FastMCP reads is the wrapped one's)."""
    if hasattr(fn, "__wrapped__") or hasattr(fn, "__fastmcp__"):
        return None
    try:
        signature = _Signature(
            name=fn.__name__,
            doc=fn.__doc__,
            defaults=fn.__defaults__,
            kwdefaults=tuple(sorted((fn.__kwdefaults__ or {}).items())) or None,
            annotations=tuple(fn.__annotations__.items()),
        )
        hash(signature)
    except (AttributeError, TypeError):
        return None
    return signature


def add_tool(mcp: FastMCP, fn: F) -> F:
    """Register `fn` as a tool of `mcp`, as `@mcp.tool` does; a decorator. A function made by
    the same `def` as one registered before (on any server of this process) reuses its parse."""
    code = getattr(fn, "__code__", None)
    signature = _signature(fn) if isinstance(code, CodeType) else None
    known = _templates.get(code) if isinstance(code, CodeType) else None
    if signature is None or known is None or known[0] != signature:
        tool = FunctionTool.from_function(fn)
        if isinstance(code, CodeType) and signature is not None:
            _templates[code] = (signature, tool.model_copy(update={"fn": _detached}))
    else:
        template = known[1]
        # Each its own schemas: nothing downstream may edit one butler's and change another's.
        tool = template.model_copy(
            update={
                "fn": fn,
                "parameters": copy.deepcopy(template.parameters),
                "output_schema": copy.deepcopy(template.output_schema),
            }
        )
    mcp.add_tool(tool)
    return fn
