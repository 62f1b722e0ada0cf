"""Hot reload: the servers' files edited while the gateway serves change only what changed.

The gateway watches the files its MCP servers were declared in (butlers.gateway.sources:
`--config`, the project's `.mcp.json` and what install moved, the seed-000 files the globs
match, and new matches of the globs). When one changes, all are read again exactly as at start
and compared by name with the children the gateway runs:

- a new name is added (and started, unless the gateway is `--lazy`);
- a name no file declares any more is removed: its tools leave the hosts' lists, its process
  ends;
- a name declared differently (command, arguments, env, URL, headers...) is restarted: removed,
  then added again;
- every other child is untouched: its process and its connection stay.

The gateway's own add/remove tell the hosts (`notifications/tools/list_changed`; search mode
reindexes by itself). The butlers from the registry are never read again here.

gateway.toml's `reload` says how much a reload may do. `approve` (the default): removals
apply at once, but a new server, or one whose command, args, env, cwd, URL or headers changed,
is held pending (not started; a changed one runs on as it was) until a person approves that
very declaration with `butlers gateway approve` (butlers.gateway.approvals, whose store is
watched too), or the gateway starts again; `gateway_status` lists it as "pending" and the log
warns once per pending declaration. `apply`: everything applies at once. `off`: no watching.

A file that cannot be read now (not JSON, not the shape it should have, a server entry that is
not valid) changes nothing of what it declared: one warning names the file and what is wrong,
its running children stay, and the next good version is applied. An editor that saves by
writing a new file and renaming it over the old one is seen too: the watches are on the
directories, and the events are matched against the files' paths. `gateway.toml` is read once,
at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import logging
import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from watchfiles import Change, awatch

from butlers.errors import ConfigError
from butlers.gateway.approvals import (
    ApprovalStore,
    approve_command,
    fingerprint,
    pending_detail,
    project_key,
    same_settings,
)
from butlers.gateway.children import ChildSpec, Skipped
from butlers.gateway.config import JSON_NAME, TOML_NAME, SettingsText
from butlers.gateway.redaction import server_secrets
from butlers.gateway.server import Gateway
from butlers.gateway.sources import ServerFiles

logger = logging.getLogger(__name__)

# Watches that could not be set because a directory went away meanwhile: look again this often
# in a row, then give up (reload is off; the gateway serves on).
WATCH_RETRIES = 3


@dataclass(frozen=True)
class Plan:
    """What one reload changes, by name."""

    added: tuple[ChildSpec, ...] = ()
    removed: tuple[str, ...] = ()
    restarted: tuple[ChildSpec, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.restarted)

    def describe(self) -> str:
        """Names only: a spec's env and headers may hold secrets."""
        parts = [
            f"{verb} {', '.join(names)}"
            for verb, names in (
                ("added", [s.name for s in self.added]),
                ("removed", list(self.removed)),
                ("restarted", [s.name for s in self.restarted]),
            )
            if names
        ]
        return "; ".join(parts)


def plan(
    running: Mapping[str, ChildSpec], declared: Sequence[ChildSpec], skipped: Iterable[Skipped]
) -> Plan:
    """Compare what the files declare now with what runs. The butlers stay as they are (and
    keep their names, as at start); where a name comes twice the first wins, as at start; a
    child whose file or entry cannot be read now stays as it runs."""
    wanted: dict[str, ChildSpec] = {}
    for spec in [s for s in running.values() if s.kind == "butler"] + list(declared):
        taken = wanted.get(spec.name)
        if taken is None:
            wanted[spec.name] = spec
        elif taken.source != spec.source:
            logger.warning(
                "child %r from %s ignored: the name is taken by %s",
                spec.name,
                spec.source,
                taken.source,
            )
    for problem in skipped:
        for name in kept(problem, running):
            wanted[name] = running[name]
    return Plan(
        added=tuple(s for n, s in wanted.items() if n not in running),
        removed=tuple(n for n in running if n not in wanted),
        restarted=tuple(s for n, s in wanted.items() if n in running and not _same(running[n], s)),
    )


def kept(problem: Skipped, running: Mapping[str, ChildSpec]) -> list[str]:
    """The running children a file or entry that cannot be read now keeps as they are."""
    source = str(problem.error.path)
    return [
        name
        for name, spec in running.items()
        if spec.source == source and problem.server in (None, name)
    ]


def hold(
    changes: Plan, running: Mapping[str, ChildSpec], approved: Mapping[str, str]
) -> tuple[Plan, tuple[ChildSpec, ...]]:
    """`changes` without what needs a person's yes first, and that, held: an added server
    whose declaration is not the one approved for its name, and a restarted one whose command,
    args, env, cwd, URL or headers changed and are not approved (a changed description alone
    restarts it at once). Removals are never held."""
    held: list[ChildSpec] = []

    def allowed(spec: ChildSpec) -> bool:
        known = running.get(spec.name)
        ok = approved.get(spec.name) == fingerprint(spec) or (
            known is not None and fingerprint(known) == fingerprint(spec)
        )
        if not ok:
            held.append(spec)
        return ok

    added = tuple(s for s in changes.added if allowed(s))
    restarted = tuple(s for s in changes.restarted if allowed(s))
    return Plan(added=added, removed=changes.removed, restarted=restarted), tuple(held)


def _same(running: ChildSpec, declared: ChildSpec) -> bool:
    """Declared the same way. Where it is declared (`source`) is only for messages: a server
    moved from one file to another (as `install` does) keeps running."""
    return dataclasses.replace(declared, source=running.source) == running


@dataclass(frozen=True)
class Watches:
    """Which directories to watch (not recursively), and which changes in them matter: the
    files named outright and the directories on their way, and whatever a glob could match
    (a new server's directory, its file)."""

    directories: frozenset[Path]
    files: frozenset[Path]
    patterns: tuple[tuple[str, ...], ...]  # each glob, absolute, split into its parts

    def relevant(self, change: Change, path: str) -> bool:
        changed = Path(path)
        if changed in self.files or any(changed in f.parents for f in self.files):
            return True
        parts = changed.parts
        return any(
            len(parts) <= len(pattern) and all(map(fnmatchcase, parts, pattern))
            for pattern in self.patterns
        )


def watches(files: ServerFiles, also: Iterable[Path] = ()) -> Watches:
    """The watches for `files` (and the files `also`: the approvals store) as they are now
    (blocking: it looks at the file system)."""
    named = frozenset(_absolute(p) for p in [*files.named_files(), *also])
    directories = {_existing(p.parent) for p in named}
    patterns = []
    for pattern in files.discover_globs:
        parts = _absolute(files.base_dir / pattern).parts
        fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
        directories.add(_existing(Path(*parts[:fixed])))
        for depth in range(fixed + 1, len(parts)):
            found = glob.glob(str(Path(*parts[:depth])), include_hidden=True)
            directories.update(Path(d) for d in found if os.path.isdir(d))
        patterns.append(parts)
    return Watches(frozenset(directories), named, tuple(patterns))


def _absolute(path: Path) -> Path:
    """Absolute and normalised, symbolic links kept: the paths the watcher reports are the
    watched directory's as given, joined with the name that changed."""
    return Path(os.path.abspath(path))


def _existing(directory: Path) -> Path:
    """`directory`, or the nearest one above it that exists (whose events show it appear)."""
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    return directory


class Reloader:
    """Reads the servers' files again when they change, and changes the gateway's children
    to match (see the module). A task of `serve_gateway`'s runs `watch()`."""

    def __init__(
        self,
        gateway: Gateway,
        files: ServerFiles,
        *,
        warm: bool,
        approvals: ApprovalStore | None = None,
    ) -> None:
        self.gateway = gateway
        self.files = files
        self.warm = warm  # start added children at once (not `--lazy`)
        self.mode = gateway.config.reload  # approve | apply | off
        # Where a person's yes is recorded (default: from the gateway's environment).
        self.approvals = approvals or ApprovalStore.for_environ(files.environ)
        self._project = project_key(files.directory, files.config_file)
        # What the last reading could not read, as reported; None: no reading yet (the
        # gateway's start has just reported them).
        self._reported: set[str] | None = None
        # Pending declarations warned about (those held at start were, by the start).
        self._warned: set[tuple[str, str]] = {
            (spec.name, fingerprint(spec)) for spec in gateway.held_at_start
        }
        self._store_problem: str | None = None  # the store's, as last warned
        self._settings_told: SettingsText | None = None  # the edited settings, as last told

    async def reload(self) -> Plan:
        """Read the files again and apply what changed (what needs a yes first: held)."""
        declared, skipped = await asyncio.to_thread(self.files.read)
        with contextlib.suppress(ConfigError, OSError):  # (a file being written: next time)
            await asyncio.to_thread(self._settings_edited)
        running = {name: slot.spec for name, slot in self.gateway.slots.items()}
        changes = plan(running, declared, skipped)
        self._report(skipped, running)
        if self.mode == "approve":
            approved = await asyncio.to_thread(self._approved)
            changes, held = hold(changes, running, approved)
            self._hold(held, running, approved)
        if not changes:
            logger.debug("gateway reload: nothing changed", extra={"action": "reload"})
            return changes
        if self.gateway.redactor is not None:  # what a server started now is sent: secret too
            starting = [*changes.added, *changes.restarted]
            secrets = await asyncio.to_thread(server_secrets, self.files, starting)
            self.gateway.learn_secrets(secrets)
        # Once started it runs to the end, even if the gateway is closing meanwhile: a child
        # taken out of the gateway's list but not yet stopped would outlive it.
        applying = asyncio.create_task(self._apply(changes))
        try:
            await asyncio.shield(applying)
        except asyncio.CancelledError:
            await applying
            raise
        logger.info("gateway reload: %s", changes.describe(), extra={"action": "reload"})
        return changes

    def _report(self, skipped: Sequence[Skipped], running: Mapping[str, ChildSpec]) -> None:
        """One warning per problem, when it appears (a file saved again with the same
        mistake is not reported again), saying which servers run on as they were."""
        problems = {str(p.error): p for p in skipped}
        reported, self._reported = self._reported, set(problems)
        if reported is None:
            return
        for text, problem in problems.items():
            if text in reported:
                continue
            names = kept(problem, running)
            logger.warning(
                "gateway reload: %s (%s)",
                text,
                f"left as it runs until fixed: {', '.join(names)}" if names else "skipped",
                extra={"action": "reload_invalid"},
            )

    def _approved(self) -> dict[str, str]:
        """This project's approved declarations; none when the store cannot be trusted or
        read (warned once per problem)."""
        try:
            approved = self.approvals.approved(self._project)
        except ConfigError as exc:
            if str(exc) != self._store_problem:
                logger.warning(
                    "gateway reload: approvals %s: nothing is approved until it is fixed",
                    exc,
                    extra={"action": "reload_approvals_invalid"},
                )
            self._store_problem = str(exc)
            return {}
        self._store_problem = None
        return approved

    def _hold(
        self,
        held: Sequence[ChildSpec],
        running: Mapping[str, ChildSpec],
        approved: Mapping[str, str],
    ) -> None:
        """The held servers become the gateway's pending ones (gateway_status), each with
        where it was declared and the command that lets it in; one warning per declaration."""
        pending: dict[str, str] = {}
        for spec in held:
            pending[spec.name] = pending_detail(
                spec,
                self.files.directory,
                self.files.config_file,
                changed=spec.name in running or spec.name in approved,
                running=spec.name in running,
            )
            if (spec.name, fingerprint(spec)) not in self._warned:
                self._warned.add((spec.name, fingerprint(spec)))
                logger.warning(
                    "gateway reload: server %r %s",
                    spec.name,
                    pending[spec.name],
                    extra={"action": "reload_pending"},
                )
        self.gateway.pending = pending

    async def _apply(self, changes: Plan) -> None:
        gateway, warm = self.gateway, self.warm
        for name in changes.removed:
            await gateway.remove_child(name)
        for spec in changes.restarted:
            await gateway.restart_child(spec, warm=warm)
        for spec in changes.added:
            await gateway.add_child(spec, warm=warm)

    async def watch(self) -> None:
        """Reload whenever the files change, until cancelled. Each set of watches, once in
        place, starts with one reading of the files (what changed before it was set is not
        missed); after each reading the watches are set again if the directories to watch
        changed (a new server's directory, `.butlers-gateway/` made by install). If the file
        system cannot be watched, the gateway serves on without reload. With `reload =
        "approve"` the approvals store is watched too; with "off", nothing."""
        if self.mode == "off":
            logger.info(
                'gateway reload is off (gateway.toml reload = "off"): the servers\' files '
                "count at the next start",
                extra={"action": "reload_off"},
            )
            return
        failures = 0
        while True:
            watching = await asyncio.to_thread(self._watches)
            batches = awatch(
                *sorted(watching.directories), watch_filter=watching.relevant, recursive=False
            )
            # The generator's first step sets the watches (watchfiles' RustNotify, made
            # before its first wait); the new task takes that step before this one goes on
            # (the loop's ready queue is first in, first out): the reading comes after them.
            waiting = asyncio.ensure_future(anext(batches))
            await asyncio.sleep(0)
            try:
                what, first = "the watches were set", True
                while True:
                    await self._reload_logged(what)
                    if await asyncio.to_thread(self._watches) != watching:
                        break
                    if first:
                        logger.info(
                            "gateway reload: watching the servers' files (%d directories)",
                            len(watching.directories),
                            extra={"action": "reload_watching"},
                        )
                    changed = await waiting
                    failures = 0
                    waiting = asyncio.ensure_future(anext(batches))
                    what, first = ", ".join(sorted(path for _, path in changed)), False
            except FileNotFoundError as exc:  # a directory went away as the watches were set
                failures += 1
                if failures >= WATCH_RETRIES:
                    _reload_off(exc)
                    return
            except (OSError, RuntimeError) as exc:  # e.g. no inotify watches left
                _reload_off(exc)
                return
            finally:
                await _settle(waiting)
                await batches.aclose()

    def _watches(self) -> Watches:
        store = (self.approvals.path,) if self.mode == "approve" else ()
        settings = tuple(self.files.directory / name for name in (TOML_NAME, JSON_NAME))
        return watches(self.files, (*store, *settings))

    def _settings_edited(self) -> None:
        """gateway.toml is read at start only: one edited while the gateway runs is said to
        count from the next start, once approved (it changed nothing, silently)."""
        current = SettingsText.of(self.files.directory)
        started = self.gateway.started_settings
        if (
            started is None
            or same_settings(started, current, self.files.directory)
            or current == self._settings_told
        ):
            return
        self._settings_told = current
        command = shlex.join(approve_command((), self.files.directory, self.files.config_file))
        note = (
            f"{current.shown_name} changed while the gateway runs: it counts from the next "
            f"start, once approved (`{command} --show` shows the changes)"
        )
        self.gateway.settings_note = note
        logger.warning("gateway: %s", note, extra={"action": "settings_edited"})

    async def _reload_logged(self, what: str) -> None:
        logger.debug("gateway reload: reading the files again (%s)", what)
        try:
            await self.reload()
        except Exception:  # a bug of ours must not end reloading, nor the gateway
            logger.exception("gateway reload failed", extra={"action": "reload_failed"})


async def _settle(waiting: asyncio.Future[set[tuple[Change, str]]]) -> None:
    """Stop waiting for the watcher (it stops watching), whatever became of it: a failure
    of its own was handled above, or no longer matters."""
    waiting.cancel()
    await asyncio.wait({waiting})
    if not waiting.cancelled():
        waiting.exception()  # retrieved: not reported again when it is collected


def _reload_off(exc: BaseException) -> None:
    logger.warning(
        "gateway reload is off: the servers' files cannot be watched (%s); restart the "
        "gateway to apply their changes",
        exc,
        extra={"action": "reload_off"},
    )
