"""The watchdog of ``python -m train``'s loop: a part of the loop that takes far longer than it
usually does ends the run with an error naming the step, the process and where it waits,
instead of the run waiting forever.

The loop says which part it is in (:meth:`Watchdog.enter`: ``"step"``, ``"evaluation"``,
``"sample"``, ``"checkpoint"`` (starting a save), ``"checkpoint wait"`` (the last saves
completing)); a thread ends the process with exit status :data:`EXIT_HUNG`
when the part has run longer than

    limit = max(floor, FACTOR x the median of that part's earlier durations)
    (a part's first time: max(floor, FACTOR x the step's compile time)),

``floor`` being ``training.watchdog`` (``--watchdog S``, 60 s; 0 turns the watchdog off).
With asynchronous dispatch the "step" part of loop iteration ``i`` queues step ``i`` and waits
for step ``i - 1``'s metrics, so its duration is a step's device time.

What it catches: a host that stopped (its peers wait in a collective it never enters), a
collective one process skipped, a file system that stopped answering. In a multi-process run
every waiting process reports itself; the stuck one may say nothing (docs/multihost.md, "When
something goes wrong"). Not watched: start-up and compilation (``jax.distributed`` has its own
timeouts) and the weights written at the end.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from train.stops import Stops

__all__ = ["EXIT_HUNG", "FACTOR", "Watchdog"]

EXIT_HUNG = 124  # as coreutils' timeout: the run was stopped because a part of it did not finish
FACTOR = 10  # a part may take this many times its median duration
HISTORY = 200  # durations kept per part (the median is over these)
_ROOT = Path(__file__).resolve().parent.parent
WHAT = {"step": "step {step}", "evaluation": "the evaluation after step {step}", "sample": "the sample after step {step}",
        "checkpoint": "the checkpoint save of step {step}", "checkpoint wait": "the wait for the checkpoints after step {step}"}


def _exit_hung(message: str) -> None:
    Stops.exit(EXIT_HUNG, message)


def where_main_waits() -> str:
    """``file:line (function)`` of the main thread's innermost frame in this repository, and the
    innermost frame overall when it is elsewhere (a library call the main thread is blocked in)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)

    def name(f) -> str:
        path = Path(f.filename)
        shown = path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else Path(*path.parts[-3:])
        return f"{shown}:{f.lineno} ({f.name})"

    ours = [f for f in stack if Path(f.filename).is_relative_to(_ROOT) and ".venv" not in Path(f.filename).parts]
    inner = stack[-1]
    if ours and ours[-1] is not inner:
        return f"{name(ours[-1])}, inside {name(inner)}"
    return name(inner)


class Watchdog:
    """Times the parts of the training loop; ends the process when one runs past its limit.

    Args:
      floor_s: the shortest limit, seconds (``training.watchdog``); ``0``: no watchdog (no thread).
      first_s: the compile time of the step, seconds: a part's first limit is ``FACTOR`` times it.
      process: how the message names this process (e.g. ``"process 1 of 2 (host-b, pid 4242)"``).
      on_hang: called with the message on the watchdog's thread (default: the message on stderr,
        ``os._exit(EXIT_HUNG)``).
    """

    def __init__(self, floor_s: float, first_s: float, process: str | None = None, on_hang: Callable[[str], None] | None = None):
        self.floor, self.first = float(floor_s), float(first_s)
        self.process = process or f"process 0 of 1 ({socket.gethostname()}, pid {os.getpid()})"
        self.durations: dict[str, list[float]] = {}
        self._part: tuple[str, int, float, bool] | None = None  # (kind, step, start, timed)
        self._cond = threading.Condition()
        self._closed = False
        self._on_hang = on_hang or _exit_hung
        if self.floor > 0:
            threading.Thread(target=self._run, daemon=True, name="watchdog").start()

    def limit(self, kind: str) -> tuple[float, str]:
        """``(seconds, how it was set)`` for the next ``kind`` part."""
        seen = self.durations.get(kind)
        if seen:
            median = statistics.median(seen)
            return max(self.floor, FACTOR * median), f"{FACTOR} x the median {kind} time {median:.3g} s, at least {self.floor:g} s"
        return max(self.floor, FACTOR * self.first), f"{FACTOR} x the compile time {self.first:.3g} s, at least {self.floor:g} s"

    def enter(self, kind: str, step: int, *, timed: bool = True) -> None:
        """The loop starts part ``kind`` of ``step``; the part before it ends now. ``timed=False``:
        watched, but its duration is not one of ``kind``'s (the rest of a step after its hooks)."""
        with self._cond:
            self._end(time.monotonic())
            self._part = (kind, step, time.monotonic(), timed)
            self._cond.notify()

    def leave(self) -> None:
        """The current part ends; nothing is watched until the next :meth:`enter`."""
        with self._cond:
            self._end(time.monotonic())
            self._part = None

    def close(self) -> None:
        """Stop watching for good (the loop is over)."""
        with self._cond:
            self._part, self._closed = None, True
            self._cond.notify()

    def _end(self, now: float) -> None:
        if self._part is not None and self._part[3]:
            kind, _, t0, _ = self._part
            seen = self.durations.setdefault(kind, [])
            seen.append(now - t0)
            del seen[:-HISTORY]

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._part is None:
                    self._cond.wait()
                    continue
                kind, step, t0, _ = self._part
                limit, how = self.limit(kind)
                left = t0 + limit - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                message = (f"error: watchdog: {WHAT.get(kind, kind + ' {step}').format(step=step)} has not finished on "
                           f"{self.process} after {time.monotonic() - t0:.3g} s (limit {limit:.3g} s: {how}; --watchdog S "
                           f"sets the least, 0 turns it off); the main thread waits in {where_main_waits()}. A host that "
                           f"stopped, a collective another process never entered, or a file system that stopped answering; "
                           f"exiting with status {EXIT_HUNG}")
                self._closed = True
                break
            else:
                return
        self._on_hang(message)
