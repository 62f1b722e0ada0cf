"""Where does a call's CPU go, process by process? (Not a test: run it by hand.)

    .venv/bin/python bench/route_cpu.py [--rounds 3] [--seconds 4] [--callers 16] [--split]
                                        [--base DIR]

The same fleet and calls as bench/route_overhead.py (a target and a switchboard in one
`butlers up`, embedded PostgreSQL, one `state_get` direct or through `route`), but each way
held at N concurrent callers for a few seconds, and the CPU each process spent divided by the
calls made: this client, the `butlers up` process, PostgreSQL (the postmaster and all its
backends). The last column is the CPU of the `butlers up` process(es) as a share of one
core: one process runs on one core at a time, so near 100% that process, not the machine, is
what limits the calls per second.

--split also runs the switchboard in a `butlers up --only switchboard` of its own and the
target in another (route then reaches the target over MCP-over-SSE, as it does a butler of
another process).

--base DIR runs the fleet with its `butlers` package imported from DIR (a checkout of the
code before a change, as in route_overhead.py); run it and the current code alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import psutil
from fastmcp import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from route_overhead import BUTLERS, Call, _start, _way, bench_fleet

READY = "Press Ctrl-C to stop."


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:  # a backend that ended meanwhile
        return 0.0
    return times.user + times.system


def _postgres(workdir: Path) -> psutil.Process:
    """The embedded server's postmaster (`pg_ctl` started it: not a child of `butlers up`)."""
    pid_file = next((workdir / "data").rglob("postmaster.pid"))
    return psutil.Process(int(pid_file.read_text().splitlines()[0]))


async def _hold(call: Call, callers: int, seconds: float) -> int:
    """`callers` callers calling for `seconds`; how many calls they made."""
    made = 0
    until = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal made
        while time.perf_counter() < until:
            await call()
            made += 1

    await asyncio.gather(*(caller() for _ in range(callers)))
    return made


async def main(
    rounds: int, seconds: float, callers: int, split: bool, base: Path | None = None
) -> None:
    workdir, ports, env = bench_fleet(base)
    config = str(workdir / "config")
    fleets = [["target", "switchboard"]] if not split else [["target"], ["switchboard"]]
    processes = []
    try:
        for names in fleets:
            processes.append(
                await _start(
                    BUTLERS, "up", "--config-dir", config, "--only", *names, env=env, ready=READY
                )
            )
        butlers = [psutil.Process(p.pid) for p in processes]
        postgres, me = _postgres(workdir), psutil.Process()

        def sample() -> dict[str, float]:
            return {
                "client": _cpu(me),
                "butlers": sum(map(_cpu, butlers)),
                "postgres": sum(map(_cpu, [postgres, *postgres.children(recursive=True)])),
            }

        direct = Client(f"http://127.0.0.1:{ports['target']}/sse")
        routed = Client(f"http://127.0.0.1:{ports['switchboard']}/sse")
        async with direct, routed:
            await direct.call_tool("state_set", {"key": "k", "value": {"bench": True}})
            ways = {"direct": _way("direct", direct), "route": _way("route", routed)}
            for call in ways.values():  # warm-up
                await asyncio.gather(*(call() for _ in range(callers)))
            figures: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
            for _ in range(rounds):
                for name, call in ways.items():
                    before, started = sample(), time.perf_counter()
                    calls = await _hold(call, callers, seconds)
                    elapsed, after = time.perf_counter() - started, sample()
                    spent = {k: (after[k] - before[k]) / calls * 1e6 for k in after}
                    spent["rate"] = calls / elapsed
                    spent["share"] = (after["butlers"] - before["butlers"]) / elapsed * 100
                    figures[name].append(spent)
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
            await process.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    layout = "switchboard and target in two processes" if split else "one `butlers up` process"
    if base is not None:
        layout += f", the code of {base}"
    print(f"{callers} callers, {rounds} rounds of {seconds:g} s per way, {layout}; medians\n")
    print(
        "| way | calls/s | client us/call | butlers us/call | PostgreSQL us/call "
        "| all us/call | butlers' CPU, % of a core |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in figures.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        total = statistics.median(run["client"] + run["butlers"] + run["postgres"] for run in runs)
        print(
            f"| {name} | {med['rate']:.0f} | {med['client']:.0f} | {med['butlers']:.0f} "
            f"| {med['postgres']:.0f} | {total:.0f} | {med['share']:.0f}% |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--base", type=Path, help="a checkout whose code to measure instead")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.seconds, args.callers, args.split, args.base))
