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

In WAL mode a commit writes its pages to the ``-wal`` (the bell rings) a moment before it
publishes them in shared memory (which rings nothing); in rollback-journal mode its commit
point is the deletion of the ``-journal``, which the kernel reports as the end of that
file's watch. The bell can miss writes that do not go through this kernel (a network
file system, a file shared with a virtual machine): the coordinator still probes on a
slow timer (``wakeups.DOORBELL_BACKSTOP_SECONDS``). Where inotify is missing (not Linux),
or a watch cannot be set, there is no bell and the coordinator probes on its usual timer.
"""

from __future__ import annotations

import ctypes
import errno
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


class WatchFailed(OSError):
    pass


class FileDoorbell:
    """A readable file descriptor while the database's files are being written.

    ``broken`` turns True when a file of the database could not be watched any more (out
    of watches): then the bell may stay silent, and its owner must go back to a timer."""

    def __init__(self, fd: int, add_watch: Any, file: Path) -> None:
        self._fd, self._add_watch, self._directory = fd, add_watch, file.parent
        self._names = frozenset(os.fsencode(file.name + s) for s in _SUFFIXES)
        self.broken = False
        self._directory_wd = self._watch(self._directory, _DIRECTORY_MASK, must_exist=True)
        self._watch(file, _FILE_MASK, must_exist=True)
        self._watch_files()

    def _watch(self, path: Path, mask: int, must_exist: bool = False) -> int:
        """The watch's number, or -1 for a file that does not exist (yet)."""
        wd = int(self._add_watch(self._fd, os.fsencode(path), mask))
        if wd < 0:
            code = ctypes.get_errno()
            if code != errno.ENOENT or must_exist:
                raise WatchFailed(code, f"cannot watch {path}: {os.strerror(code)}")
        return wd

    def _watch_files(self) -> None:
        """Watch those of the database's files that exist (again: watching a watched
        file only returns its watch)."""
        for name in self._names:
            self._watch(self._directory / os.fsdecode(name), _FILE_MASK)

    def fileno(self) -> int:
        return self._fd

    def rang(self) -> bool:
        """Read every pending event; True if one is a write to the database's files, the
        end of one of them (a deleted ``-journal``: a commit), one appearing (it is
        watched from now on), or the kernel dropping events (then every file is watched
        again, in case a creation was among them)."""
        rang = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return rang
            except OSError:  # closed meanwhile
                return True
            if not data:
                return rang
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                name = data[start:start + length].rstrip(b"\0")
                offset = start + length
                try:
                    if mask & IN_Q_OVERFLOW:
                        self._watch_files()
                        rang = True
                    elif wd != self._directory_wd:
                        rang = True  # a write to a watched file, or its end
                    elif name in self._names:
                        self._watch(self._directory / os.fsdecode(name), _FILE_MASK)
                        rang = True
                except WatchFailed as exc:
                    if not self.broken:
                        logger.info("%s: SQLite is probed on a timer again", exc.strerror)
                    self.broken = rang = True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def file_doorbell(path: str | os.PathLike[str]) -> FileDoorbell | None:
    """A doorbell for the database file at ``path``, or None where there can be none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # (the C library this process runs on)
        init, add_watch = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):  # not Linux
        return None
    init.argtypes, init.restype = [ctypes.c_int], ctypes.c_int
    add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    add_watch.restype = ctypes.c_int
    fd = init(os.O_NONBLOCK | os.O_CLOEXEC)  # (children are spawned: CLOEXEC for others)
    if fd < 0:
        logger.info("No inotify (%s): SQLite is probed on a timer", os.strerror(ctypes.get_errno()))
        return None
    try:
        return FileDoorbell(fd, add_watch, Path(path).resolve())
    except WatchFailed as exc:
        # Out of watches (fs.inotify.max_user_watches), or no such file.
        logger.info("%s: SQLite is probed on a timer", exc.strerror)
        os.close(fd)
        return None
