"""The last error line a spawned rank leaves for rank 0 to quote when it finds the rank dead.

It goes through a directory named in the environment, not through the rank's arguments or
the group: a rank that fails while spawn re-imports the main script has neither yet."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp

ERROR_DIR_ENV = "NANOQWEN_TP_ERROR_DIR"
RANK_NAME = "nanoqwen-tp-rank"  # the spawned processes' names: RANK_NAME + their rank
NO_MAIN_GUARD = (
    "the script builds a tensor-parallel LLM when imported, and multiprocessing's spawn "
    "imports it again in every rank's process: build the LLM under "
    '`if __name__ == "__main__":`'
)


def main_script_for_spawn() -> str | None:
    """Why spawn cannot start the ranks from this process's main script (None where it can):
    it runs the script again from its file, and a script read from standard input has none
    (its rank would die re-reading "<stdin>" before it could say so)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or path is None or os.path.exists(path):
        return None
    return (
        f"tensor parallelism starts its ranks with multiprocessing's spawn, which runs the "
        f"main script again from its file, and this one has none ({path}): run the script "
        f'from a file, building the LLM under `if __name__ == "__main__":`'
    )


def report_error(rank: int, line: str) -> None:
    """In a spawned rank: the line rank 0 quotes (the first line of what went wrong)."""
    where = os.environ.get(ERROR_DIR_ENV)
    if where and line:
        with contextlib.suppress(OSError):
            Path(where, str(rank)).write_text(line.splitlines()[0])


def read_error(where: str, rank: int) -> str | None:
    """In rank 0: what rank `rank` reported, if it did."""
    try:
        return Path(where, str(rank)).read_text().strip() or None
    except OSError:
        return None


def refuse_spawn_while_bootstrapping() -> None:
    """In a rank that spawn is still starting, whose re-import of the user's main script is
    building the engine again: one line naming the fix, then this rank exits and rank 0 quotes
    the line (multiprocessing itself would raise a page-long RuntimeError a step later, which
    left rank 0 waiting for this rank until the rendezvous timed out)."""
    process = mp.current_process()
    if not getattr(process, "_inheriting", False):
        return
    name = process.name
    rank = int(name.removeprefix(RANK_NAME)) if name.startswith(RANK_NAME) else 0
    report_error(rank, NO_MAIN_GUARD)
    print(f"[nanoqwen] {NO_MAIN_GUARD}", file=sys.stderr, flush=True)
    raise SystemExit(1)
