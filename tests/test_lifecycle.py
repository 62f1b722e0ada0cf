"""One lifecycle (butlers.lifecycle): parts open in order and close in reverse, a component
opens once, and the switchboard is such a component of its daemon."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from butlers.lifecycle import Background, Components, Once
from tests.conftest import StartButler, butler_config, log_records


class Part:
    """A part that writes what happens to it into a shared journal."""

    def __init__(self, name: str, journal: list[str], *, fail_open: bool = False) -> None:
        self.name = name
        self.journal = journal
        self.fail_open = fail_open
        self.once = Once(name)

    async def open(self) -> None:
        self.once.opening()
        self.journal.append(f"open {self.name}")
        if self.fail_open:
            raise RuntimeError(f"{self.name} cannot open")

    async def close(self) -> None:
        if self.once.closing():
            self.journal.append(f"close {self.name}")


class BrokenClose(Part):
    async def close(self) -> None:
        self.journal.append(f"close {self.name}")
        raise RuntimeError(f"{self.name} would not close")


async def test_parts_close_in_the_reverse_of_their_opening() -> None:
    journal: list[str] = []
    parts = Components("test")
    for name in ("pool", "http", "switchboard"):
        await parts.open(name, Part(name, journal))
    parts.on_close("socket", lambda: journal.append("close socket"))
    await parts.close()
    assert journal == [
        "open pool",
        "open http",
        "open switchboard",
        "close socket",
        "close switchboard",
        "close http",
        "close pool",
    ]
    await parts.close()  # nothing left: closing twice closes nothing twice
    assert len(journal) == 7


async def test_a_part_that_fails_to_open_is_closed_with_those_before_it() -> None:
    journal: list[str] = []
    parts = Components("test")
    await parts.open("pool", Part("pool", journal))
    with pytest.raises(RuntimeError, match="http cannot open"):
        await parts.open("http", Part("http", journal, fail_open=True))
    await parts.close()
    assert journal == ["open pool", "open http", "close http", "close pool"]


async def test_a_part_that_fails_to_close_does_not_keep_the_others_open() -> None:
    journal: list[str] = []
    parts = Components("butler 'x'")
    await parts.open("pool", Part("pool", journal))
    await parts.open("modules", BrokenClose("modules", journal))
    await parts.open("ticker", Part("ticker", journal))
    with log_records("butlers.lifecycle") as records:
        await parts.close()
    assert journal[3:] == ["close ticker", "close modules", "close pool"]
    assert [r.getMessage() for r in records if r.levelno == logging.ERROR] == [
        "butler 'x': modules did not close cleanly"
    ]


async def test_a_component_opens_once_and_never_again_after_close() -> None:
    part = Part("worker", [])
    await part.open()
    with pytest.raises(RuntimeError, match="worker is open: it opens once"):
        await part.open()
    await part.close()
    with pytest.raises(RuntimeError, match="worker is closed: it opens once"):
        await part.open()


async def test_a_background_loop_runs_until_closed() -> None:
    ticks: list[int] = []
    ticked = asyncio.Event()

    async def loop() -> None:
        while True:
            ticks.append(len(ticks))
            ticked.set()
            await asyncio.sleep(0)

    background = Background("ticker", loop)
    await background.open()
    await asyncio.wait_for(ticked.wait(), 10)
    await background.close()
    seen = len(ticks)
    await asyncio.sleep(0.01)
    assert len(ticks) == seen  # nothing runs after close


async def test_the_switchboard_is_a_component_that_opens_once(
    start_butler: StartButler, tmp_path: Path
) -> None:
    config_dir = tmp_path / "butlers"
    config_dir.mkdir()
    daemon = await start_butler(butler_config("switchboard"), config_dir=config_dir)
    switchboard = daemon.switchboard
    assert switchboard is not None
    # Its parts are built whole when the daemon builds it, not on start.
    assert switchboard.leadership.is_leader
    with pytest.raises(RuntimeError, match="switchboard 'switchboard' is open: it opens once"):
        await switchboard.open()
    await daemon.stop()
    assert daemon.switchboard is None and not switchboard.leadership.is_leader
    with pytest.raises(RuntimeError, match="switchboard 'switchboard' is closed: it opens once"):
        await switchboard.open()
