"""The coordinator's one wait: on its children's pipes and sentinels, the LISTEN socket
and a wake-up pipe that stop requests (from signal handlers or other threads) write to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from .pool import Pool


class Watcher:
    """Waits until something is ready; says whose it is."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._watched: tuple[tuple[int, ...], dict[Any, Any]] | None = None

    def poke(self) -> None:
        """End the current (or next) wait at once. Safe from a signal handler."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full: a wake-up is already waiting

    def wait(self, pools: Sequence[Pool], listener: Any,
             timeout: float) -> list[tuple[Pool | None, Any]]:
        """(pool, handle) for each child handle that is ready, (None, listener) if the
        listener is; a poke only ends the wait."""
        watched = self._watch_list(pools, listener)
        ready_owners = []
        for ready in wait(list(watched), timeout=timeout):
            owner = watched[ready]
            if ready is self._wake_r:
                try:
                    os.read(self._wake_r, 1024)
                except BlockingIOError:
                    pass
            else:
                ready_owners.append((owner, ready))
        return ready_owners

    def _watch_list(self, pools: Sequence[Pool], listener: Any) -> dict[Any, Pool | None]:
        """Everything to wait on, rebuilt only when a pool's children or the listener
        changed."""
        key = (id(listener), *(p.version for p in pools))
        # (an id can be reused by the next listener: check that it is the one watched)
        if self._watched is None or self._watched[0] != key or (
                listener is not None and listener not in self._watched[1]):
            watched: dict[Any, Pool | None] = {self._wake_r: None}
            if listener is not None:
                watched[listener] = None
            for pool in pools:
                watched.update(dict.fromkeys(pool.handles(), pool))
            self._watched = (key, watched)
        return self._watched[1]
