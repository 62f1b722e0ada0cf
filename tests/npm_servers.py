"""Real third-party MCP servers from npm, for the gateway's tests: the official
`@modelcontextprotocol/server-filesystem`, `server-memory` and `server-everything`, installed
once into a cache directory (the registries are reachable from tests' setup; the test runs need
no network after). Tests using the `npm_servers` fixture are marked `npm` (tests/conftest.py),
and are skipped, saying why, only when npm is not installed."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGES = (
    "@modelcontextprotocol/server-filesystem",
    "@modelcontextprotocol/server-memory",
    "@modelcontextprotocol/server-everything",
)
PREFIX = Path.home() / ".cache" / "butlers-tests" / "npm"
SERVERS = ("mcp-server-filesystem", "mcp-server-memory", "mcp-server-everything")


def install_npm_servers() -> Path | None:
    """The directory holding the three servers' executables (node_modules/.bin), installed
    there first if they are not (one process at a time); None when npm is not installed.
    The fixture below and the gateway benches use it."""
    npm = shutil.which("npm")
    if npm is None:
        return None
    bin_dir = PREFIX / "node_modules" / ".bin"
    PREFIX.mkdir(parents=True, exist_ok=True)
    with (PREFIX / ".install.lock").open("w") as lock:  # one xdist worker installs
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((bin_dir / name).exists() for name in SERVERS):
            subprocess.run(
                [npm, "install", "--prefix", str(PREFIX), "--no-audit", "--no-fund", *PACKAGES],
                check=True,
                capture_output=True,
                timeout=600,
            )
    return bin_dir


@pytest.fixture(scope="session")
def npm_servers() -> Path:
    """The directory holding the three servers' executables (node_modules/.bin)."""
    bin_dir = install_npm_servers()
    if bin_dir is None:
        pytest.skip("npm is not installed: the real MCP servers from npm cannot be installed")
    return bin_dir
