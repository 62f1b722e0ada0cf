"""A built wheel, installed into a fresh venv outside the source tree, runs the fleet.

This is what `pip install .`, `pip install butlers-*.whl` and `pipx install` give a user: no
source checkout, no editable finder, the migrations only as the package carries them.

The new venv does not download its dependencies: that would make the test slow and dependent
on the network. It sees the third-party packages of the venv running the tests (the versions
requirements.lock pins) through a .pth file naming a directory of links to them, which leaves
out this venv's own `butlers` (its dist-info, the editable finder and every other .pth file).
So the only `butlers` the new venv can import is the one the wheel installed, and `pip check`
there proves the wheel's declared ranges admit the versions the tests run with.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from butlers.db import PostgresServer
from tests.conftest import free_port, migration_heads
from tests.test_cli import Butlers

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "config" / "butlers"
# What a wheel is built from: everything pyproject.toml names, nothing else of the checkout.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "butlers")


async def _run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command to completion; its stdout, or a failure showing everything it said."""
    process = await asyncio.create_subprocess_exec(
        *map(str, cmd),
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    assert process.returncode == 0, (
        f"{cmd} exited {process.returncode}:\n{out.decode()}\n{err.decode()}"
    )
    return out.decode()


@dataclass
class Installed:
    """A venv holding the wheel, and a place outside the source tree to run it from."""

    root: Path
    venv: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def butlers(self) -> Path:
        return self.venv / "bin" / "butlers"

    @property
    def site_packages(self) -> Path:
        return Path(
            sysconfig.get_path("purelib", vars={"base": str(self.venv), "platbase": str(self.venv)})
        )

    @property
    def elsewhere(self) -> Path:
        return self.root / "elsewhere"

    def env(self) -> dict[str, str]:
        """The environment of a user's shell: none of this checkout's venv or paths."""
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("BUTLERS_", "PYTHON"))
            and key not in ("DATABASE_URL", "VIRTUAL_ENV")
        }
        env["PATH"] = os.pathsep.join(
            [str(self.venv / "bin")]
            + [
                p
                for p in env.get("PATH", "").split(os.pathsep)
                if p and not p.startswith(str(REPO))
            ]
        )
        env["BUTLERS_DATA_DIR"] = str(self.root / "data")
        return env


def _link_dependencies(target: Path) -> None:
    """`target`: a link to every third-party package of the running venv, but not its butlers."""
    target.mkdir()
    here = Path(sysconfig.get_path("purelib"))
    for entry in here.iterdir():
        name = entry.name
        if (
            name.startswith(("butlers", "__editable__"))
            or name.endswith(".pth")
            or name == "__pycache__"
        ):
            continue
        (target / name).symlink_to(entry)


@pytest.fixture(scope="module")
async def installed() -> AsyncIterator[Installed]:
    """Build the wheel from a copy of the sources (a stale build/ in the checkout cannot leak
    into it), and install it, offline, into a new venv in a temporary directory."""
    root = Path(tempfile.mkdtemp(prefix="butlers-test-install-"))
    try:
        source = root / "source"
        source.mkdir()
        for name in SOURCES:
            path = REPO / name
            if path.is_dir():
                shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, source / name)
        dist = root / "dist"
        await _run(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--wheel-dir",
            dist,
            source,
            cwd=root,
        )
        (wheel,) = dist.glob("butlers-*.whl")
        venv = root / "venv"
        await _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
        installed = Installed(root=root, venv=venv, wheel=wheel)
        _link_dependencies(root / "deps")
        (installed.site_packages / "_butlers_test_deps.pth").write_text(f"{root / 'deps'}\n")
        installed.elsewhere.mkdir()
        await _run(
            installed.python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            wheel,
            cwd=installed.elsewhere,
            env=installed.env(),
        )
        yield installed
    finally:
        shutil.rmtree(root, ignore_errors=True)


class InstalledButlers(Butlers):
    """`butlers ...` from the installed wheel, run from a directory outside the source tree."""

    def __init__(self, *args: str, installed: Installed) -> None:
        super().__init__(*args, env=installed.env())
        self.installed = installed

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            str(self.installed.butlers),
            *self.args,
            env=self.env,
            cwd=self.installed.elsewhere,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self._stderr_task = asyncio.create_task(self._drain_stderr())


async def test_the_installed_butlers_is_the_wheel_with_its_migrations(installed: Installed) -> None:
    probe = (
        "import sys, butlers, butlers.db; "
        "print(butlers.__file__); print(butlers.db.migrations_dir()); print(*sys.path, sep='\\n')"
    )
    out = await _run(installed.python, "-c", probe, cwd=installed.elsewhere, env=installed.env())
    module, migrations, *path = out.splitlines()
    assert Path(module).is_relative_to(installed.site_packages), module
    assert Path(migrations) == installed.site_packages / "butlers" / "migrations"
    assert not [p for p in path if p and Path(p).is_relative_to(REPO)], path
    shipped = {p.name for p in (REPO / "butlers" / "migrations" / "versions").glob("*.py")}
    assert {p.name for p in (Path(migrations) / "versions").glob("*.py")} == shipped
    assert (Path(migrations) / "env.py").is_file()
    assert (Path(migrations) / "script.py.mako").is_file()
    # The dashboard's templates and static files are package data too.
    dashboard = installed.site_packages / "butlers" / "dashboard"
    for kind in ("templates", "static"):
        shipped_files = {p.name for p in (REPO / "butlers" / "dashboard" / kind).iterdir()}
        assert {p.name for p in (dashboard / kind).iterdir()} == shipped_files, kind
    # The console script runs the installed interpreter, and its commands include `db upgrade`.
    assert installed.butlers.read_text().splitlines()[0] == f"#!{installed.python}"
    help_text = await _run(
        installed.butlers, "db", "--help", cwd=installed.elsewhere, env=installed.env()
    )
    assert "upgrade" in help_text
    # The versions the tests run with satisfy every range the wheel declares.
    await _run(installed.python, "-m", "pip", "check", cwd=installed.elsewhere, env=installed.env())


@pytest.fixture
async def database(pg_server: PostgresServer) -> AsyncIterator[str]:
    """A database name of this test's own on the test server, dropped afterwards."""
    name = f"t_install_{uuid.uuid4().hex[:12]}"
    yield name
    admin = await asyncpg.connect(pg_server.dsn("postgres"))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def _general_config(target: Path, database: str) -> int:
    """A copy of the shipped config; `general` on a free port and the test's database."""
    shutil.copytree(SHIPPED, target)
    port = free_port()
    toml = target / "general" / "butler.toml"
    text = re.sub(r"(?m)^port = \d+$", f"port = {port}", toml.read_text())
    toml.write_text(f'{text}\n[butler.db]\nname = "{database}"\n')
    return port


async def test_the_installed_wheel_migrates_and_runs_a_butler(
    installed: Installed, pg_server: PostgresServer, database: str, tmp_path: Path
) -> None:
    config = tmp_path / "config"
    port = _general_config(config, database)
    env = {"DATABASE_URL": pg_server.dsn("postgres")}

    upgrade = InstalledButlers(
        "db", "upgrade", "general", "--config-dir", str(config), installed=installed
    )
    upgrade.env.update(env)
    assert await upgrade.run() == 0, upgrade.stderr
    conn = await asyncpg.connect(pg_server.dsn(database))
    try:
        versions = {r[0] for r in await conn.fetch("SELECT version_num FROM alembic_version")}
    finally:
        await conn.close()
    assert versions == migration_heads("core")

    up = InstalledButlers(
        "up", "--only", "general", "--config-dir", str(config), installed=installed
    )
    up.env.update(env)
    await up.start()
    try:
        await up.wait_ready()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                health = await response.json()
        assert health["name"] == "general" and health["database"]["ok"] is True
        assert await up.stop(signal.SIGINT) == 0
    finally:
        await up.stop_quietly()
    assert "Traceback" not in up.stderr, up.stderr


async def test_an_install_without_its_migrations_says_to_reinstall(
    installed: Installed, pg_server: PostgresServer, database: str, tmp_path: Path
) -> None:
    """A broken install (package data left out) is named as such, not as a bare alembic path."""
    config = tmp_path / "config"
    _general_config(config, database)
    migrations = installed.site_packages / "butlers" / "migrations"
    hidden = installed.root / "migrations-hidden"
    migrations.rename(hidden)
    try:
        upgrade = InstalledButlers(
            "db", "upgrade", "general", "--config-dir", str(config), installed=installed
        )
        upgrade.env["DATABASE_URL"] = pg_server.dsn("postgres")
        assert await upgrade.run() == 1
    finally:
        hidden.rename(migrations)
    assert "installed without its data files" in upgrade.stderr, upgrade.stderr
    assert "reinstall" in upgrade.stderr
    assert "Traceback" not in upgrade.stderr, upgrade.stderr
