"""The `butlers` command's arguments: every subcommand, its options, and the function that
runs it (`set_defaults(run=...)`: butlers.cli.main calls `args.run(args, settings, redactor)`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from butlers import logs
from butlers.build import build_label
from butlers.cli.client import DEFAULT_SWITCHBOARD_URL, client_command
from butlers.cli.fleet import DEFAULT_CONFIG_DIR, run_butler, run_db_upgrade, run_up
from butlers.cli.gateway import gateway_command

if TYPE_CHECKING:
    from butlers.settings import Settings


class _CommandParser(argparse.ArgumentParser):
    """A command's parser that takes its options between its optional words too:
    `butlers memory general --json forget 2` (argparse alone fills `action` and `id` with
    nothing at `general` and then refuses "forget 2"). argparse's intermixed parsing, for a
    command without sub-commands of its own (it cannot take those)."""

    _intermixing = False

    def error(self, message: str) -> NoReturn:
        # `--search -car`: argparse takes "-car" for an option and says only "expected one
        # argument"; the way to give such a value is the option's `=` form.
        wanted = re.fullmatch(r"argument (--[\w-]+)(?:/[\w-]+)*: expected one argument", message)
        if wanted is not None:
            option = wanted.group(1)
            message += f" (a value that starts with '-' is given as {option}=VALUE)"
        super().error(message)

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        optional_words = any(
            not action.option_strings and action.nargs in ("?", "*") for action in self._actions
        )
        nested = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if self._intermixing or nested or not optional_words:
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # intermixed parsing calls this again, for each half
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="butlers",
        description="Run and talk to a personal team of AI butlers.",
        epilog="Environment: DATABASE_URL (else embedded PostgreSQL under $BUTLERS_DATA_DIR), "
        "BUTLERS_DATA_DIR (default .butlers), BUTLERS_AUTH_TOKEN, OTEL_EXPORTER_OTLP_ENDPOINT.",
    )
    parser.add_argument("--version", action="version", version=f"butlers {build_label()}")
    log_options(
        parser,
        level=settings.log_level,
        log_format=settings.log_format,
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    def config_dir_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config-dir",
            type=Path,
            default=DEFAULT_CONFIG_DIR,
            help=f"butler config directory (default {DEFAULT_CONFIG_DIR})",
        )

    from butlers import doctor, init_command

    init_parser = commands.add_parser(
        "init",
        help="write a new config directory (switchboard, general, .env template)",
        description="Write a new, working config directory; asks its questions unless "
        "--non-interactive. Refuses a directory that already holds a config.",
    )
    init_command.add_arguments(init_parser)
    init_parser.set_defaults(run=_init)
    doctor_parser = commands.add_parser(
        "doctor",
        help="check the configs, secrets, ports, database, Claude Code and exposure",
        description="One line per check (ok, warn, fail) with what to do; exit 0 only when "
        "nothing fails. --online also asks Telegram, the mail servers and the Messages API.",
    )
    config_dir_arg(doctor_parser)
    doctor.add_arguments(doctor_parser)
    doctor_parser.set_defaults(run=_doctor)

    up = commands.add_parser("up", help="start PostgreSQL and every butler in one process")
    config_dir_arg(up)
    up.set_defaults(run=run_up)
    up.add_argument("--only", nargs="+", metavar="NAME", help="start only these butlers")
    up.add_argument("--json", action="store_true", help="print the ready table as one JSON object")
    up.add_argument(
        "--port-offset",
        type=int,
        default=0,
        metavar="K",
        help="every butler listens on its port + K: a second fleet beside the first, on the "
        "same databases (the switchboard runs as a replica)",
    )

    run = commands.add_parser("run", help="run one butler in the foreground")
    config_dir_arg(run)
    run.set_defaults(run=run_butler)
    run.add_argument("name")
    run.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="listen on P instead of the butler.toml's port (a switchboard replica)",
    )

    db = commands.add_parser("db", help="database commands")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="create and migrate butler databases")
    config_dir_arg(upgrade)
    upgrade.set_defaults(run=run_db_upgrade)
    upgrade.add_argument("names", nargs="*", metavar="NAME")

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--url",
            default=settings.switchboard_url or DEFAULT_SWITCHBOARD_URL,
            help="the switchboard's MCP endpoint (default %(default)s, "
            "env BUTLERS_SWITCHBOARD_URL)",
        )
        p.add_argument("--json", action="store_true", help="print JSON, for scripts")
        p.set_defaults(run=client_command)

    client_args(commands.add_parser("list", help="list the registered butlers"))
    client_args(commands.add_parser("discover", help="re-scan the config directory"))
    route = commands.add_parser("route", help="call a tool on a butler through the switchboard")
    client_args(route)
    route.add_argument("butler")
    route.add_argument("tool")
    route.add_argument("args", nargs="?", default="{}", help="tool arguments as a JSON object")
    ask = commands.add_parser(
        "ask", help="send a message through classify -> route -> reply and print the reply"
    )
    client_args(ask)
    ask.add_argument("text")
    gateway = commands.add_parser(
        "gateway",
        help="serve every butler and .mcp.json server to a host as one MCP server",
        description="One MCP server for a host such as Claude Code: a suite tool per butler "
        "(from the switchboard's registry) and per .mcp.json server, plus gateway_activate / "
        "gateway_deactivate / gateway_status. Reads gateway.toml (or switchboard.config.json) "
        "from --dir.",
    )
    gateway.set_defaults(run=gateway_command)
    gateway.add_argument(
        "--transport",
        choices=("stdio", "sse", "http"),
        default="stdio",
        help="stdio for a host that starts it (default), or sse / http to listen",
    )
    gateway.add_argument("--host", default="127.0.0.1", help="for sse/http (default 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=8110, help="for sse/http (default 8110)")
    gateway.add_argument(
        "--dir",
        type=Path,
        default=Path("."),
        help="where gateway.toml and the .mcp.json globs are (default .)",
    )
    gateway.add_argument(
        "--url",
        help="the switchboard whose registry lists the butlers (default "
        "BUTLERS_SWITCHBOARD_URL, from --env-file or the environment, else "
        "http://127.0.0.1:8100/sse)",
    )
    env_file_help = (
        "read BUTLERS_AUTH_TOKEN and BUTLERS_SWITCHBOARD_URL from FILE (the fleet's .env, "
        "readable by you alone) rather than from the environment: the host that starts the "
        "gateway, and its model's shell, never hold the fleet's token"
    )
    gateway.add_argument("--env-file", type=Path, metavar="FILE", help=env_file_help)
    gateway.add_argument("--no-butlers", action="store_true", help="only the .mcp.json servers")
    gateway.add_argument(
        "--lazy", action="store_true", help="start children on first use, not all at start"
    )
    # What it does instead of serving: one or the other.
    instead = gateway.add_mutually_exclusive_group()
    instead.add_argument(
        "--report",
        action="store_true",
        help="print what a host loads (bytes, tokens): every server directly vs the gateway's "
        "suite, activate and search modes",
    )
    gateway.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="MCP servers from a claude_desktop_config.json, an mcpflip servers.json, Gemini "
        "CLI's settings.json or Codex's config.toml too (.mcp.json at --dir is read anyway)",
    )
    gateway.add_argument(
        "--mode",
        choices=("suite", "activate", "both", "search"),
        help="suite tools, only gateway_* until activation, both, or search (gateway_search, "
        "gateway_describe, gateway_call) (default: gateway.toml's mode, else suite)",
    )
    instead.add_argument(
        "--dry-run",
        action="store_true",
        help="start every child, list its state and subtools, and exit (1 if one is in error "
        "or a declared server was left out)",
    )
    gateway.add_argument(
        "--json", action="store_true", help="--report / --dry-run as JSON, for scripts"
    )
    actions = gateway.add_subparsers(dest="action", metavar="{install,uninstall,approve}")
    for action, text in (
        ("install", "put the gateway in front of a host's MCP servers, with a backup"),
        ("uninstall", "put the host's original config back, byte for byte"),
    ):
        step = actions.add_parser(action, help=text, description=text)
        # --dir and --config are the gateway's own options too: `gateway --dir D install`
        # must mean `gateway install --dir D`. argparse copies every attribute of a
        # sub-parser's namespace over the parent's, defaults included, so a default here
        # would replace the D given before `install`: without one (SUPPRESS), the value
        # given after `install` wins, else the one given before, else the gateway's default.
        step.add_argument(
            "--dir",
            type=Path,
            default=argparse.SUPPRESS,
            help="the project (the gateway's --dir; default .)",
        )
        step.add_argument(
            "--env-file",
            type=Path,
            metavar="FILE",
            default=argparse.SUPPRESS,
            help="install: the command the host runs reads the fleet's token from FILE ("
            + env_file_help.split("(", 1)[1],
        )
        step.add_argument(
            "--scope",
            choices=("project", "user"),
            default="project",
            help="project: rewrite DIR/.mcp.json; user: `claude mcp add -s user`",
        )
        step.add_argument(
            "--host",
            dest="target_host",
            choices=("claude-code", "claude-desktop", "cursor", "vscode"),
            default="claude-code",
            help="whose config (default claude-code): DIR/.mcp.json, claude_desktop_config.json, "
            "DIR/.cursor/mcp.json or DIR/.vscode/mcp.json",
        )
        step.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            default=argparse.SUPPRESS,
            help="the host's file, if not where it keeps it",
        )
    text = (
        "let in servers (and gateway.toml) added or changed since their approval, held "
        "pending: records their current declarations; the running gateway starts them"
    )
    approve = actions.add_parser("approve", help=text, description=text)
    approve.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="the servers to approve (default: every declared server, and gateway.toml)",
    )
    approve.add_argument(
        "--settings",
        action="store_true",
        help="approve gateway.toml (or switchboard.config.json) alone, no server",
    )
    approve.add_argument(
        "--show",
        action="store_true",
        help="only show what would be approved (and gateway.toml's changes); record nothing",
    )
    approve.add_argument(
        "--dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="the gateway's --dir (default .)",
    )
    approve.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="the gateway's --config, if it was started with one",
    )
    trace = commands.add_parser(
        "trace",
        # (the default is butlers.switchboard.operator's, not imported for a --help)
        help="print the Jaeger URL of a message's trace (JAEGER_UI_URL, "
        "default http://localhost:16686)",
    )
    client_args(trace)
    trace.add_argument(
        "ref",
        metavar="ID",
        help="a trace id, an inbox message's number (butlers inbox), or a routing_log id",
    )

    def limit_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--limit", type=int, default=20, help="at most this many, 1..500 (20)")

    def before_arg(p: argparse.ArgumentParser, which: str, id_type: type = int) -> None:
        """--before ID: the page after a full one (its last line names the ID)."""
        p.add_argument("--before", type=id_type, metavar="ID", help=f"only {which} (a page)")

    inbox = commands.add_parser(
        "inbox", help="the newest messages and what became of them (times are local)"
    )
    client_args(inbox)
    inbox.add_argument("--status", help="only queued|processing|done|failed|skipped ones")
    limit_arg(inbox)
    before_arg(inbox, "messages older than message ID")
    log = commands.add_parser("log", help="the newest routing_log rows, with their Jaeger links")
    client_args(log)
    log.add_argument("--butler", metavar="NAME", help="only the routes to this butler")
    limit_arg(log)
    before_arg(log, "routes logged before route ID", str)
    retry = commands.add_parser(
        "retry", help="queue a failed (or skipped) message again: it is routed and answered anew"
    )
    client_args(retry)
    retry.add_argument("id", metavar="ID", type=int, help="the message's inbox id")
    outbox = commands.add_parser(
        "outbox", help="replies and notifications not sent yet, and those that failed"
    )
    client_args(outbox)
    outbox.add_argument("--status", help="only pending|sending|sent|failed ones")
    limit_arg(outbox)
    before_arg(outbox, "rows older than outbox row ID")
    outbox.add_argument(
        "action", nargs="?", choices=("retry",), help="send a failed one again (`retry ID`)"
    )
    outbox.add_argument("id", nargs="?", type=int, metavar="ID", help="the outbox row's id")
    approvals = commands.add_parser(
        "approvals",
        help="calls waiting for the owner's yes, and what became of them; "
        "`approvals approve|deny ID` decides one",
    )
    client_args(approvals)
    approvals.add_argument(
        "action", nargs="?", choices=("approve", "deny"), help="decide approval ID"
    )
    approvals.add_argument("id", nargs="?", type=int, metavar="ID", help="the approval's id")
    approvals.add_argument("--status", help="only pending|approved|denied|expired|done|failed ones")
    limit_arg(approvals)
    before_arg(approvals, "approvals older than approval ID")
    pairing = commands.add_parser(
        "pairing",
        help="strangers' pending codes and paired senders; `pairing approve|deny CODE` "
        "decides one, `pairing revoke CHANNEL SENDER` unpairs",
    )
    client_args(pairing)
    pairing.add_argument(
        "action", nargs="?", choices=("approve", "deny", "revoke"), help="what to do"
    )
    pairing.add_argument(
        "values", nargs="*", metavar="VALUE", help="CODE, or CHANNEL SENDER for revoke"
    )
    schedules = commands.add_parser(
        "schedules",
        help="every butler's schedules, next and last run in its local time; "
        "`schedules delete BUTLER NAME` deletes one",
    )
    client_args(schedules)
    schedules.add_argument("--butler", metavar="NAME", help="only this butler's")
    schedules.add_argument("action", nargs="?", choices=("delete",), help="delete one")
    schedules.add_argument("owner", nargs="?", metavar="BUTLER", help="whose schedule")
    schedules.add_argument("name", nargs="?", metavar="NAME", help="the schedule's name")
    memory = commands.add_parser(
        "memory",
        help="a butler's long-term memory: the newest, `--search Q`, or `memory BUTLER forget ID`",
    )
    client_args(memory)
    memory.add_argument("butler", metavar="BUTLER", help="whose memory")
    memory.add_argument("action", nargs="?", choices=("forget",), help="forget memory ID")
    memory.add_argument("id", nargs="?", type=int, metavar="ID", help="the memory's id")
    memory.add_argument("--search", metavar="Q", help="memories matching Q, best first")
    memory.add_argument(
        "--limit", type=int, default=20, help="at most this many, 1..500 (with --search 1..100)"
    )
    before_arg(memory, "memories older than memory ID (not with --search)")
    # On every command too (`butlers list --log-level debug`), where they override the
    # defaults above only when given.
    for command in [
        *commands.choices.values(),
        *db_commands.choices.values(),
        *actions.choices.values(),
    ]:
        log_options(command, level=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
    return parser


def log_options(parser: argparse.ArgumentParser, *, level: str, log_format: str) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=logs.LEVELS,
        default=level,
        help="what to log, from DEBUG up (default WARNING, env BUTLERS_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=log_format,
        help="text lines, or one JSON object per line (default text, env BUTLERS_LOG_FORMAT)",
    )


async def _init(args: argparse.Namespace, settings: Settings, _redactor: object) -> int:
    from butlers import init_command

    return await init_command.run(args, settings)


async def _doctor(args: argparse.Namespace, settings: Settings, _redactor: object) -> int:
    from butlers import doctor

    return await doctor.run(args, settings)
