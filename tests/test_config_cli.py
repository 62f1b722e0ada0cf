"""A broken config as the `butlers` command reports it: each error once, on stderr, exit 1,
no traceback (a real subprocess; nothing here reaches PostgreSQL)."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from butlers.cli.fleet import make_private_dir
from butlers.errors import CommandError
from butlers.pg_root_home import ROOT_HOME

BUTLERS = str(Path(sys.executable).parent / "butlers")


# A server nothing listens on: `up` past a check that should have stopped it fails at once
# instead of starting a fleet (and an embedded PostgreSQL) the test would wait on.
NOWHERE = "postgresql://u@127.0.0.1:1/x"


def butlers(
    *args: str,
    cwd: Path,
    data_dir: Path | None = None,
    set_data_dir: bool = True,
    database_url: str | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "DATABASE_URL"))}
    if set_data_dir:
        env["BUTLERS_DATA_DIR"] = str(data_dir or cwd / "data")
    if database_url is not None:
        env["DATABASE_URL"] = database_url
    return subprocess.run(
        [BUTLERS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_a_config_error_is_printed_once(tmp_path: Path) -> None:
    broken = tmp_path / "config" / "health" / "butler.toml"
    broken.parent.mkdir(parents=True)
    broken.write_text('[butler]\nname = "health"\nport = "8103"\n[runtime]\nmax_turn = 3\n')
    result = butlers("db", "upgrade", "--config-dir", str(tmp_path / "config"), cwd=tmp_path)
    assert result.returncode == 1
    expected = (
        f"error: {broken}: butler.port: expected a port number between 1 and 65535, got '8103', "
        "a string: write it without the quotes; "
        "also runtime.max_turn: unknown key, did you mean 'max_turns'? (butler skipped)"
    )
    assert result.stderr.count(str(broken)) == 1, result.stderr
    assert expected in result.stderr.splitlines(), result.stderr
    assert f"error: no loadable butler in {tmp_path / 'config'}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_default_butler_stops_butlers_run_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "config"
    front = config / "frontdoor" / "butler.toml"
    front.parent.mkdir(parents=True)
    front.write_text('[butler]\nname = "frontdoor"\nport = 8100\n[switchboard]\n')
    (config / "health").mkdir()
    (config / "health" / "butler.toml").write_text('[butler]\nname = "health"\nport = 8103\n')
    result = butlers("run", "frontdoor", "--config-dir", str(config), cwd=tmp_path)
    assert result.returncode == 1
    assert (
        f"error: {front}: switchboard.default_butler: default_butler 'general' is not a butler "
        f"of {config} (its butlers: health)"
    ) in result.stderr
    assert result.stderr.count(str(front)) == 1
    assert "no loadable butler named 'frontdoor'" in result.stderr
    assert "Traceback" not in result.stderr


def test_up_on_a_config_directory_that_is_not_there_says_what_to_do(tmp_path: Path) -> None:
    """A mistyped --config-dir (a newcomer's `~/my-butler` for `~/my-butlers`) is one line
    that names the directory and the way out, not a butler "skipped"; a file there too."""
    missing = tmp_path / "my-butler"
    result = butlers("up", "--config-dir", str(missing), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: the config directory {missing} does not exist: create one with "
        f"`butlers init {missing}`, or name yours with --config-dir"
    ], result.stderr
    a_file = tmp_path / "butler.toml"
    a_file.write_text('[butler]\nname = "x"\n')
    result = butlers("up", "--config-dir", str(a_file), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: {a_file} is not a directory: name a config directory with --config-dir"
    ], result.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made


def test_up_refuses_a_data_directory_that_belongs_to_someone_else(tmp_path: Path) -> None:
    """Its owner could read what the sessions see and the butlers' token kept there (as root:
    one of `nobody`'s); a directory everyone shares, such as /tmp, is no place for them either
    (and butlers does not change it). Refused before PostgreSQL starts, saying the way out."""
    config = tmp_path / "config" / "general"
    config.mkdir(parents=True)
    (config / "butler.toml").write_text('[butler]\nname = "general"\nport = 8101\n')
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        said = (
            f"error: refusing the data directory {theirs} (BUTLERS_DATA_DIR): it belongs to "
            "nobody (uid 65534), not to you, and its owner could read the sessions' files and "
            "the token kept there. Set BUTLERS_DATA_DIR to a directory of your own."
        )
    else:
        theirs = Path("/tmp")
        said = (
            f"error: refusing the data directory /tmp (BUTLERS_DATA_DIR): it is a directory "
            f"everyone shares ({stat.filemode(theirs.stat().st_mode)}). Set BUTLERS_DATA_DIR to "
            "a directory below it, which butlers makes: /tmp/butlers"
        )
    result = butlers("up", "--config-dir", str(config.parent), cwd=tmp_path, data_dir=theirs)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [said], result.stderr
    assert not (theirs / "pgdata").exists()
    # Nor a home for its data elsewhere (as root, where the server's account could not reach).
    requested = hashlib.sha256(os.fsencode(theirs.resolve() / "pgdata")).hexdigest()[:16]
    assert not (ROOT_HOME / "data" / requested).exists()


def test_what_a_data_directory_must_be(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Ours and open to others' writes: closed (logged). Shared (the sticky bit, as /tmp):
    refused, unchanged. Made when missing: 0700, or 0711 to be passed through. A symbolic
    link of ours to ours: followed. Not a directory: refused."""
    ours = tmp_path / "data"
    ours.mkdir()
    ours.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="butlers.cli.fleet"):
        make_private_dir(ours, create=False)
    assert stat.S_IMODE(ours.stat().st_mode) == 0o755
    assert f"{ours} was writable by other users (drwxrwxrwx): taking that away" in caplog.text
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(CommandError, match="it is a directory everyone shares"):
        make_private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    make_private_dir(tmp_path / "new" / "data")
    assert stat.S_IMODE((tmp_path / "new" / "data").stat().st_mode) == 0o700
    make_private_dir(tmp_path / "passed" / "data", passable=True)
    assert stat.S_IMODE((tmp_path / "passed" / "data").stat().st_mode) == 0o711
    (tmp_path / "link").symlink_to(tmp_path / "new" / "data")
    make_private_dir(tmp_path / "link")
    if os.geteuid() == 0:  # another user's link to ours: its owner could point it elsewhere
        os.lchown(tmp_path / "link", 65534, 65534)
        with pytest.raises(CommandError, match="not to you, a symbolic link, and its owner"):
            make_private_dir(tmp_path / "link")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CommandError, match="is not a directory: set BUTLERS_DATA_DIR to one"):
        make_private_dir(a_file)


def test_a_data_directory_named_in_env_but_not_loaded_stops_up_and_db_upgrade(
    tmp_path: Path,
) -> None:
    """`butlers init` writes BUTLERS_DATA_DIR into the config's .env: started from another
    directory without it loaded, the data would be a new, empty database there (`db upgrade`
    said "up to date" of one). Both refuse, saying how to load it; nothing is made."""
    config = tmp_path / "mine"
    (config / "general").mkdir(parents=True)
    (config / "general" / "butler.toml").write_text('[butler]\nname = "general"\nport = 8101\n')
    (config / ".env").write_text(f"BUTLERS_DATA_DIR={config / '.butlers'}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for command, database_url in ((("db", "upgrade"), None), (("up",), NOWHERE)):
        result = butlers(
            *command,
            "--config-dir",
            str(config),
            cwd=elsewhere,
            set_data_dir=False,
            database_url=database_url,
        )
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines() == [
            f"error: {config / '.env'} sets BUTLERS_DATA_DIR={config / '.butlers'}, which this "
            f"shell has not loaded: the data would be in {elsewhere / '.butlers'} instead. Load "
            f"it first (set -a; . {config / '.env'}; set +a), or set BUTLERS_DATA_DIR yourself"
        ], result.stderr
    assert list(elsewhere.iterdir()) == [] and not (config / ".butlers").exists()


def test_db_upgrade_where_no_fleet_ran_refuses_and_makes_nothing(tmp_path: Path) -> None:
    """Run from another directory than `butlers up` was (the default BUTLERS_DATA_DIR is
    relative), `db upgrade` made a new, empty PostgreSQL there, said "migrated" of each
    butler, and the next `up` served an empty fleet (a walkthrough of an upgrade)."""
    config = tmp_path / "mine"
    (config / "general").mkdir(parents=True)
    (config / "general" / "butler.toml").write_text('[butler]\nname = "general"\nport = 8101\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = butlers(
        "db", "upgrade", "--config-dir", str(config), cwd=elsewhere, set_data_dir=False
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"error: no databases in {elsewhere / '.butlers'} (the default, BUTLERS_DATA_DIR being "
        "unset: read from the directory you are in): `butlers db upgrade` migrates the "
        "databases of butlers that ran before. If yours did, their data is where `butlers up` "
        "ran from: set BUTLERS_DATA_DIR to that directory's .butlers. A new fleet needs no "
        "upgrade: `butlers up` makes its databases"
    ], result.stderr
    assert not (elsewhere / ".butlers" / "pgdata").exists()


def test_the_same_data_directory_written_another_way_is_the_one_loaded(tmp_path: Path) -> None:
    """`.env` names it with a `..` (or a relative path from the config's parent), the shell
    loaded it as written: the same place, so no refusal."""
    from butlers.cli.fleet import data_dir_not_loaded
    from butlers.settings import Settings

    config = tmp_path / "mine"
    config.mkdir()
    (config / ".env").write_text(f"BUTLERS_DATA_DIR={tmp_path / 'x' / '..' / 'data'}\n")
    same = Settings(environ={"BUTLERS_DATA_DIR": ""}, data_dir=tmp_path / "data")
    assert data_dir_not_loaded(config, same) is None
    other = Settings(environ={"BUTLERS_DATA_DIR": ""}, data_dir=tmp_path / "other")
    said = data_dir_not_loaded(config, other)
    assert said is not None and f"the data would be in {tmp_path / 'other'} instead" in said


def test_a_data_directory_value_over_several_lines_is_not_printed(tmp_path: Path) -> None:
    """A quote left open in .env runs on over the next lines (a secret's): not shown."""
    config = tmp_path / "mine"
    (config / "general").mkdir(parents=True)
    (config / "general" / "butler.toml").write_text('[butler]\nname = "general"\nport = 8101\n')
    (config / ".env").write_text('BUTLERS_DATA_DIR="/srv/b\nANTHROPIC_API_KEY=sk-secret-1\n#"\n')
    result = butlers(
        "up", "--config-dir", str(config), cwd=tmp_path, set_data_dir=False, database_url=NOWHERE
    )
    assert result.returncode == 1 and "(a value over several lines)" in result.stderr
    assert "sk-secret-1" not in result.stderr


def test_ups_hint_reads_only_a_regular_env_file(tmp_path: Path) -> None:
    """`up` names what a config's .env sets (to say "load it" or "not in it either"): a FIFO
    planted there would have hung the start; it is skipped, and so is a link."""
    from butlers.cli.fleet import _names_in_env_file

    env_file = tmp_path / ".env"
    env_file.write_text("TELEGRAM_BOT_TOKEN=123:abc\nEMPTY=\n# NOTE=x\n")
    assert _names_in_env_file(env_file) == {"TELEGRAM_BOT_TOKEN"}
    assert _names_in_env_file(tmp_path / "missing") is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _names_in_env_file(fifo) is None  # (returns at once: nothing waits on a writer)
    (tmp_path / "link").symlink_to(env_file)
    assert _names_in_env_file(tmp_path / "link") is None
