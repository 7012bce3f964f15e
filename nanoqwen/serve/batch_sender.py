"""A thread that writes to a pipe, so whoever puts messages never waits for the reader.

put() only appends to a list. The thread takes everything put since its last write and sends
it as one list: one pickle and one write for many messages when the reader lags, and a
reader that stops reading stalls only this thread (the pipe fills, the list grows)."""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection


class BatchSender:
    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._items: list = []
        self._ready = threading.Condition()
        self._closing = False
        self.broken = False  # the reader is gone (its end of the pipe closed)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        self.put_all([item])

    def put_all(self, items: list) -> None:
        with self._ready:
            self._items += items
            self._ready.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then stops the thread and closes the pipe."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout)
        self.conn.close()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self._closing:
                    self._ready.wait()
                items, self._items = self._items, []
                closing = self._closing
            if items:
                try:
                    self.conn.send(items)
                except (OSError, ValueError):  # BrokenPipeError, or closed here
                    self.broken = True
                    return
            if closing:
                return
