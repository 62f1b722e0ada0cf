"""What the gateway would offer, without serving it: `--dry-run` (each child's state and
subtools) and `--report` (what a host loads: every server directly, and the gateway in each
mode).

The report measures the `tools/list` result a host receives, in bytes of its JSON as the MCP
SDK writes it on the wire (compact, UTF-8), and counts its tokens with a real tokenizer when
one works offline, else estimates them (chars/4) and says so. Claude's own tokenizer is not
published for offline use and the Messages API's `count_tokens` needs the network, so the
real one is tiktoken's (`pip install "butlers[report]"`), an approximation of Claude's, used
only when its BPE file is already in its cache: a report never downloads anything.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import math
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mcp_types
from fastmcp import FastMCP

from butlers.gateway.control import Mode, control_tools
from butlers.gateway.run import GatewayOptions, RegistryFetch, build_gateway
from butlers.gateway.server import Gateway
from butlers.http import require_token_beyond_loopback


async def dry_run(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, *, as_json: bool = False
) -> tuple[int, str]:
    """Start every child, list each one's state and subtools (names and summaries), and what
    was declared but left out (a file or a server that could not be read), stop. The exit
    code is 1 when a child is in error or a declaration was left out, so a script can check
    a config with it."""
    options = dataclasses.replace(options, record_first_start=False)
    gateway, skipped = await build_gateway(options, fetch_registry)
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
    left_out = [{"server": s.server, "error": str(s.error)} for s in skipped]
    pending = [{"name": name, "detail": detail} for name, detail in gateway.pending.items()]
    # (Pending servers or settings fail it too: a check in CI must see a planted server; so
    # do butlers it could not list: it exited 0 saying nothing of them, a walkthrough.)
    butlers = gateway.butlers_missing
    troubled = left_out or pending or gateway.settings_note is not None or butlers is not None
    code = 1 if troubled or any(c["state"] == "error" for c in children) else 0
    if as_json:
        return code, json.dumps(
            {
                "mode": gateway.mode,
                "children": children,
                "skipped": left_out,
                "pending": pending,
                "settings": gateway.settings_note,
                "butlers": butlers,
            }
        )
    count = f"{len(children)} {'child' if len(children) == 1 else 'children'}"
    lines = [f"mode: {gateway.mode}, {count}"]
    if gateway.settings_note is not None:
        lines.append(f"settings: {gateway.settings_note}")
    if butlers is not None:
        lines.append(f"butlers (error): {butlers}")
    lines += [f"skipped: {s['error']}" for s in left_out]
    lines += [f"pending: {p['name']}: {p['detail']}" for p in pending]
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


# -- counting tokens --------------------------------------------------------------------------

# tiktoken's encodings, best first: o200k_base is its newest general one.
TIKTOKEN_ENCODINGS = ("o200k_base", "cl100k_base")


@dataclass(frozen=True)
class TokenCounter:
    """How the report counts tokens: `encode` is a real tokenizer's (tiktoken's
    `encode_ordinary`: a tool description that holds a special token's text is text, not a
    reason to fail); None: the chars/4 estimate."""

    method: Literal["tiktoken", "estimate"]
    encoding: str | None = None
    encode: Callable[[str], list[int]] | None = None

    @property
    def label(self) -> str:
        if self.encode is None:
            return "tokens: estimate, chars/4"
        return f"tokens: tiktoken {self.encoding} (not Claude's tokenizer: an approximation)"

    def count(self, text: str) -> int:
        if self.encode is None:
            return math.ceil(len(text) / 4)
        return len(self.encode(text))


ESTIMATE = TokenCounter("estimate")


def find_token_counter(environ: Mapping[str, str]) -> TokenCounter:
    """tiktoken when it is installed and an encoding's BPE file is already in its cache, else
    the estimate. `environ`: the process's, which tiktoken reads too (TIKTOKEN_CACHE_DIR,
    DATA_GYM_CACHE_DIR)."""
    name = cached_tiktoken_encoding(environ)
    if name is None:
        return ESTIMATE
    tiktoken = importlib.import_module("tiktoken")
    return TokenCounter("tiktoken", name, tiktoken.get_encoding(name).encode_ordinary)


def cached_tiktoken_encoding(environ: Mapping[str, str]) -> str | None:
    """The first of TIKTOKEN_ENCODINGS whose BPE file tiktoken would read from its cache,
    intact (checked against the hash tiktoken expects); None when tiktoken is not installed
    or none is cached. tiktoken downloads a file it does not find cached: a report must not
    reach for the network, so only a cached one is used."""
    if importlib.util.find_spec("tiktoken") is None:  # an optional extra (`report`)
        return None
    for name in TIKTOKEN_ENCODINGS:
        bpe = _tiktoken_bpe_file(name)
        if bpe is not None and _tiktoken_cached(*bpe, environ):
            return name
    return None


def _tiktoken_bpe_file(encoding: str) -> tuple[str, str] | None:
    """Where tiktoken fetches `encoding`'s BPE file and the sha256 it expects, read from the
    installed `tiktoken_ext.openai_public` (the `load_tiktoken_bpe(url, expected_hash=...)`
    call in the function of that name), so the cache checked is the one tiktoken reads.
    None when the source no longer looks like that: then tiktoken is not used."""
    spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for function in tree.body:
        if not (isinstance(function, ast.FunctionDef) and function.name == encoding):
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "load_tiktoken_bpe"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                for keyword in node.keywords:
                    if keyword.arg == "expected_hash" and isinstance(keyword.value, ast.Constant):
                        return node.args[0].value, str(keyword.value.value)
    return None


def _tiktoken_cached(url: str, sha256: str, environ: Mapping[str, str]) -> bool:
    """Whether tiktoken would find `url`'s file in its cache, intact (its rule: the directory
    TIKTOKEN_CACHE_DIR, else DATA_GYM_CACHE_DIR, else <tmp>/data-gym-cache, "" meaning no
    cache; the file named by the URL's sha1; a file failing the hash is fetched again)."""
    if "TIKTOKEN_CACHE_DIR" in environ:
        directory = environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in environ:
        directory = environ["DATA_GYM_CACHE_DIR"]
    else:
        directory = str(Path(tempfile.gettempdir()) / "data-gym-cache")
    if not directory:
        return False
    path = Path(directory) / hashlib.sha1(url.encode()).hexdigest()  # tiktoken's file name
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == sha256


# -- the report -------------------------------------------------------------------------------

# The gateway's modes compared with loading every server directly ("both" lists what "suite"
# lists until something is activated).
REPORT_MODES: tuple[Mode, ...] = ("suite", "activate", "search")


def wire_json(value: Any) -> str:
    """`value` written as the MCP SDK writes JSON on the wire (pydantic's: compact, non-ASCII
    as is), so a child's tools/list and the gateway's are counted alike."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _bytes(text: str) -> int:
    return len(text.encode("utf-8"))


class _Host:
    """One host's side of a stdio session, in memory: its lines in (initialize, initialized,
    tools/list) and the server's lines out; the input ends once tools/list is answered,
    which ends the session."""

    def __init__(self) -> None:
        self.answers: dict[int, str] = {}
        self._answered: dict[int, asyncio.Event] = {1: asyncio.Event(), 2: asyncio.Event()}

    async def lines(self) -> AsyncIterator[str]:
        params = {
            "protocolVersion": mcp_types.LATEST_PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "butlers-gateway-report", "version": "1"},
        }
        yield json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params})
        await self._answered[1].wait()
        yield json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
        yield json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}})
        await self._answered[2].wait()

    async def write(self, text: str) -> None:
        message = json.loads(text)
        answered = self._answered.get(message.get("id"))
        if answered is not None:
            self.answers[message["id"]] = text.rstrip("\n")
            answered.set()

    async def flush(self) -> None:
        return None


async def listed_tools(mcp: FastMCP, timeout_s: float = 30) -> dict[str, Any]:
    """The result of `tools/list` exactly as `mcp` answers a host (on the latest protocol
    revision): FastMCP's server behind the MCP SDK's own stdio transport, as `butlers gateway`
    serves it (butlers.gateway.stdio), fed a host's lines in memory. Not rebuilt from
    FastMCP's tool objects: the SDK shapes what goes out (field order, fields a revision
    has), so only its output is what a host receives."""
    from fastmcp.server.context import reset_transport, set_transport
    from mcp.server.stdio import stdio_server

    host = _Host()
    token = set_transport("stdio")
    try:
        async with (
            asyncio.timeout(timeout_s),
            mcp._lifespan_manager(),
            stdio_server(stdin=host.lines(), stdout=host) as (read, write),  # type: ignore[arg-type]
        ):
            server = mcp._mcp_server
            await server.run(read, write, server.create_initialization_options())
    finally:
        reset_transport(token)
    answer = json.loads(host.answers[2])
    if "result" not in answer:
        raise RuntimeError(f"the gateway answered tools/list with {answer.get('error')!r}")
    result: dict[str, Any] = answer["result"]
    return result


async def _mode_listings(gateway: Gateway, options: GatewayOptions) -> dict[Mode, dict[str, Any]]:
    """Each mode's `tools/list`, from a gateway built in that mode over the same children,
    never started (what a mode lists at start does not depend on them)."""
    specs = [slot.spec for slot in gateway.slots.values()]
    listings: dict[Mode, dict[str, Any]] = {}
    for mode in REPORT_MODES:
        other = Gateway(
            gateway.config, specs, environ=options.environ, auth_token=options.auth_token, mode=mode
        )
        try:
            listings[mode] = await listed_tools(other.mcp)
        finally:
            await other.close()
    return listings


async def token_report(
    options: GatewayOptions, fetch_registry: RegistryFetch | None, *, as_json: bool = False
) -> str:
    """What a host loads: every child's tools directly, and the gateway in suite, activate
    and search mode, in bytes and tokens; per child and in total. A Markdown table, or
    (`as_json`) the same figures as one JSON object (shape: `_report_data`)."""
    if options.transport != "stdio":
        require_token_beyond_loopback("the gateway", options.host, options.auth_token)
    options = dataclasses.replace(options, record_first_start=False)
    gateway, _ = await build_gateway(options, fetch_registry)
    try:
        await gateway.warm_all()
        listings = await _mode_listings(gateway, options)
        children = [
            {
                "name": slot.spec.name,
                "kind": slot.spec.kind,
                "state": slot.state,
                "error": slot.error,
                "tools": slot.tools,
                "suite_tool": slot.suite_name,
                "wrapper_chars": gateway.wrapper_load_chars(slot),
            }
            for slot in gateway.slots.values()
        ]
    finally:
        await gateway.close()
    # (Blocking: tiktoken's import and BPE file, and the counting.)
    counter = await asyncio.to_thread(find_token_counter, options.environ)
    data = await asyncio.to_thread(_report_data, gateway.mode, children, listings, counter)
    return json.dumps(data) if as_json else _markdown(data)


def _report_data(
    mode: Mode,
    children: list[dict[str, Any]],
    listings: Mapping[Mode, dict[str, Any]],
    counter: TokenCounter,
) -> dict[str, Any]:
    """The report as data, the `--json` shape:

    {"mode": this gateway's mode,
     "tokens": {"method": "tiktoken" | "estimate", "encoding": name | null, "label": text},
     "listings": {"direct" | "suite" | "activate" | "search":
                  {"tools": count, "bytes": n, "tokens": n, "percent_of_direct": n | null}
                  (+ "names": the tools listed, for the gateway's modes)},
     "children": [{"name", "kind", "state", "error", "tools", "direct_bytes",
                   "direct_tokens", "suite_tool", "suite_bytes", "suite_tokens",
                   "wrapper_chars"}]}

    `direct` is every child loaded as its own server: one tools/list each (a child in error
    lists nothing), summed. A gateway mode is its one tools/list as a host gets it at start
    (activate: before anything is activated)."""
    suite_tools = {t["name"]: t for t in listings["suite"]["tools"]}
    rows = []
    for child in children:
        direct = "" if child["state"] == "error" else wire_json({"tools": child["tools"]})
        suite = (
            wire_json(suite_tools[child["suite_tool"]])
            if child["suite_tool"] in suite_tools
            else ""
        )
        rows.append(
            {
                "name": child["name"],
                "kind": child["kind"],
                "state": child["state"],
                "error": child["error"],
                "tools": len(child["tools"]),
                "direct_bytes": _bytes(direct),
                "direct_tokens": counter.count(direct) if direct else 0,
                "suite_tool": child["suite_tool"],
                "suite_bytes": _bytes(suite),
                "suite_tokens": counter.count(suite) if suite else 0,
                "wrapper_chars": child["wrapper_chars"],
            }
        )
    direct_bytes = sum(r["direct_bytes"] for r in rows)
    summary: dict[str, dict[str, Any]] = {
        "direct": {
            "tools": sum(r["tools"] for r in rows),
            "bytes": direct_bytes,
            "tokens": sum(r["direct_tokens"] for r in rows),
            "percent_of_direct": 100.0 if direct_bytes else None,
        }
    }
    for listed_mode in REPORT_MODES:
        result = listings[listed_mode]
        text = wire_json(result)
        summary[listed_mode] = {
            "tools": len(result["tools"]),
            "bytes": _bytes(text),
            "tokens": counter.count(text),
            "percent_of_direct": round(100 * _bytes(text) / direct_bytes, 1)
            if direct_bytes
            else None,
            "names": [t["name"] for t in result["tools"]],
        }
    return {
        "mode": mode,
        "tokens": {"method": counter.method, "encoding": counter.encoding, "label": counter.label},
        "listings": summary,
        "children": rows,
    }


_LISTING_LABELS: dict[str, str] = {
    "direct": "every server directly",
    "suite": "gateway --mode suite",
    "activate": "gateway --mode activate (nothing activated yet)",
    "search": "gateway --mode search",
}


def _markdown(data: dict[str, Any]) -> str:
    """The report for a person: per child, then what each way of loading costs."""
    lines = [
        f"{data['tokens']['label']}; bytes: the tools/list JSON a host receives",
        f"this gateway's mode: {data['mode']}",
        "",
        "| child | state | tools | direct bytes | direct tokens | suite tool bytes "
        "| suite tool tokens | wrapper chars |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in data["children"]:
        wrapper = "-" if row["wrapper_chars"] is None else row["wrapper_chars"]
        lines.append(
            f"| {row['name']} | {row['state']} | {row['tools']} | {row['direct_bytes']} | "
            f"{row['direct_tokens']} | {row['suite_bytes']} | {row['suite_tokens']} | "
            f"{wrapper} |"
        )
    lines += [
        "",
        "| what the host loads | tools | bytes | tokens | of direct |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in _LISTING_LABELS.items():
        listing = data["listings"][key]
        share = listing["percent_of_direct"]
        lines.append(
            f"| {label} | {listing['tools']} | {listing['bytes']} | {listing['tokens']} | "
            f"{'-' if share is None else f'{share:g}%'} |"
        )
    lines += [
        "",
        "direct: one tools/list per server, summed; a gateway mode: its one tools/list at "
        "start (activate grows by a server's tools when it is activated; search stays at its "
        f"{len(control_tools('search'))} tools).",
    ]
    if any(row["wrapper_chars"] is not None for row in data["children"]):
        lines.append(
            "wrapper chars: what each natural_language call's Claude session loads (the "
            "wrapper's instructions and the child's tools), paid by that session, not the host."
        )
    return "\n".join(lines)
