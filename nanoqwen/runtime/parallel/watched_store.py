"""Rank 0's rendezvous store for the ranks it spawned: every wait on it also watches them.

Joining the group waits on the store for every rank's address (gloo's full mesh, NCCL's
unique id, the control group's barrier). A rank that died before it wrote its own would keep
rank 0 there for the store's whole timeout (minutes); polling the key instead, and the
processes between polls, turns that death into an error within a poll."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.05  # rendezvous only: never on a step's path


class WatchedStore(dist.Store):
    """Forwards to inner; get() and wait() return once the keys are there, and call check()
    (which raises when a rank is dead) between looks."""

    def __init__(self, inner: dist.Store, check: Callable[[], None]) -> None:
        super().__init__()
        self.inner = inner
        self.check_ranks = check
        self._timeout = inner.timeout

    def _await(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = timeout or self._timeout
        end = time.monotonic() + timeout.total_seconds()
        while not self.inner.check(keys):
            self.check_ranks()
            if time.monotonic() > end:
                raise TimeoutError(f"the rendezvous waited {timeout} for the keys {keys}")
            time.sleep(POLL_S)

    def get(self, key: str) -> bytes:
        self._await([key])
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, timeout)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self.inner.set_timeout(timeout)
