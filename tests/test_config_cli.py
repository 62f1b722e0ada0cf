"""A broken config as the `butlers` command reports it: each error once, on stderr, exit 1,
no traceback (a real subprocess; nothing here reaches PostgreSQL)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BUTLERS = str(Path(sys.executable).parent / "butlers")


def butlers(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUTLERS_", "DATABASE_URL"))}
    env["BUTLERS_DATA_DIR"] = str(cwd / "data")
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
