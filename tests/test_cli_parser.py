"""The `butlers` command line as argparse builds it (no process: the parser alone)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from butlers.cli.parser import build_parser
from butlers.settings import Settings


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command and sub-command, with the words that reach it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_command_takes_the_log_options_after_its_name() -> None:
    """docs/cli.md: every command takes --log-level and --log-format before or after its
    name; `butlers gateway install --log-level DEBUG` was refused ("unrecognized
    arguments")."""
    parser = build_parser(Settings.from_environ({}))
    commands = dict(_commands(parser))
    assert ("gateway", "install") in commands and ("db", "upgrade") in commands
    lacking = [
        " ".join(words)
        for words, command in commands.items()
        if not {"--log-level", "--log-format"}
        <= {o for a in command._actions for o in a.option_strings}
    ]
    assert lacking == []
    args = parser.parse_args(["gateway", "install", "--log-level", "debug"])
    assert (args.action, args.log_level) == ("install", "DEBUG")


def test_gateway_report_and_dry_run_exclude_each_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser(Settings.from_environ({}))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["gateway", "--report", "--dry-run"])
    assert exited.value.code == 2
    assert "argument --dry-run: not allowed with argument --report" in capsys.readouterr().err
