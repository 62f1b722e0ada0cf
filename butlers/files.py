"""Reading a small file of ours that someone else may have tampered with.

The embedded server's list of users and the data directory's record of its config directory
lie where, before they were made private, another user might have planted a link (read as root,
it would lead anywhere) or a FIFO (the reader would wait for ever). Both are read the same way:
not through a link, without waiting, a regular file only, a bounded number of bytes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from butlers.errors import NotRegularFile


def read_regular(path: str | Path, limit: int, *, dir_fd: int | None = None) -> bytes:
    """At most `limit` bytes of the regular file `path` (relative to `dir_fd` when given).
    FileNotFoundError and the other OSErrors of opening it as they come; NotRegularFile for
    anything but a regular file (a link is refused by the open: ELOOP)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        return file.read(limit)
