"""What the gateway would offer, without serving it: `--dry-run` (each child's state and
subtools) and `--report` (the tools/list a host loads, natively and through the gateway)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from butlers.gateway.control import control_tools
from butlers.gateway.run import GatewayOptions, RegistryFetch, build_gateway
from butlers.http import require_token_beyond_loopback


async def dry_run(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, *, as_json: bool = False
) -> tuple[int, str]:
    """Start every child, list each one's state and subtools (names and summaries), stop.
    The exit code is 1 when a child is in error, so a script can check a config with it."""
    gateway = await build_gateway(options, fetch_registry)
    try:
        await gateway.warm_all()
        children: list[dict[str, Any]] = []
        for slot in gateway.slots.values():
            subtools = []
            if slot.state != "error":
                subtools = await gateway.introspect(slot, "summary")
            children.append(
                {
                    "name": slot.spec.name,
                    "kind": slot.spec.kind,
                    "source": slot.spec.source,
                    "state": slot.state,
                    "error": slot.error,
                    # Activate and search mode list no suite tool.
                    "suite": slot.suite_name if gateway.mode in ("suite", "both") else None,
                    "subtools": [
                        {"name": t["name"], "summary": t.get("summary", "")} for t in subtools
                    ],
                }
            )
    finally:
        await gateway.close()
    code = 1 if any(c["state"] == "error" for c in children) else 0
    if as_json:
        return code, json.dumps({"mode": gateway.mode, "children": children})
    lines = [f"mode: {gateway.mode}, {len(children)} children"]
    for child in children:
        head = f"{child['name']} ({child['kind']}, {child['state']})"
        if child["error"]:
            lines.append(f"{head}: {child['error']}")
            continue
        suite = f", suite {child['suite']}" if child["suite"] else ""
        lines.append(f"{head}: {len(child['subtools'])} subtools{suite}")
        width = max((len(t["name"]) for t in child["subtools"]), default=0)
        lines += [f"  {t['name']:<{width}}  {t['summary']}".rstrip() for t in child["subtools"]]
    return code, "\n".join(lines)


def _json(model: Any) -> str:
    return json.dumps(model.model_dump(by_alias=True, exclude_none=True, mode="json"))


def _tokens(chars: int) -> int:
    """About four characters per token for JSON tool definitions."""
    return math.ceil(chars / 4)


async def token_report(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, *, as_json: bool = False
) -> str:
    """Per child and in total: the tools/list a host sees natively vs through the gateway;
    a Markdown table, or (`as_json`) one JSON object with the same figures."""
    if options.transport != "stdio":
        require_token_beyond_loopback("the gateway", options.host, options.auth_token)
    gateway = await build_gateway(options, fetch_registry)
    try:
        await gateway.warm_all()
        # Whole definitions, as each side's tools/list carries them (schemas included).
        listed = {
            tool.name: len(_json(tool.to_mcp_tool())) for tool in await gateway.mcp.list_tools()
        }
        rows = [
            (
                slot.spec.name,
                slot.state,
                len(slot.tools),
                sum(len(json.dumps(t)) for t in slot.tools),
                listed.get(slot.suite_name, 0),
                gateway.wrapper_load_chars(slot),
            )
            for slot in gateway.slots.values()
        ]
        # The gateway's own tools the host lists in this mode (search: its four).
        own = control_tools(gateway.mode)
        control = sum(listed.get(name, 0) for name in own)
    finally:
        await gateway.close()
    if as_json:
        return json.dumps(_report_data(rows, control, own))
    lines = [
        "| child | state | tools | native chars | native tokens | gateway chars | gateway tokens "
        "| wrapper tokens |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, state, count, native, suite, wrapper in rows:
        lines.append(
            f"| {name} | {state} | {count} | {native} | {_tokens(native)} | {suite} | "
            f"{_tokens(suite)} | {'-' if wrapper is None else _tokens(wrapper)} |"
        )
    native_total = sum(r[3] for r in rows)
    gateway_total = sum(r[4] for r in rows) + control
    lines.append(
        f"| **total** (gateway incl. {len(own)} gateway_* tools) | | "
        f"{sum(r[2] for r in rows)} | {native_total} | {_tokens(native_total)} | "
        f"{gateway_total} | {_tokens(gateway_total)} | |"
    )
    if native_total:
        saved = 100 * (1 - gateway_total / native_total)
        lines.append("")
        lines.append(f"Through the gateway a host's tool list is {saved:.0f}% smaller.")
    if any(r[5] is not None for r in rows):
        lines.append(
            "wrapper tokens: what each natural_language call's Claude session loads (the "
            "wrapper's instructions and the child's tools), paid by that session, not the host."
        )
    return "\n".join(lines)


ReportRow = tuple[str, str, int, int, int, int | None]


def _report_data(rows: Sequence[ReportRow], control: int, own: Sequence[str]) -> dict[str, Any]:
    """The token report as data: per child, and the totals (the gateway's including its
    control tools)."""
    native_total = sum(r[3] for r in rows)
    gateway_total = sum(r[4] for r in rows) + control
    return {
        "children": [
            {
                "name": name,
                "state": state,
                "tools": count,
                "native_chars": native,
                "native_tokens": _tokens(native),
                "gateway_chars": suite,
                "gateway_tokens": _tokens(suite),
                "wrapper_chars": wrapper,
                "wrapper_tokens": None if wrapper is None else _tokens(wrapper),
            }
            for name, state, count, native, suite, wrapper in rows
        ],
        "control_tools": list(own),
        "control_chars": control,
        "total": {
            "tools": sum(r[2] for r in rows),
            "native_chars": native_total,
            "native_tokens": _tokens(native_total),
            "gateway_chars": gateway_total,
            "gateway_tokens": _tokens(gateway_total),
            "saved_percent": round(100 * (1 - gateway_total / native_total))
            if native_total
            else None,
        },
    }
