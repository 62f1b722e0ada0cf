"""The `butlers` command: a thin layer over the same objects the tests use.

    main      the process: its streams, event loop, environment (Settings) and exit code;
              `cli` parses and runs one command
    parser    every subcommand and its options; each names the function that runs it
    fleet     `up`, `run NAME`, `db upgrade`: butlers in this process
    client    the commands that ask a running switchboard over MCP
    render    the tables those commands print
    gateway   `butlers gateway` (the gateway itself: butlers.gateway)

Each command imports what it needs when it runs: `--help` and the client commands must not
pay for FastMCP, OpenTelemetry, Claude Code's SDK and the Telegram library (seconds on a small
machine; tests/test_cli.py guards it, bench/cli_startup.py measures it). Keep module-level
imports in this package to the standard library and light modules. Where the command sits
among the other parts: docs/architecture.md.
"""

from butlers.cli.main import collector_paused, main, start_logging

__all__ = ["collector_paused", "main", "start_logging"]
