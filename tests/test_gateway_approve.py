"""`butlers gateway approve`'s store (butlers.gateway.approvals): what it records, where, with
which modes, and what it refuses. The running gateway's side (pending servers started once
approved) is in tests/test_gateway_reload.py, through the real command."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from butlers.errors import CommandError, ConfigError
from butlers.gateway.approvals import (
    ApprovalStore,
    StartTrust,
    approve,
    approve_as_declared,
    fingerprint,
    project_key,
    start_trust,
    store_path,
)
from butlers.gateway.children import ChildSpec
from butlers.gateway.config import GatewayConfig
from butlers.gateway.sources import ServerFiles, project_servers


def environ(tmp_path: Path) -> dict[str, str]:
    return {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home")}


def declare(directory: Path, servers: dict[str, object]) -> None:
    directory.mkdir(exist_ok=True)
    (directory / ".mcp.json").write_text(json.dumps({"mcpServers": servers}))


def test_the_store_is_outside_the_project_and_xdg_state_home_must_be_absolute(
    tmp_path: Path,
) -> None:
    env = environ(tmp_path)
    assert store_path(env) == tmp_path / "state" / "butlers" / "gateway-approvals.json"
    relative = env | {"XDG_STATE_HOME": "state"}
    assert store_path(relative) == tmp_path / "home/.local/state/butlers/gateway-approvals.json"


def test_approve_records_each_declaration_privately_and_says_what_it_approved(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    declare(
        project,
        {
            "notes": {"command": "node", "args": ["s.js", "a b; rm -rf ~"], "env": {"KEY": "v1"}},
            "web": {
                "url": "http://127.0.0.1:9/mcp?key=sk-literal&k=${API_KEY}",
                "headers": {"Authorization": "Bearer ${TOKEN}", "X-Literal": "sk-literal"},
            },
        },
    )
    env = environ(tmp_path) | {"API_KEY": "sk-from-env", "TOKEN": "sk-token-value"}
    printed = "\n".join(approve(project, None, [], env))
    assert (
        f"approved notes: node s.js 'a b; rm -rf ~' (env: KEY; in {project.resolve()})" in printed
    )
    # As written: what a variable sends is seen; no value is shown.
    assert (
        "approved web: http://127.0.0.1:9/mcp?key=...&k=${API_KEY} "
        "(headers: Authorization (from ${TOKEN}), X-Literal)"
    ) in printed
    assert "sk-" not in printed and "v1" not in printed
    store = store_path(env)
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700
    assert "sk-" not in store.read_text()  # only hashes
    key = project_key(project, None)
    specs = {s.name: s for s in project_servers(project, env)}
    assert ApprovalStore(store).approved(key) == {n: fingerprint(s) for n, s in specs.items()}
    assert [p.name for p in store.parent.iterdir()] == [store.name]  # no temporary left

    # Nothing new: said so. A name not declared: an error naming it.
    nothing = approve(project, None, ["notes"], env)
    assert nothing[-1] == "nothing new to approve: notes already approved"
    with pytest.raises(CommandError, match=r"not declared in the files of --dir .*: ghost"):
        approve(project, None, ["ghost"], env)
    with pytest.raises(CommandError, match=r"--dir .*nowhere: not a directory"):
        approve(tmp_path / "nowhere", None, [], env)


def test_an_approval_is_for_one_declaration_of_one_project(tmp_path: Path) -> None:
    env = environ(tmp_path)
    first, second = tmp_path / "first", tmp_path / "second"
    declare(first, {"notes": {"command": "node", "args": ["a.js"]}})
    declare(second, {"notes": {"command": "node", "args": ["a.js"]}})
    approve(first, None, ["notes"], env)
    store = ApprovalStore(store_path(env))
    assert set(store.approved(project_key(first, None))) == {"notes"}
    assert store.approved(project_key(second, None)) == {}  # another project: not approved
    before = store.approved(project_key(first, None))["notes"]
    declare(first, {"notes": {"command": "node", "args": ["b.js"]}})
    assert store.approved(project_key(first, None))["notes"] == before  # b.js: not approved
    approve(first, None, ["notes"], env)
    assert store.approved(project_key(first, None))["notes"] != before


def test_a_store_others_may_write_is_not_trusted(tmp_path: Path) -> None:
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node"}})
    approve(project, None, [], env)
    store = store_path(env)
    store.chmod(0o666)
    with pytest.raises(ConfigError, match=r"writable by others: not trusted"):
        ApprovalStore(store).approved(project_key(project, None))
    store.chmod(0o600)
    store.write_text('{"approved": []}')
    with pytest.raises(ConfigError, match=r"approved: expected an object of projects"):
        ApprovalStore(store).approved(project_key(project, None))
    store.unlink()
    os.mkfifo(store)  # never blocks the gateway's reading
    with pytest.raises(ConfigError, match=r"is a FIFO"):
        ApprovalStore(store).approved(project_key(project, None))


# -- at start (butlers.gateway.approvals.start_trust) ---------------------------------------


def trust(project: Path, env: dict[str, str], *, record: bool = True) -> StartTrust:
    def declared(config: GatewayConfig) -> list[ChildSpec]:
        return _declared(project, env, config)

    return start_trust(project, None, env, declared, record=record)


def _declared(project: Path, env: dict[str, str], config: GatewayConfig) -> list[ChildSpec]:
    return ServerFiles(
        directory=project,
        environ=env,
        config_file=None,
        discover_globs=config.discover_globs,
        base_dir=config.base_dir,
    ).read()[0]


def test_the_first_start_approves_what_is_declared_then_and_later_writes_wait(
    tmp_path: Path,
) -> None:
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node", "args": ["a.js"]}})
    assert trust(project, env, record=False).first  # a dry run records nothing
    assert not store_path(env).exists()
    first = trust(project, env)
    assert first.first and first.held == () and first.settings_note is None
    assert set(ApprovalStore(store_path(env)).approved(project_key(project, None))) == {"notes"}

    declare(
        project,
        {"notes": {"command": "node", "args": ["b.js"]}, "planted": {"command": "sh"}},
    )
    (project / "gateway.toml").write_text('reload = "apply"\n')
    later = trust(project, env)
    assert not later.first
    assert {s.name for s in later.held} == {"notes", "planted"}
    assert later.changed == {"notes"}  # approved once, declared differently now
    assert later.config.reload == "approve"  # the approved settings (none): not "apply"
    assert later.settings_note is not None
    assert later.settings_note.startswith("gateway.toml changed since it was approved")

    # --show: what would be approved, gateway.toml's changes key by key; nothing recorded.
    shown = approve(project, None, [], env, record=False)
    assert 'would approve gateway.toml: reload: (unset) -> "apply"' in shown
    assert any(line.startswith("would approve planted: sh") for line in shown)
    assert shown[-1] == "(nothing recorded: run it without --show to approve)"
    assert {s.name for s in trust(project, env).held} == {"notes", "planted"}
    # Approving one server leaves the settings as they were approved, and says so.
    printed = approve(project, None, ["planted"], env)
    assert any(line.startswith("not approved: gateway.toml, changed") for line in printed)
    assert {s.name for s in trust(project, env).held} == {"notes"}
    printed = approve(project, None, [], env)
    assert 'approved gateway.toml: reload: (unset) -> "apply"' in printed
    now = trust(project, env)
    assert now.held == () and now.settings_note is None and now.config.reload == "apply"

    # A settings file taken away is a change too: the approved one runs until approved.
    (project / "gateway.toml").unlink()
    gone = trust(project, env)
    assert gone.config.reload == "apply" and gone.settings_note is not None
    assert approve(project, None, [], env)[0] == 'approved gateway.toml: reload: "apply" -> (unset)'


def test_a_store_of_the_older_version_makes_the_next_start_a_first_one(tmp_path: Path) -> None:
    """Before the settings were recorded, a start approved nothing (everything started): the
    servers approved by a reload then are kept, and the first start now records the rest."""
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node"}, "web": {"url": "http://127.0.0.1:9/mcp"}})
    store = store_path(env)
    store.parent.mkdir(parents=True, mode=0o700)
    key = project_key(project, None)
    store.write_text(json.dumps({"version": 1, "approved": {key: {"notes": "old-hash"}}}))
    store.chmod(0o600)
    assert trust(project, env).first
    record = ApprovalStore(store).record(key)
    assert record.settings is not None and set(record.servers) == {"notes", "web"}


def test_a_store_that_cannot_be_trusted_stops_the_start_saying_why(tmp_path: Path) -> None:
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node"}})
    trust(project, env)
    store_path(env).chmod(0o666)
    with pytest.raises(ConfigError, match=r"not trusted: the gateway cannot tell which servers"):
        trust(project, env)


def test_install_approves_what_it_moved_once(tmp_path: Path) -> None:
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node"}})
    [line] = approve_as_declared(project, None, env)
    assert line.startswith("approved as declared now: notes and the default settings")
    declare(project, {"notes": {"command": "node"}, "planted": {"command": "sh"}})
    assert approve_as_declared(project, None, env) == []  # installing again approves nothing
    assert [s.name for s in trust(project, env).held] == ["planted"]


def test_an_approval_is_of_the_file_not_of_the_shells_values(tmp_path: Path) -> None:
    """A token rotated in the environment, or a shell with other values, is no change of the
    file (servers went pending on a rotation: a walkthrough); a server whose variable this
    shell lacks is said to be unreadable here, not undeclared."""
    project = tmp_path / "project"
    declare(project, {"tok": {"command": "node", "env": {"MY_TOKEN": "${MY_TOKEN}"}}})
    approve_as_declared(project, None, environ(tmp_path) | {"MY_TOKEN": "aaa"})
    assert trust(project, environ(tmp_path) | {"MY_TOKEN": "bbb"}).held == ()
    declare(project, {"tok": {"command": "node", "env": {"MY_TOKEN": "literal-now"}}})
    assert [s.name for s in trust(project, environ(tmp_path) | {"MY_TOKEN": "bbb"}).held] == ["tok"]
    declare(project, {"tok": {"command": "node", "env": {"MY_TOKEN": "${OTHER_TOKEN}"}}})
    with pytest.raises(CommandError, match=r"OTHER_TOKEN.*declared, but not readable with this"):
        approve(project, None, ["tok"], environ(tmp_path))


def test_a_config_file_added_to_the_hosts_entry_is_no_new_project(tmp_path: Path) -> None:
    """`--config notes/a.json` added to the gateway's entry made a new project whose first
    start approved everything planted (a walkthrough): the project is its directory."""
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node"}})
    trust(project, env)
    declare(project, {"notes": {"command": "node"}, "planted": {"command": "sh"}})
    config = project / "a.json"
    config.write_text('{"mcpServers": {}}')
    assert project_key(project, config) == project_key(project, None)
    later = start_trust(project, config, env, lambda c: _declared(project, env, c), record=True)
    assert not later.first and [s.name for s in later.held] == ["planted"]


def test_settings_alone_and_a_comment_that_changes_nothing(tmp_path: Path) -> None:
    """`approve --settings` approves gateway.toml without letting in a pending server; a
    comment or layout change needs no approval at all (it blocked the file: a walkthrough)."""
    env = environ(tmp_path)
    project = tmp_path / "project"
    declare(project, {"notes": {"command": "node"}})
    (project / "gateway.toml").write_text('mode = "suite"\n')
    trust(project, env)
    (project / "gateway.toml").write_text('# my gateway\nmode   =   "suite"\n')
    assert trust(project, env).settings_note is None
    declare(project, {"notes": {"command": "node"}, "planted": {"command": "sh"}})
    (project / "gateway.toml").write_text('mode = "search"\n')
    printed = approve(project, None, [], env, settings_only=True)
    assert printed[0] == 'approved gateway.toml: mode: "suite" -> "search"'
    now = trust(project, env)
    assert now.config.mode == "search" and [s.name for s in now.held] == ["planted"]
    with pytest.raises(CommandError, match=r"--settings approves gateway\.toml alone"):
        approve(project, None, ["planted"], env, settings_only=True)
