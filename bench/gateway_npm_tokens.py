"""How much smaller is a host's tool list with real third-party servers behind the gateway?
(Not a test: run it by hand; needs npm and node.)

    .venv/bin/python bench/gateway_npm_tokens.py [--write]

The official `@modelcontextprotocol/server-filesystem`, `server-memory` and `server-everything`
(installed into ~/.cache/butlers-tests/npm, as the tests do), declared in a standard
`.mcp.json`, measured by `butlers gateway --report`: the whole tool definitions a host loads
natively vs through the gateway (tokens estimated at 4 characters each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_search import servers  # noqa: E402
from bench.route_overhead import write_docs_block  # noqa: E402
from tests.npm_servers import install_npm_servers  # noqa: E402

BUTLERS = str(Path(sys.executable).parent / "butlers")


def main(write: bool) -> None:
    bin_dir = install_npm_servers()
    if bin_dir is None:
        sys.exit("npm is not installed")
    project = Path(tempfile.mkdtemp(prefix="butlers-npm-tokens-"))
    (project / "files").mkdir()
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": servers(project, bin_dir)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUTLERS_")}
    report = subprocess.run(
        [BUTLERS, "gateway", "--report", "--no-butlers", "--dir", str(project)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shutil.rmtree(project, ignore_errors=True)
    table = "\n".join(
        [
            f"## gateway: tool-list size with real npm servers ({time.strftime('%Y-%m-%d')})",
            "",
            "`bench/gateway_npm_tokens.py`: the official `server-filesystem`, `server-memory` "
            "and `server-everything` from npm in a standard `.mcp.json`, measured by "
            "`butlers gateway --report`. Tokens estimated at 4 characters each.",
            "",
            report,
        ]
    )
    print(table)
    if write:
        write_docs_block("gateway_npm_tokens", table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    main(parser.parse_args().write)
