"""The primitives under :mod:`dualwrite.database.session_locks`: PostgreSQL advisory-lock keys
and SQLite lock files."""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from dualwrite.errors import FatalError

__all__ = ["advisory_keys", "try_file_lock"]


def advisory_keys(namespace: bytes, name: str) -> tuple[int, int]:
    """The two int4 keys of a PostgreSQL advisory lock on ``name`` within ``namespace`` (the
    two-key space, apart from the applications' usual bigint keys)."""
    digest = hashlib.sha256(namespace + b"\0" + name.encode()).digest()
    return (int.from_bytes(digest[:4], "big", signed=True),
            int.from_bytes(digest[4:8], "big", signed=True))


def try_file_lock(folder: Path, name: str) -> int | None:
    """Take an exclusive ``flock`` on the file for ``name`` in ``folder`` without waiting; its
    descriptor (closing it releases the lock, so does the process's death), or None if held."""
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".lock"),
                     os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise FatalError(f"cannot use the lock folder {folder} beside the SQLite database "
                         f"({exc.strerror}); dualwrite needs to create files there") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
