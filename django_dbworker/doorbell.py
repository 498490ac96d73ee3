"""A doorbell for a database in a local file: the kernel says when its files are written.

SQLite has no NOTIFY, so an idle coordinator would have to probe it on a timer. Every
commit of another process writes the database's files (its ``-wal`` in WAL mode, the
file itself and its ``-journal`` otherwise), and Linux's inotify can report those writes
on a file descriptor the coordinator waits on with its pipes. So an idle coordinator
sleeps until a write, then runs its change probe (``PRAGMA data_version``), which still
decides whether anything changed. The files are watched for writes, and their directory
only for files appearing: SQLite creates the ``-wal`` and ``-journal`` files anew, and a
directory watched for writes would wake the coordinator for every line of a log file
next to the database.

The bell can miss writes that do not go through this kernel (a network file system, a
file shared with a virtual machine). The coordinator therefore still probes on a slow
timer (``wakeups.DOORBELL_BACKSTOP_SECONDS``). Where inotify is missing (not Linux),
:func:`file_doorbell` returns None and the coordinator probes on its usual timer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
from pathlib import Path
from typing import Any

logger = logging.getLogger("django_dbworker.coordinator")

# <sys/inotify.h>
IN_MODIFY = 0x002
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_Q_OVERFLOW = 0x4000
_FILE_MASK = IN_MODIFY
_DIRECTORY_MASK = IN_CREATE | IN_MOVED_TO
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_SUFFIXES = ("", "-wal", "-journal")


class FileDoorbell:
    """A readable file descriptor while the database's files are being written."""

    def __init__(self, fd: int, add_watch: Any, directory: Path, name: str) -> None:
        self._fd, self._add_watch, self._directory = fd, add_watch, directory
        self._names = frozenset(os.fsencode(name + s) for s in _SUFFIXES)
        self._directory_wd = self._watch(directory, _DIRECTORY_MASK)
        for file in self._names:
            self._watch(directory / os.fsdecode(file), _FILE_MASK)

    def _watch(self, path: Path, mask: int) -> int:
        """The watch's number, or -1 (a file that does not exist: it may come later)."""
        return int(self._add_watch(self._fd, os.fsencode(path), mask))

    def fileno(self) -> int:
        return self._fd

    def rang(self) -> bool:
        """Read every pending event; True if one is a write to the database's files, one
        of them appeared (it is watched from now on), or the kernel dropped events."""
        rang = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return rang
            except OSError:  # closed meanwhile
                return True
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                name = data[start:start + length].rstrip(b"\0")
                offset = start + length
                if wd != self._directory_wd:
                    rang = True  # a write to a watched file, or the kernel's overflow
                elif name in self._names:
                    self._watch(self._directory / os.fsdecode(name), _FILE_MASK)
                    rang = True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def file_doorbell(path: str | os.PathLike[str]) -> FileDoorbell | None:
    """A doorbell for the database file at ``path``, or None where there can be none."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        init, add_watch = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):  # not Linux
        return None
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    add_watch.restype = ctypes.c_int
    file = Path(path).resolve()
    fd = init(os.O_NONBLOCK | os.O_CLOEXEC)  # (children are spawned: CLOEXEC for others)
    if fd < 0:
        logger.debug("No inotify (%s): SQLite is probed on a timer", os.strerror(ctypes.get_errno()))
        return None
    bell = FileDoorbell(fd, add_watch, file.parent, file.name)
    if bell._directory_wd < 0:
        # Out of watches (fs.inotify.max_user_watches) or a directory it cannot watch.
        logger.debug("Cannot watch %s (%s): SQLite is probed on a timer", file.parent,
                     os.strerror(ctypes.get_errno()))
        bell.close()
        return None
    return bell
