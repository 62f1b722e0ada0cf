"""The gateway's watchdog, a process of its own: when the gateway dies, even by SIGKILL, it
ends the process group of every child the gateway still had.

Each stdio child runs in a process group of its own, so ending the group ends what the child
started too (`sh -c`, `npx` and `uvx` start the real server as a grandchild). PR_SET_PDEATHSIG
reaches only the child itself; a killed gateway can run no code; this process can. It reads
`+PGID` / `-PGID` lines from the gateway on standard input; at end of input (the gateway closed
it, or died), or at SIGTERM, it sends SIGTERM to each recorded group, then SIGKILL to what is
left after a grace period, and exits.

Run as a script by its path with `python -S` (no package, no site: a few ms); started by
butlers.gateway.reaper.
"""

import os
import signal
import time

GRACE_S = 2.0


def end_groups(groups: set[int]) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for group in list(groups):
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                groups.discard(group)
            except PermissionError:  # not ours any more: never touch it again
                groups.discard(group)
        deadline = time.monotonic() + GRACE_S
        while groups and time.monotonic() < deadline:
            time.sleep(0.05)
            for group in list(groups):
                try:
                    os.killpg(group, 0)
                except (ProcessLookupError, PermissionError):
                    groups.discard(group)


def main() -> None:
    groups: set[int] = set()
    stopping = []
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the gateway's to handle
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    pending = b""
    while not stopping:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    end_groups(groups)


if __name__ == "__main__":
    main()
