"""A thread that writes to a pipe, so whoever puts messages never waits for the reader.

put_all() pickles its items in the caller's thread (a cost it pays anyway) and appends the
bytes to a list. The thread joins everything put since its last write into one write: one
message for many steps' worth when the reader lags, and a reader that stops reading stalls
only this thread (the pipe fills, the list grows). The thread only copies bytes, so it
barely needs the GIL that the caller's thread runs on. receive() reads one such write."""

from __future__ import annotations

import io
import pickle
import threading
from multiprocessing.connection import Connection


class BatchSender:
    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._blobs: list[bytes] = []
        self._ready = threading.Condition()
        self._closing = False
        self.broken = False  # the reader is gone (its end of the pipe closed)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        self.put_all([item])

    def put_all(self, items: list) -> None:
        blob = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        with self._ready:
            self._blobs.append(blob)
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
                while not self._blobs and not self._closing:
                    self._ready.wait()
                blobs, self._blobs = self._blobs, []
                closing = self._closing
            if blobs:
                try:
                    self.conn.send_bytes(blobs[0] if len(blobs) == 1 else b"".join(blobs))
                except (OSError, ValueError):  # BrokenPipeError, or closed here
                    self.broken = True
                    return
            if closing:
                return


def receive(conn: Connection) -> list:
    """The items of one BatchSender write, in order; EOFError once the sender is gone."""
    data = conn.recv_bytes()
    stream = io.BytesIO(data)
    items: list = []
    while stream.tell() < len(data):
        items += pickle.load(stream)
    return items
