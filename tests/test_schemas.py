"""The files generated from the config models (schemas/*.json and the key tables of
docs/configuration.md) are what the models say; the documentation covers every table of every
file; the butler schema accepts the shipped butlers and refuses what the loader refuses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import jsonschema
import pytest

from butlers.config import ButlerFile, load_butler_config
from butlers.errors import ConfigError
from butlers.gateway.config import GatewayConfig, McpJson
from butlers.modules.mail_webhook import WebhookMail
from butlers.schemas import DOC, DOC_TABLES, REGENERATE, SCHEMAS, documented_fields, stale
from butlers.schemas import main as generate

REPO = Path(__file__).resolve().parent.parent
ROOTS = (ButlerFile, GatewayConfig, McpJson, WebhookMail)


def test_committed_schemas_and_docs_are_what_the_models_generate() -> None:
    out_of_date = [str(path.relative_to(REPO)) for path in stale(REPO)]
    assert out_of_date == [], f"{', '.join(out_of_date)} out of date: run `{REGENERATE}`"


def test_the_generator_writes_them_and_check_names_what_is_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / DOC, tmp_path / DOC)
    (tmp_path / DOC).write_text((REPO / DOC).read_text().replace("| `port` |", "| `prot` |"))

    # The command a contributor runs, once; then its main() in this process (1.3 s a run).
    command = [sys.executable, "-m", "butlers.schemas", "--root", str(tmp_path), "--check"]
    check = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert check.returncode == 1
    assert f"stale: {tmp_path / DOC} (run `{REGENERATE}`)" in check.stderr
    assert f"stale: {tmp_path / 'schemas' / 'butler.schema.json'}" in check.stderr
    assert generate(["--root", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / DOC}" in capsys.readouterr().out
    assert (tmp_path / DOC).read_text() == (REPO / DOC).read_text()
    for schema in SCHEMAS:
        written = (tmp_path / "schemas" / schema.file).read_text()
        assert written == (REPO / "schemas" / schema.file).read_text(), schema.file
    assert generate(["--root", str(tmp_path), "--check"]) == 0
    assert "stale" not in capsys.readouterr().err


def _tables(model: type) -> typing.Iterator[type]:
    """`model` and every model nested in it, at any depth."""
    yield model
    fields = getattr(model, "model_fields", None) or model.__pydantic_fields__
    for field in fields.values():
        for inner in _types_in(field.annotation):
            if hasattr(inner, "__pydantic_fields__") or hasattr(inner, "model_fields"):
                yield from _tables(inner)


def _types_in(annotation: object) -> typing.Iterator[object]:
    yield annotation
    for arg in typing.get_args(annotation):
        yield from _types_in(arg)


def test_every_table_of_every_file_has_its_keys_documented() -> None:
    documented = {table.model: table for tables in DOC_TABLES.values() for table in tables}
    for root in ROOTS:
        for model in _tables(root):
            if model is ButlerFile or model.__name__ == "ModulesTable":
                continue  # tables of tables: their tables are the ones documented
            assert model in documented, f"{model.__name__} ({root.__name__}) is not in DOC_TABLES"
    doc = (REPO / DOC).read_text()
    for table in documented.values():
        for key, field in documented_fields(table):
            assert f"| `{key}` |" in doc, (table.heading, key)
            assert field.description, f"{table.model.__name__}.{key} has no description"


@pytest.fixture(scope="module")
def butler_schema() -> dict:
    return json.loads((REPO / "schemas" / "butler.schema.json").read_text())


def test_the_shipped_butlers_match_the_butler_schema(butler_schema: dict) -> None:
    shipped = sorted((REPO / "config" / "butlers").glob("*/butler.toml"))
    assert len(shipped) == 4
    for path in shipped:
        jsonschema.validate(tomllib.loads(path.read_text()), butler_schema)


@pytest.mark.parametrize(
    "text",
    [
        '[butler]\nname = "x"\nport = "80"\n',
        '[butler]\nname = "x"\nport = 70000\n',
        '[butler]\nname = "x"\nport = 1\ncolour = "red"\n',
        '[butler]\nname = "x"\nport = 1\n[runtime]\nmax_turns = 0\n',
        '[butler]\nname = "x"\nport = 1\n[modules.telegram]\nmode = "push"\n',
        '[butler]\nname = "x"\nport = 1\n[modules.fax]\n',
        '[butler]\nname = "x"\nport = 1\n[[switchboard.triage]]\nchannel = "sms"\nbutler = "g"\n',
        '[butler]\nname = "x"\nport = 1\n[switchboard]\nmax_routes_per_message = 0\n',
        "[butler]\nport = 1\n",
    ],
)
def test_the_butler_schema_refuses_what_the_loader_refuses(
    tmp_path: Path, butler_schema: dict, text: str
) -> None:
    directory = tmp_path / "x"
    directory.mkdir()
    (directory / "butler.toml").write_text(text)
    with pytest.raises(ConfigError):
        load_butler_config(directory / "butler.toml")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(tomllib.loads(text), butler_schema)


def test_the_webhook_and_mcp_json_schemas_take_the_files_spelling() -> None:
    webhook = json.loads((REPO / "schemas" / "email-webhook.schema.json").read_text())
    jsonschema.validate({"from": "a@example.com", "text": "hi", "message_id": "<m@x>"}, webhook)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"text": "hi"}, webhook)  # no from
    mcp = json.loads((REPO / "schemas" / "mcp.schema.json").read_text())
    jsonschema.validate({"name": "docs", "switchboardDescription": "d", "url": "http://x"}, mcp)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "docs", "switchboard_description": "d"}, mcp)
