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


@pytest.mark.parametrize(
    "argv",
    [
        ["memory", "general", "--json", "forget", "2"],
        ["memory", "--json", "general", "forget", "2"],
        ["memory", "general", "forget", "2", "--json"],
    ],
)
def test_a_commands_options_go_between_its_words_too(argv: list[str]) -> None:
    """docs/cli.md: options before or after the command's words; `butlers memory general
    --json forget 2` was refused ("unrecognized arguments: forget 2")."""
    args = build_parser(Settings.from_environ({})).parse_args(argv)
    assert (args.butler, args.action, args.id, args.json) == ("general", "forget", 2, True)


def test_intermixed_words_keep_their_checks(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(Settings.from_environ({}))
    args = parser.parse_args(["approvals", "--json", "approve", "3"])
    assert (args.action, args.id, args.json) == ("approve", 3, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["memory", "general", "--json", "fogret", "2"])
    assert "invalid choice: 'fogret'" in capsys.readouterr().err


def test_a_value_that_looks_like_an_option_is_shown_its_way_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`butlers memory general --search -car`: argparse said only "expected one argument"."""
    parser = build_parser(Settings.from_environ({}))
    with pytest.raises(SystemExit):
        parser.parse_args(["memory", "general", "--search", "-car"])
    assert "given as --search=VALUE" in capsys.readouterr().err
    assert parser.parse_args(["memory", "general", "--search=-car"]).search == "-car"
