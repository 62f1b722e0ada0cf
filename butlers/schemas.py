"""The JSON Schemas of the config files and the key tables of docs/configuration.md, both
generated from the config models: `python -m butlers.schemas` in the source checkout.

The models are the one description of every file (types, bounds, defaults, `description=`),
so an editor's schema and the documentation cannot drift from what the loaders accept; a test
fails when a committed file differs from what this writes. `--check` only compares (for CI),
`--root DIR` writes under another checkout.

The documentation's tables live between `<!-- BEGIN GENERATED: <id> -->` and
`<!-- END GENERATED: <id> -->` lines; everything else in docs/configuration.md is written by
hand and left alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticUndefined

from butlers.config import (
    ApprovalsConfig,
    ButlerFile,
    ButlerTable,
    DbTable,
    EmailConfig,
    McpServerConfig,
    OwnerConfig,
    PairingConfig,
    RuntimeConfig,
    ScheduleConfig,
    SwitchboardConfig,
    TelegramConfig,
    TranscriptionConfig,
    TriageRule,
)
from butlers.config_errors import expectation
from butlers.gateway.config import (
    SCHEMA_KEY,
    Expose,
    GatewayConfig,
    Introspection,
    McpCommand,
    McpJson,
    SuiteConfig,
    Timeouts,
    Wrapper,
)
from butlers.modules.mail_webhook import WebhookMail

SCHEMAS_DIR = "schemas"
DOC = "docs/configuration.md"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
REGENERATE = "python -m butlers.schemas"


@dataclass(frozen=True)
class Schema:
    """One generated schema file: which model, in which spelling."""

    file: str
    model: type
    title: str
    by_alias: bool = False
    editor_key: bool = False  # the file may name its schema with a top-level "$schema"


SCHEMAS = (
    Schema("butler.schema.json", ButlerFile, "A butler's butler.toml"),
    Schema("gateway.schema.json", GatewayConfig, "The gateway's gateway.toml", editor_key=True),
    Schema(
        "switchboard.config.schema.json",
        GatewayConfig,
        "The gateway's switchboard.config.json (the TypeScript Switchboard's spelling)",
        by_alias=True,
        editor_key=True,
    ),
    Schema("mcp.schema.json", McpJson, "A gateway child's .mcp.json", True, editor_key=True),
    Schema(
        "email-webhook.schema.json",
        WebhookMail,
        "The JSON body of POST /email/inbound",
        by_alias=True,
    ),
)


@dataclass(frozen=True)
class Table:
    """One table of the documentation: a model's keys under the heading a file gives them."""

    heading: str
    model: type
    by_alias: bool = False
    json: bool = False


# Every table of every file, in the order the documentation gives them.
DOC_TABLES: dict[str, tuple[Table, ...]] = {
    "butler.toml": (
        Table("[butler]", ButlerTable),
        Table("[butler.db]", DbTable),
        Table("[runtime]", RuntimeConfig),
        Table("[approvals]", ApprovalsConfig),
        Table("[modules.telegram]", TelegramConfig),
        Table("[modules.email]", EmailConfig),
        Table("[switchboard]", SwitchboardConfig),
        Table("[switchboard.owner]", OwnerConfig),
        Table("[switchboard.pairing]", PairingConfig),
        Table("[switchboard.transcription]", TranscriptionConfig),
        Table("[[switchboard.triage]]", TriageRule),
        Table("[[mcp_servers]]", McpServerConfig),
        Table("[[schedules]]", ScheduleConfig),
    ),
    "gateway.toml": (
        Table("top level", GatewayConfig),
        Table("[suites.<child>]", SuiteConfig),
        Table("[suites.<child>.expose]", Expose),
        Table("[timeouts]", Timeouts),
        Table("[introspection]", Introspection),
        Table("[wrapper]", Wrapper),
    ),
    ".mcp.json": (
        Table("top level", McpJson, by_alias=True, json=True),
        Table('"command"', McpCommand, by_alias=True, json=True),
    ),
    "email webhook": (Table("the body", WebhookMail, by_alias=True, json=True),),
}


class _Generator(GenerateJsonSchema):
    """pydantic's schema without a title on every key (the key is its own title)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def schema_of(schema: Schema) -> dict[str, Any]:
    generated = TypeAdapter(schema.model).json_schema(
        by_alias=schema.by_alias, schema_generator=_Generator
    )
    document: dict[str, Any] = {
        "$schema": DRAFT,
        "$id": f"https://butlers.local/schemas/{schema.file}",
    }
    document |= generated
    document["title"] = schema.title
    document["description"] = (
        f"Generated from butlers' {schema.model.__name__} ({REGENERATE}); "
        "docs/configuration.md explains every key."
    )
    if schema.editor_key:
        key = {"type": "string", "description": "This file's JSON Schema, for editors."}
        document["properties"] = {SCHEMA_KEY: key} | document["properties"]
    return document


def render_schema(schema: Schema) -> str:
    return json.dumps(schema_of(schema), indent=2, ensure_ascii=False) + "\n"


def fields_of(model: type) -> dict[str, FieldInfo]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return dict(model.model_fields)
    assert is_pydantic_dataclass(model), model
    return dict(model.__pydantic_fields__)


def documented_fields(table: Table) -> Iterator[tuple[str, FieldInfo]]:
    """The keys a table's rows show: its own values, not the tables nested in it (those have
    a table of their own)."""
    for name, field in fields_of(table.model).items():
        if _is_table(field):
            continue
        yield ((field.alias or name) if table.by_alias else name), field


def _is_table(field: FieldInfo) -> bool:
    """A key whose value is one nested table ([butler.db], [timeouts]...), not a mapping."""
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or hasattr(annotation, "__pydantic_fields__")
    )


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, tuple):
        value = list(value)
    text = json.dumps(value, ensure_ascii=False)
    return f"`{text}`"


def render_table(table: Table) -> str:
    heading = table.heading if table.heading[0].isalpha() else f"`{table.heading}`"
    lines = [
        f"### {heading[0].upper()}{heading[1:]}",
        "",
        _prose(table.model.__doc__),
        "",
        "| key | expects | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for key, field in documented_fields(table):
        cells = (
            f"`{key}`",
            expectation(field, json=table.json),
            default_text(field),
            field.description or "",
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def render_section(section: str) -> str:
    return "\n\n".join(render_table(table) for table in DOC_TABLES[section])


def _prose(doc: str | None) -> str:
    """A model's docstring without the table name it starts with (the heading says it)."""
    text = re.sub(r"^`[^`]+`[.:]?\s*", "", " ".join((doc or "").split()))
    return text[:1].upper() + text[1:]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("\n", " ")


_REGION = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<id>[^>]+?) -->\n)(?:.*?\n)?(<!-- END GENERATED: (?P=id) -->)",
    re.DOTALL,
)


def render_doc(current: str) -> str:
    """docs/configuration.md with every generated region rewritten; ValueError naming a
    section that has no region (the hand-written text must say where it goes)."""
    seen: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        section = match.group("id")
        if section not in DOC_TABLES:
            raise ValueError(f"{DOC}: no generated section is called {section!r}")
        seen.add(section)
        return match.group(1) + render_section(section) + "\n" + match.group(3)

    rendered = _REGION.sub(fill, current)
    missing = [s for s in DOC_TABLES if s not in seen]
    if missing:
        raise ValueError(
            f"{DOC} has no region for {', '.join(missing)}: add "
            + ", ".join(
                f"<!-- BEGIN GENERATED: {s} --> ... <!-- END GENERATED: {s} -->" for s in missing
            )
        )
    return rendered


def outputs(root: Path) -> dict[Path, Callable[[], str]]:
    """Every generated file under `root`, with what it should hold."""
    files: dict[Path, Callable[[], str]] = {
        root / SCHEMAS_DIR / s.file: functools.partial(render_schema, s) for s in SCHEMAS
    }
    doc = root / DOC
    files[doc] = lambda: render_doc(doc.read_text(encoding="utf-8"))
    return files


def stale(root: Path) -> list[Path]:
    """The generated files under `root` that differ from what the models say."""
    return [
        path
        for path, render in outputs(root).items()
        if not path.is_file() or path.read_text(encoding="utf-8") != render()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m butlers.schemas", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--root", type=Path, default=Path("."), help="the checkout (default .)")
    parser.add_argument(
        "--check", action="store_true", help="only say which files are stale (exit 1 if any)"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            old = stale(args.root)
            for path in old:
                print(f"stale: {path} (run `{REGENERATE}`)", file=sys.stderr)
            return 1 if old else 0
        for path, render in outputs(args.root).items():
            text = render()
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
                print(f"wrote {path}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
