"""Run a program with only the named environment variables: `python -S allowlisted_exec.py
NAMES DIR -- PROGRAM ARGS...` (NAMES comma-separated, `LC_*` for a prefix; DIR may be empty).

Claude Code starts its stdio MCP servers with its own environment, and that holds its
credentials (ANTHROPIC_API_KEY) and variables of its own (CLAUDE_CODE_MESSAGING_TOKEN and more,
which change from one version to the next: measured with 2.1.330). The gateway's Claude
wrapper puts this in front of the server so it gets the base (PATH, HOME, locale) and what it
declares, as the gateway's own children do; names travel on the command line, never values.

Run as a script by its path, with `-S`: no package, no site, a few ms.
"""

import os
import sys


def main(argv: list[str]) -> None:
    names, directory, separator, *command = argv
    if separator != "--" or not command:
        sys.exit("usage: allowlisted_exec.py NAMES DIR -- PROGRAM [ARGS...]")
    wanted = [n for n in names.split(",") if n]
    exact = {n for n in wanted if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in wanted if n.endswith("*"))
    environment = {
        name: value
        for name, value in os.environ.items()
        if name in exact or (prefixes and name.startswith(prefixes))
    }
    if directory:
        os.chdir(directory)
    os.execvpe(command[0], command, environment)


if __name__ == "__main__":
    main(sys.argv[1:])
