"""A child the gateway lets go stays gone: removed by a reload, restarted, or closed with the
gateway, no process of it survives, whoever was starting it at that moment (its warm-up, a
host's call waiting for it, a re-activation), and `Gateway.close()` ends every child and the
watchdog even after such races and a warm-up that failed.

The children are real processes: the stdio mock (tests/fakes/mock_mcp.py), behind a `sh`
that waits for a gate file when a test needs a child caught half-started (the test decides
when it may go on: no timing). A process is found by a tag in its command line among this
test's own descendants, so one that never wrote a pid file is found too. Every wait is
bounded; what a failed test leaves is killed by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from butlers.errors import ConnectionClosed
from butlers.gateway.children import ChildSpec
from butlers.gateway.clients import RemoteChild
from butlers.gateway.config import load_gateway_config
from butlers.gateway.reaper import WATCHDOG
from butlers.gateway.server import Gateway
from tests.conftest import eventually
from tests.fakes.peer_mcp import serve_peer_over_sse
from tests.test_gateway import MOCK, _alive, survivors

pytestmark = pytest.mark.proc  # every test here starts stdio children

WAIT_S = 30  # bound of every wait: a bug fails the test instead of hanging it
# Waits for the file named by its first argument, then becomes the mock: a child whose start
# stays under way (spawned, not initialized) until the test creates the file.
GATED = 'while [ ! -e "$1" ]; do sleep 0.02; done; shift; exec "$@"'
# Answers initialize, then tools/list with a `tools` that is not a list: reading it raises
# TypeError, not one of the McpCallError family a warm-up expects (a failed warm-up task).
BAD_TOOLS = """
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "bad", "version": "1"}}
    else:
        r = {"tools": 5}
    print(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}), flush=True)
"""


def plain(tmp_path: Path, name: str, tag: str) -> ChildSpec:
    """The mock, started at once; `tag` in its command line names it among processes."""
    return ChildSpec(name, cmd=sys.executable, args=(MOCK, "--name", tag), cwd=tmp_path)


def gated(tmp_path: Path, name: str, tag: str, gate: Path) -> ChildSpec:
    """The mock behind `sh`, which waits for `gate` to exist (both carry `tag`)."""
    mock = (sys.executable, MOCK, "--name", tag)
    return ChildSpec(name, cmd="/bin/sh", args=("-c", GATED, tag, str(gate), *mock), cwd=tmp_path)


def tagged(tag: str) -> list[int]:
    """The live processes this test started (at any depth) whose command line holds `tag`."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if any(tag in part for part in process.cmdline()) and _alive(process.pid):
                found.append(process.pid)
    return found


def watchdogs() -> set[int]:
    """This test process's gateway watchdogs still running."""
    found = set()
    for process in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if str(WATCHDOG) in process.cmdline() and _alive(process.pid):
                found.add(process.pid)
    return found


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, *specs: ChildSpec) -> AsyncIterator[Gateway]:
    """A gateway over `specs`, closed at the end (a second close is harmless), and anything
    a failed test left of its children killed by pid."""
    gw = Gateway(load_gateway_config(tmp_path), list(specs), environ=dict(os.environ))
    try:
        yield gw
    finally:
        with contextlib.suppress(Exception):
            await gw.close()
        for pid in tagged("lifecycle-"):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


async def test_a_child_removed_while_it_starts_leaves_no_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Added (its warm-up starts it) and removed at once, at every point of the start: once
    remove_child has returned nothing of it runs, and nothing starts it again. Its warm-ups
    end quietly: a child removed did not fail (no warning, no failed task)."""
    tag = "lifecycle-added-and-removed"
    caplog.set_level(logging.DEBUG, logger="butlers.gateway")
    async with gateway(tmp_path) as gw:
        for yields in range(40):  # the removal lands at another step of the start each time
            await gw.add_child(plain(tmp_path, "x", tag), warm=True)
            for _ in range(yields):
                await asyncio.sleep(0)
            await gw.remove_child("x")
            assert tagged(tag) == [], f"removed after {yields} yields, still running"
        # The warm-ups end (in error: removed) and leave the gateway's list of them.
        running = set(gw._warming)
        if running:
            await asyncio.wait(running, timeout=WAIT_S)
        await asyncio.sleep(0)  # their done callbacks run
        assert not gw._warming
        loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert loud == []
        assert any("child 'x' was removed" in r.getMessage() for r in caplog.records)
        await gw.close()
        assert tagged(tag) == []


async def test_a_call_waiting_on_a_restarted_child_does_not_bring_the_old_one_back(
    tmp_path: Path,
) -> None:
    """A host's call waits for the child its warm-up is starting; a reload restarts the child
    meanwhile. The call fails, saying the child was removed, instead of starting the old
    declaration again (the old process used to answer it and run on, the slot gone)."""
    old_gate, new_gate = tmp_path / "old.go", tmp_path / "new.go"
    new_gate.touch()
    old_spec = gated(tmp_path, "x", "lifecycle-old", old_gate)
    async with gateway(tmp_path, old_spec) as gw:
        old = gw.slots["x"].child
        gw.start_warming()

        async def spawned() -> bool:
            return old.pid is not None

        await eventually(spawned, WAIT_S)  # its warm-up holds the start, waiting at the gate
        call = asyncio.create_task(old.call_tool("echo", {"message": "hi"}))
        await asyncio.sleep(0)  # the call runs up to the start lock and waits there

        await gw.restart_child(gated(tmp_path, "x", "lifecycle-new", new_gate))
        old_gate.touch()  # were the old declaration started again, it would come up now
        with pytest.raises(ConnectionClosed, match=r"child 'x' was removed"):
            async with asyncio.timeout(WAIT_S):
                await call
        assert tagged("lifecycle-old") == []
        assert not old.running() and old.closed

        new = gw.slots["x"].child
        assert new is not old
        assert (await new.call_tool("echo", {"message": "new"}))["structuredContent"][
            "echo"
        ] == "new"
        [new_pid] = tagged("lifecycle-new")  # the sh exec'd the mock: one process
        await gw.close()
        assert await survivors([new_pid]) == []


async def test_gateway_close_after_the_races_ends_every_child_and_the_watchdog(
    tmp_path: Path,
) -> None:
    """Gateway.close() with a warm-up that failed (a child's tools/list no client code
    expects), a child half-started with a host's call waiting on it, and one running: every
    process ends, the watchdog too, and close() raises nothing."""
    before = watchdogs()
    gate = tmp_path / "never.go"  # never created: "starting" stays half-started
    bad = ChildSpec("bad", cmd=sys.executable, args=("-c", BAD_TOOLS, "lifecycle-bad"))
    async with gateway(tmp_path, plain(tmp_path, "running", "lifecycle-running"), bad) as gw:
        gw.start_warming()
        [failed] = [t for t in gw._warming if t.get_name() == "gateway:warm:bad"]
        await asyncio.wait({failed}, timeout=WAIT_S)
        assert isinstance(failed.exception(), TypeError)  # what makes this warm-up "failed"
        assert (await gw.slots["running"].child.call_tool("echo", {"message": "up"}))[
            "structuredContent"
        ]["echo"] == "up"

        await gw.add_child(gated(tmp_path, "starting", "lifecycle-starting", gate), warm=True)
        starting = gw.slots["starting"].child

        async def spawned() -> bool:
            return starting.pid is not None

        await eventually(spawned, WAIT_S)
        call = asyncio.create_task(starting.call_tool("echo", {"message": "late"}))
        await asyncio.sleep(0)  # the call waits on the start lock
        ours = tagged("lifecycle-")
        watchdog = watchdogs() - before
        assert len(ours) == 3 and len(watchdog) == 1  # running, bad, starting's sh

        await gw.close()
        with pytest.raises(ConnectionClosed, match=r"child 'starting' was removed"):
            async with asyncio.timeout(WAIT_S):
                await call
        assert tagged("lifecycle-") == []
        assert await survivors(list(watchdog)) == []


async def test_a_start_cancelled_half_way_leaves_no_half_started_child(tmp_path: Path) -> None:
    """The request starting a child is cancelled while the child is spawned but has not
    answered `initialize` (a host cancelled its call): that process ends, and the next
    request starts the child afresh instead of talking to one never initialized."""
    gate = tmp_path / "go"
    spec = gated(tmp_path, "x", "lifecycle-cancelled", gate)
    async with gateway(tmp_path, spec) as gw:
        child = gw.slots["x"].child
        call = asyncio.create_task(child.call_tool("echo", {"message": "first"}))

        async def spawned() -> bool:
            return child.pid is not None

        await eventually(spawned, WAIT_S)  # waiting at the gate, in initialize
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert not child.running()
        assert tagged("lifecycle-cancelled") == []

        gate.touch()
        result = await child.call_tool("echo", {"message": "second"})
        assert result["structuredContent"]["echo"] == "second"
        assert child.spawns == 2 and child.generation == 1


async def test_a_closed_remote_child_never_connects_again(tmp_path: Path) -> None:
    """A remote child closed while connecting, or after: its start refuses, naming it as
    removed, and no connection of it stays open."""
    async with serve_peer_over_sse() as (url, _):
        spec = ChildSpec("far", url=url)
        child = RemoteChild(spec, spawn_timeout_s=WAIT_S, rpc_timeout_s=WAIT_S)
        assert await child.list_tools()  # it works before
        await child.close()
        with pytest.raises(ConnectionClosed, match=r"child 'far' was removed"):
            await child.list_tools()
        assert not child.running()

        racing = RemoteChild(spec, spawn_timeout_s=WAIT_S, rpc_timeout_s=WAIT_S)
        connecting = asyncio.create_task(racing.start())
        await asyncio.sleep(0)  # it holds its lock, connecting
        await racing.close()  # returns once that connect has ended
        assert connecting.done()
        with pytest.raises(ConnectionClosed, match=r"child 'far' was removed"):
            await connecting
        assert not racing.running()


async def test_a_call_cut_short_by_removal_is_not_a_lost_child(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call running when a reload removes its child fails (the child is gone), but the
    child was removed, not lost: no `child_lost` warning, and the gateway keeps no trace of
    it."""
    tag = "lifecycle-removed-mid-call"
    spec = ChildSpec(
        "x", cmd=sys.executable, args=(MOCK, "--name", tag, "--hang-on", "echo"), cwd=tmp_path
    )
    caplog.set_level(logging.DEBUG, logger="butlers.gateway")
    async with gateway(tmp_path, spec) as gw:
        await gw.warm(gw.slots["x"])
        slot = gw.slots["x"]
        call = asyncio.create_task(gw.direct_call(slot, "echo", {"message": "hi"}))

        async def running() -> bool:
            return bool(tagged(tag))

        await eventually(running, WAIT_S)
        await asyncio.sleep(0.1)  # the call is sent and hangs in the child
        await gw.remove_child("x")
        with pytest.raises(Exception):  # noqa: B017 - whichever refusal: the child went away
            await asyncio.wait_for(call, WAIT_S)
        lost = [r for r in caplog.records if getattr(r, "action", "") == "child_lost"]
        assert lost == []
        assert "x" not in gw.slots
