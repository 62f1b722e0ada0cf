"""Checks of this machine: files open to others, ports, the database, Claude Code.

Nothing here starts or changes anything: a port is tried by binding it for an instant, the
embedded PostgreSQL is asked only when it already runs (`butlers up` starts it), and Claude
Code is asked only for its version.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from butlers.doctor.report import ENV_FILE, Check, Subject, fail, ok, warn
from butlers.tasks import within

if TYPE_CHECKING:
    from butlers.config import ButlerConfig
    from butlers.db import EmbeddedServer, ExternalServer

# Claude Code reads these for its credentials (besides a login): any one will do.
CREDENTIAL_VARIABLES = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN")
CLOUD_SWITCHES = ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX")
LOCAL_TIMEOUT_S = 5.0
# Whether a taken port is one of our butlers: a butler answers /health at once.
PORT_PROBE_TIMEOUT_S = 2.0


async def checks(subject: Subject) -> list[Check]:
    found = await asyncio.to_thread(lambda: [*env_files(subject), *data_dir(subject)])
    if subject.butlers:
        found += await ports(subject)
        found += await database(subject)
    binary = await asyncio.to_thread(claude_binary, subject.environ)
    found.append(await claude_code(binary, subject.environ))
    found.append(await asyncio.to_thread(claude_credentials, subject, binary))
    return found


# -- files open to others ---------------------------------------------------------------------


def env_files(subject: Subject) -> list[Check]:
    """A .env holds every secret: readable by others, it gives them all away."""
    places = [subject.config_dir / ENV_FILE, subject.config_dir.parent / ENV_FILE]
    places.append(Path.cwd() / ENV_FILE)
    seen: dict[Path, Path] = {}
    for place in places:
        with contextlib.suppress(OSError):
            if place.is_file():
                seen.setdefault(place.resolve(), place)
    found: list[Check] = []
    for path in seen.values():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & stat.S_IROTH:
            found.append(
                fail(
                    "env-file-permissions",
                    f"{path} is readable by every user ({_permissions(mode)}) and holds "
                    f"secrets: chmod 600 {path}",
                )
            )
        elif mode & stat.S_IRGRP:
            found.append(
                warn(
                    "env-file-permissions",
                    f"{path} is readable by its group ({_permissions(mode)}): chmod 600 {path}",
                )
            )
        else:
            found.append(ok("env-file-permissions", f"{path} is readable by its owner only"))
    return found


def _permissions(mode: int) -> str:
    """`rwx------`: filemode's letters without its file type (a "?" for a bare mode)."""
    return stat.filemode(mode)[1:]


def data_dir(subject: Subject) -> list[Check]:
    """Sessions' files, the database (embedded), private MCP configs live in the data
    directory: others should not look in."""
    # Absolute: the default (.butlers) is relative to where `butlers up` runs.
    directory = Path(os.path.abspath(subject.settings.data_dir.expanduser()))
    try:
        info = directory.stat()
    except FileNotFoundError:
        return [ok("data-dir", f"{directory} does not exist yet (`butlers up` makes it)")]
    except OSError as exc:
        return [fail("data-dir", f"cannot look at {directory}: {exc.strerror}")]
    mode = stat.S_IMODE(info.st_mode)
    # Which it is: an owner looking for the variable in .env found none (an upgrade's
    # walkthrough) when it is the default.
    named = (
        "BUTLERS_DATA_DIR" if subject.variable("BUTLERS_DATA_DIR") else "the default data directory"
    )
    from butlers.cli.fleet import data_dir_refusal

    if (refusal := data_dir_refusal(directory)) is not None:
        return [fail("data-dir", refusal)]  # `butlers up` says the same, and stops
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return [
            warn(
                "data-dir",
                f"{directory} ({named}) is writable by other users "
                f"({_permissions(mode)}): chmod go-w {directory} (`butlers up` takes their "
                "write access away)",
            )
        ]
    passing = stat.S_IXGRP | stat.S_IXOTH
    if _embedded_as_root(subject) and mode & 0o077 & ~passing == 0 and mode & passing:
        return [
            ok(
                "data-dir",
                f"{directory} is closed to other users but for passing through "
                f"({_permissions(mode)}), which the embedded PostgreSQL's own account needs "
                "as root",
            )
        ]
    if mode & (stat.S_IROTH | stat.S_IXOTH):
        return [
            warn(
                "data-dir",
                f"{directory} ({named}) is open to other users ({_permissions(mode)}): "
                # As root the embedded server's account must still pass through.
                f"chmod {711 if _embedded_as_root(subject) else 700} {directory}",
            )
        ]
    return [ok("data-dir", f"{directory} is closed to other users ({_permissions(mode)})")]


def _embedded_as_root(subject: Subject) -> bool:
    """As root the embedded PostgreSQL runs as an account of its own, which must pass
    through the directories above its data (`butlers up` opens those it makes for that)."""
    return os.geteuid() == 0 and subject.settings.database_url is None


# -- ports ------------------------------------------------------------------------------------


def _bind_problem(host: str, port: int) -> int | None:
    """The errno binding `host:port` fails with now, or None when it is free. SO_REUSEADDR,
    as uvicorn binds: a port in TIME_WAIT is free to it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return errno.EADDRNOTAVAIL
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno or errno.EADDRINUSE
    return None


async def _health_name(butler: ButlerConfig, timeout_s: float) -> str | None:
    """The name the program on `butler`'s port gives at /health, if it is a butler."""
    import aiohttp

    from butlers.config import loopback_sse_url
    from butlers.dashboard.fleet import health_url

    url = health_url(loopback_sse_url(butler.host, butler.port))
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(url) as response,
        ):
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    name = body.get("name") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


async def ports(subject: Subject) -> list[Check]:
    """Each butler's port is free, or held by that very butler (the fleet is up)."""
    problems, running = [], []
    for butler in subject.butlers:
        error = _bind_problem(butler.host, butler.port)
        if error is None:
            continue
        if error != errno.EADDRINUSE:
            problems.append(
                f"{butler.name} cannot listen on {butler.host}:{butler.port} "
                f"({os.strerror(error)}): set [butler] host to an address of this machine"
            )
            continue
        if await _health_name(butler, PORT_PROBE_TIMEOUT_S) == butler.name:
            running.append(butler.name)
            continue
        problems.append(
            f"port {butler.port} of {butler.name} is taken by another program: stop it, or "
            f"change [butler] port in {butler.config_dir}/butler.toml"
        )
    if problems:
        return [fail("ports", "; ".join(problems))]
    listed = ", ".join(f"{b.name} {b.port}" for b in subject.butlers)
    if running:
        return [
            ok("ports", f"free or held by the running butlers ({', '.join(running)}): {listed}")
        ]
    return [ok("ports", f"free: {listed}")]


# -- the database -----------------------------------------------------------------------------


ROOT_DATA = "/var/lib/butlers/data/<digest>/pgdata"


def _root_data_dirs(requested: Path) -> list[Path]:
    """As root, `butlers up` may keep the data under /var/lib/butlers instead of a directory
    its PostgreSQL account cannot reach (butlers.pg_root_home): the place whose `origin`
    names `requested`. Read only; nothing is created."""
    from butlers.pg_root_home import ROOT_HOME

    found = []
    with contextlib.suppress(OSError):
        for origin in (ROOT_HOME / "data").glob("*/origin"):
            if origin.read_text().strip() == str(requested):
                found.append(origin.parent / "pgdata")
    return found


def _running_embedded(subject: Subject) -> tuple[EmbeddedServer | None, Path]:
    """The embedded server of BUTLERS_DATA_DIR if it runs (with its socket), and its data."""
    from butlers.db import EmbeddedServer, _running_postmaster

    requested = (subject.settings.data_dir / "pgdata").expanduser().resolve()
    candidates = [requested]
    if os.geteuid() == 0:
        candidates += _root_data_dirs(requested)
    for pgdata in candidates:
        running = _running_postmaster(pgdata)
        if running is not None and running.socket_dir is not None:
            server = EmbeddedServer(pgdata, environ=subject.environ)
            server.socket_dir, server.port = running.socket_dir, running.port
            return server, pgdata
    existing = [p for p in candidates if (p / "PG_VERSION").exists()]
    return None, existing[0] if existing else requested


async def _fleet_up(subject: Subject) -> list[str]:
    """The butlers of the config directory that answer on their ports (`up` runs)."""
    names = await asyncio.gather(
        *(_health_name(butler, PORT_PROBE_TIMEOUT_S) for butler in subject.butlers)
    )
    return [b.name for b, name in zip(subject.butlers, names, strict=True) if name == b.name]


async def database(subject: Subject) -> list[Check]:
    from butlers.db import ExternalServer
    from butlers.errors import DatabaseError

    server: ExternalServer | EmbeddedServer | None
    url = subject.settings.database_url
    if url is not None:
        try:
            server = ExternalServer(url.get_secret_value())
        except DatabaseError as exc:
            return [fail("database", f"{exc}")]
    else:
        try:
            server, pgdata = await asyncio.to_thread(_running_embedded, subject)
        except PermissionError as exc:  # another user's directory, from a .env of theirs
            where = " (from its .env)" if "BUTLERS_DATA_DIR" in subject.from_file else ""
            return [
                fail(
                    "database",
                    f"cannot look into {exc.filename or subject.settings.data_dir}: permission "
                    f"denied. BUTLERS_DATA_DIR{where} is {subject.settings.data_dir}: point it "
                    "at a directory of yours, or give its files to you (chown -R)",
                )
            ]
        if server is None and (held := await _fleet_up(subject)):
            # `up` runs (its ports answer as these butlers) while its PostgreSQL does not: it
            # died under it, and `up` could not start it again yet.
            return [
                fail(
                    "database",
                    f"the embedded PostgreSQL in {pgdata} is not running, though `butlers up` "
                    f"is (its {', '.join(held)} answer): it stopped under it, and `butlers up` "
                    "could not start it again yet (it keeps trying): its log says why, a full "
                    "disk or its data directory out of reach",
                )
            ]
        if server is None:
            from butlers.cli.fleet import moved_data_refusal

            if (
                moved := moved_data_refusal(subject.config_dir, subject.settings, pgdata)
            ) is not None:
                return [fail("database", f"{moved} (`butlers up` refuses to start)")]
            said = "not running" if (pgdata / "PG_VERSION").exists() else "not created yet"
            if said != "not running" and os.geteuid() == 0:
                # (where is decided by `up`, which may make PostgreSQL's account: not here)
                said += (
                    f" (as root, `butlers up` keeps it under {ROOT_DATA} instead when "
                    "PostgreSQL's account cannot pass through to it)"
                )
            then = "`butlers up` starts it"
            if said != "not running":  # an upgrade that lost BUTLERS_DATA_DIR lands here
                then = (
                    "`butlers up` makes new, empty databases there. If these butlers ran "
                    "before, their data is elsewhere: set BUTLERS_DATA_DIR to the directory "
                    "holding its pgdata"
                )
            return [
                warn(
                    "database",
                    f"the embedded PostgreSQL in {pgdata} is {said}; {then} (or set "
                    "DATABASE_URL to a server of your own)",
                )
            ]
    return [await _databases(subject, server)]


async def _databases(subject: Subject, server: ExternalServer | EmbeddedServer) -> Check:
    import asyncpg

    try:
        conn = await asyncpg.connect(server.dsn("postgres"), timeout=LOCAL_TIMEOUT_S)
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return fail(
            "database",
            f"cannot reach {server.description}: {exc or type(exc).__name__}; check that it "
            "runs and DATABASE_URL (host, port, user, password)",
        )
    try:
        names = [b.database for b in subject.butlers]
        rows = await conn.fetch(
            "SELECT datname FROM pg_database WHERE datname = ANY($1::text[])", names
        )
    finally:
        await conn.close()
    existing = {r["datname"] for r in rows}
    missing = [n for n in names if n not in existing]
    behind, newer = [], []
    for butler in subject.butlers:
        if butler.database not in existing:
            continue
        subject.dsn[butler.database] = server.dsn(butler.database)
        state = await _migration_state(server.dsn(butler.database), butler)
        if state == "behind":
            behind.append(butler.database)
        elif state == "newer":
            newer.append(butler.database)
    if newer:
        return fail(
            "database",
            f"{', '.join(newer)} on {server.description} were migrated by a newer butlers "
            "than this one: upgrade butlers",
        )
    problems = []
    if missing:
        problems.append(
            f"{', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist yet"
        )
    if behind:
        problems.append(f"{', '.join(behind)} are not migrated to this version")
    if problems:
        return warn(
            "database",
            f"{server.description} answers; {' and '.join(problems)}: `butlers up` (or "
            "`butlers db upgrade`) creates and migrates them",
        )
    return ok("database", f"{server.description}: {len(names)} databases, migrated")


async def _migration_state(dsn: str, butler: ButlerConfig) -> str:
    """ "current", "behind" (a branch's head is not applied) or "newer" (a revision this
    install does not know)."""
    import asyncpg

    from butlers.daemon import migration_branches

    try:
        conn = await asyncpg.connect(dsn, timeout=LOCAL_TIMEOUT_S)
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return "behind"
    try:
        versions = [
            r["version_num"] for r in await conn.fetch("SELECT version_num FROM alembic_version")
        ]
    except asyncpg.UndefinedTableError:
        versions = []
    finally:
        await conn.close()
    return await asyncio.to_thread(_compare, versions, migration_branches(butler))


def _compare(versions: Sequence[str], branches: Sequence[str]) -> str:
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    from butlers.db import migrations_dir

    script = ScriptDirectory(str(migrations_dir()))
    applied: set[str] = set()
    for version in versions:
        try:
            applied |= {r.revision for r in script.iterate_revisions(version, "base")}
        except CommandError:
            return "newer"
    heads = {script.get_revision(f"{branch}@head").revision for branch in branches}
    return "current" if heads <= applied else "behind"


# -- Claude Code ------------------------------------------------------------------------------


def claude_binary(environ: Mapping[str, str]) -> str | None:
    """The Claude Code sessions run: the one claude-agent-sdk bundles, else `claude` on PATH
    (the SDK's own order; butlers.gateway.install prefers PATH for the owner's own use)."""
    import shutil

    try:
        import claude_agent_sdk
    except ImportError:
        bundled = None
    else:
        candidate = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
        bundled = str(candidate) if candidate.is_file() else None
    return bundled or shutil.which("claude", path=environ.get("PATH"))


async def claude_code(binary: str | None, environ: Mapping[str, str]) -> Check:
    from butlers.environment import base_environment

    if binary is None:
        return fail(
            "claude-code",
            "no Claude Code binary (the claude-agent-sdk wheel bundles one): reinstall butlers "
            "(pip install --force-reinstall claude-agent-sdk), or install `claude` on PATH",
        )
    try:
        process = await asyncio.create_subprocess_exec(
            binary,
            "--version",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=base_environment(environ),
        )
    except OSError as exc:
        return fail("claude-code", f"{binary} cannot run ({exc.strerror}): reinstall it")
    try:
        output, _ = await within(process.communicate(), LOCAL_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        return fail("claude-code", f"{binary} --version did not answer: reinstall it")
    said = output.decode(errors="replace").strip().splitlines()
    if process.returncode != 0:
        return fail(
            "claude-code", f"{binary} --version failed ({said[-1] if said else process.returncode})"
        )
    return ok("claude-code", f"{binary} ({said[0] if said else 'unknown version'})")


def claude_config_dir(environ: Mapping[str, str]) -> Path | None:
    """Where Claude Code keeps its login: CLAUDE_CONFIG_DIR, else ~/.claude."""
    if environ.get("CLAUDE_CONFIG_DIR"):
        return Path(environ["CLAUDE_CONFIG_DIR"])
    home = environ.get("HOME")
    return Path(home) / ".claude" if home else None


def claude_login(environ: Mapping[str, str]) -> Path | None:
    """The file holding a `claude` login, if there is one: `.credentials.json` in its config
    directory (a claude.ai login), or a `primaryApiKey` in `.claude.json` (a Console login)."""
    directory = claude_config_dir(environ)
    if directory is None:
        return None
    credentials = directory / ".credentials.json"
    if credentials.is_file() and credentials.stat().st_size > 2:
        return credentials
    places = [directory / ".claude.json"]
    if not environ.get("CLAUDE_CONFIG_DIR"):
        places.insert(0, directory.parent / ".claude.json")
    for place in places:
        with contextlib.suppress(OSError, ValueError):
            data: Any = json.loads(place.read_text())
            if isinstance(data, dict) and data.get("primaryApiKey"):
                return place
    return None


def claude_credentials(subject: Subject, binary: str | None) -> Check:
    for name in CREDENTIAL_VARIABLES:
        if subject.variable(name):
            where = f" (from {subject.env_file})" if name in subject.from_file else ""
            return ok("claude-credentials", f"{name} is set{where}")
    for name in CLOUD_SWITCHES:
        if subject.variable(name):
            return ok("claude-credentials", f"{name}: Claude Code uses that cloud's credentials")
    login = claude_login(subject.environ)
    if login is not None:
        return ok("claude-credentials", f"logged in with `claude` ({login})")
    claude = binary or "claude"
    env_file = subject.env_file or subject.config_dir / ENV_FILE
    return fail(
        "claude-credentials",
        "Claude Code has no credentials (no ANTHROPIC_API_KEY, no login), so every session "
        f"fails: set ANTHROPIC_API_KEY in {env_file} and load it into the shell that starts "
        f"the fleet (set -a; . {env_file}; set +a: `butlers up` and `make up` read the "
        f"environment only), or log in with {claude} /login",
    )
