"""The environment is read in one place (butlers.settings), typed and checked when a process
starts; secrets never show; every variable is documented."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

from butlers.errors import ButlersError
from butlers.settings import DEFAULT_JAEGER_UI_URL, Settings, reveal

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "butlers"
BUTLERS = str(Path(sys.executable).parent / "butlers")

# The one module that reads the process's environment; and a program of its own whose job is
# to filter its own environment before it execs (the Claude wrapper's stdio launcher).
READS_THE_ENVIRONMENT = {"butlers/settings.py", "butlers/allowlisted_exec.py"}
# Reads that wait for another part of issue 14 to pass Settings down. The test fails when one
# of them is gone, so this list can only shrink.
PENDING: dict[str, str] = {}
_OS_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_readers(root: Path) -> dict[str, list[int]]:
    """Each module under `root` that touches the process environment -> the lines that do:
    `os.environ`, `os.getenv(...)`, `from os import environ` and the like."""
    found: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        lines = []
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in _OS_NAMES
            ):
                lines.append(node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                if any(alias.name in _OS_NAMES for alias in node.names):
                    lines.append(node.lineno)
        if lines:
            found[path.relative_to(root.parent).as_posix()] = sorted(lines)
    return found


def test_no_module_reads_the_environment_on_its_own() -> None:
    readers = environment_readers(PACKAGE)
    assert set(readers) >= READS_THE_ENVIRONMENT  # the scan does see what it looks for
    others = {path: lines for path, lines in readers.items() if path not in READS_THE_ENVIRONMENT}
    assert set(others) == set(PENDING), (
        f"read the environment only in butlers/settings.py, and pass Settings down: {others}"
    )


def test_the_scan_finds_every_form_of_reading(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("import os\nTOKEN = os.environ.get('X')\n")
    (package / "b.py").write_text("import os\n\n\ndef f():\n    return os.getenv('X')\n")
    (package / "c.py").write_text("from os import environ\n")
    (package / "d.py").write_text("import os\nPATH = os.path.join('a', 'b')\n")
    assert environment_readers(package) == {"pkg/a.py": [2], "pkg/b.py": [5], "pkg/c.py": [1]}


def test_fields_defaults_and_lookups_by_name() -> None:
    settings = Settings.from_environ(
        {
            "BUTLERS_AUTH_TOKEN": "tok-0123456789",
            "BUTLERS_DATA_DIR": "/srv/butlers",
            "BUTLERS_LOG_LEVEL": "info",
            "BUTLERS_SWITCHBOARD_URL": "http://switchboard:8100/sse",
            "BUTLERS_HOST": "",  # empty is unset, as it always was
            "DATABASE_URL": "postgresql://u:pw@db/x",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "TELEGRAM_BOT_TOKEN": "123:abc",
            "EMPTY": "",
        }
    )
    assert reveal(settings.auth_token) == "tok-0123456789"
    assert settings.data_dir == Path("/srv/butlers")
    assert settings.log_level == "INFO"
    assert settings.switchboard_url == "http://switchboard:8100/sse"
    assert settings.host is None
    assert reveal(settings.database_url) == "postgresql://u:pw@db/x"
    assert settings.otel_exporter_otlp_protocol == "http/protobuf"
    # What a butler.toml names is looked up by name; unset and empty are both None.
    assert settings.variable("TELEGRAM_BOT_TOKEN") == "123:abc"
    assert settings.variable("EMPTY") is None and settings.variable("NOWHERE") is None
    assert settings.environ["BUTLERS_DATA_DIR"] == "/srv/butlers"
    with pytest.raises(TypeError):
        settings.environ["X"] = "y"  # type: ignore[index]

    defaults = Settings.from_environ({})
    assert (defaults.auth_token, defaults.database_url, defaults.switchboard_url) == (None,) * 3
    assert defaults.data_dir == Path(".butlers") and defaults.log_level == "WARNING"
    assert defaults.log_format == "text" and defaults.jaeger_ui_url == DEFAULT_JAEGER_UI_URL
    assert defaults.otel_exporter_otlp_protocol == "http/protobuf"


def test_settings_read_the_process_environment_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BUTLERS_DATA_DIR", "/first")
    first = Settings.from_environ()
    monkeypatch.setenv("BUTLERS_DATA_DIR", "/second")
    monkeypatch.setenv("MY_BOT_TOKEN", "bot-secret")
    assert first.data_dir == Path("/first") and first.variable("MY_BOT_TOKEN") is None
    second = Settings.from_environ()
    assert second.data_dir == Path("/second") and second.variable("MY_BOT_TOKEN") == "bot-secret"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("BUTLERS_LOG_LEVEL", "loud", "expected one of CRITICAL, ERROR, WARNING, INFO, DEBUG"),
        ("BUTLERS_LOG_FORMAT", "xml", "expected 'text' or 'json'"),
        ("BUTLERS_SWITCHBOARD_URL", "switchboard:8100", "expected an http(s) URL"),
        ("JAEGER_UI_URL", "jaeger.lan", "expected an http(s) URL"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon", "expected 'grpc', 'http/protobuf'"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(name: str, value: str, expected: str) -> None:
    with pytest.raises(ButlersError) as caught:
        Settings.from_environ({name: value, "BUTLERS_AUTH_TOKEN": "tok-0123456789"})
    message = str(caught.value)
    assert message.startswith(f"environment variable {name}={value!r}: {expected}"), message
    assert "\n" not in message and "tok-0123456789" not in message


def test_secrets_never_show() -> None:
    secrets = {
        "BUTLERS_AUTH_TOKEN": "auth-tok-0123456789",
        "BUTLERS_EMAIL_WEBHOOK_TOKEN": "hook-tok-0123456789",
        "DATABASE_URL": "postgresql://u:db-pw-0123456789@db/x",
        "TELEGRAM_BOT_TOKEN": "bot-tok-0123456789",
    }
    settings = Settings.from_environ({**secrets, "BUTLERS_LOG_LEVEL": "debug"})
    shown = [
        repr(settings),
        str(settings),
        f"{settings}",
        settings.model_dump_json(),
        repr(settings.model_dump()),
    ]
    for text in shown:
        for value in secrets.values():
            assert value not in text
        assert "db-pw" not in text
    assert "**********" in repr(settings) and "DEBUG" in repr(settings)


async def test_the_command_line_reports_a_bad_variable_once_without_a_traceback() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    env |= {"BUTLERS_LOG_LEVEL": "loud", "BUTLERS_AUTH_TOKEN": "tok-0123456789"}
    process = await asyncio.create_subprocess_exec(
        BUTLERS,
        "list",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        stdout, stderr = await process.communicate()
    assert process.returncode == 1
    assert stdout == b""
    assert stderr.decode().splitlines() == [
        "error: environment variable BUTLERS_LOG_LEVEL='loud': "
        "expected one of CRITICAL, ERROR, WARNING, INFO, DEBUG"
    ]


def test_every_variable_is_documented() -> None:
    """docs/configuration.md has a row per variable, with its default, under its heading."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if match := re.match(r"\| `([A-Z_]+)` \| ([^|]*) \|", line):
            rows[match.group(1)] = match.group(2).strip()
    for name, field in Settings.variables().items():
        assert name in rows, f"{name} is not documented in docs/configuration.md"
        default = Settings.model_fields[field].default
        shown = "unset" if default is None else f"`{default}`"
        assert rows[name] == shown, f"{name}: documented default {rows[name]}, is {shown}"
