"""The trainer's side of a stop (``train/stops.py`` turns the signals into one): every process
acts on the same stop after the same step, and a preempted run ends within its grace without
leaving a half-written checkpoint.

- :class:`StopAgreement`: with several processes, after each step is queued, every process's
  pending :class:`~train.stops.Stop` is all-gathered over all devices (one int32 per device,
  a jitted all-gather) and read one step later, once that step's metrics have been read, so it
  never waits on the devices; every process acts on the largest. A SIGTERM that reaches any one
  process therefore stops all of them after the same step (the step in flight, or the one
  after). With one process: its own pending stop, at once.
- :func:`discard_half_written`: the checkpoints Orbax is still writing (``OUT/checkpoints/
  <step>.orbax-checkpoint-tmp-<time>``, renamed to ``<step>`` only when complete) moved aside
  and removed, so the latest complete checkpoint stays the latest and nothing half-written is
  left (process 0 only: it is the one that renames).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train.stops import Stop, Stops

__all__ = ["ORBAX_TMP", "StopAgreement", "discard_half_written", "latest_complete", "wait_on_thread"]

ORBAX_TMP = ".orbax-checkpoint-tmp"
"""Orbax's suffix of a step folder it is still writing (``<step>.orbax-checkpoint-tmp-<time>``)."""


class StopAgreement:
    """The stop every process acts on (:meth:`poll`, once per step, after its metrics are read).

    Attributes:
      processes: ``jax.process_count()``.
      by: the processes whose own stop made the agreed one (``[]`` until there is one).
    """

    def __init__(self, stops: Stops):
        self.stops, self.processes, self.by = stops, jax.process_count(), []
        if self.processes > 1:
            devices = jax.devices()
            mesh = Mesh(np.array(devices), ("devices",))
            self._owner = np.array([d.process_index for d in devices])  # [D]: process of each device
            self._local = NamedSharding(mesh, PartitionSpec("devices"))  # each device its own int32
            # [D] sharded over devices --all_gather(devices)--> [D] on every device
            self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
            self._flight = self._send()  # compiled here, before training
            self._flight.block_until_ready()

    def _send(self):
        mine = np.full((jax.local_device_count(),), int(self.stops.pending), np.int32)  # [D / P]
        return self._gather(jax.make_array_from_process_local_data(self._local, mine))

    def poll(self) -> Stop:
        """The stop to act on after the step just queued: with several processes the largest
        pending one as of the previous call (the same on every process), else this process's."""
        if self.processes == 1:
            self.by = [0] if self.stops.pending else []
            return self.stops.pending
        codes = np.asarray(self._flight.addressable_data(0))  # [D] int32, the same on every process
        self._flight = self._send()
        agreed = Stop(int(codes.max()))
        if agreed and not self.by:
            self.by = sorted({int(p) for p in self._owner[codes == agreed]})
            self.stops.agree(agreed)  # a signal to another process: this one's grace starts now
        return agreed


def latest_complete(directory: Path) -> int | None:
    """The newest complete step folder in ``directory`` (``OUT/checkpoints``), or ``None``."""
    steps = [int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()] if directory.is_dir() else []
    return max(steps, default=None)


def _in_progress(directory: Path, wanted: set[int]) -> list[Path]:
    """Orbax's folders being written for the steps in ``wanted`` (not the blockers left by :func:`discard_half_written`)."""
    found = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        head, _, _ = path.name.partition(ORBAX_TMP)
        if ORBAX_TMP in path.name and head.isdigit() and int(head) in wanted and path.is_dir():
            found.append(path)
    return found


def discard_half_written(directory: Path, steps: list, settle_s: float = 0.05,
                         writers_done: Callable[[float], object] | None = None) -> list[str]:
    """Remove the folders Orbax is still writing for ``steps`` in ``directory``; returns their names.

    Each is first renamed to a hidden name (atomic: if Orbax completes it first, the rename
    fails and the complete checkpoint stays), an empty file takes its name (the writes still in
    flight, which would create the folder again, fail on it), and it is removed. Passes repeat
    until one ``settle_s`` seconds after the last finds nothing new (at most ``100 x settle_s``);
    ``steps`` is read again at each pass (the caller's list: a save the main thread starts
    meanwhile is caught too). Then ``writers_done(timeout_s)`` waits, at most ``100 x settle_s``,
    for Orbax's writer threads to have ended (failed on the blocking files) before those files
    are removed: a write queued behind a loaded CPU would otherwise create the folder again
    after them (CI: ``6.orbax-checkpoint-tmp`` was left so). Call only when the process is
    about to end (Orbax's writer threads then fail on a folder that is gone).
    """
    removed, blockers = [], []
    give_up = time.monotonic() + 100 * settle_s  # a writer that keeps creating it: stop trying
    while time.monotonic() < give_up:
        found = _in_progress(directory, {int(s) for s in steps})
        if not found:
            time.sleep(settle_s)  # a write in flight, or a save being started, may still create one
            found = _in_progress(directory, {int(s) for s in steps})
            if not found:
                break
        for path in found:
            aside = directory / f".discarded-{path.name}-{len(removed)}"
            try:
                path.rename(aside)
            except FileNotFoundError:  # Orbax renamed it to <step> just now: it is complete
                continue
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # the blocker
                blockers.append(path)
            except FileExistsError:  # created again already: the next pass takes it
                pass
            shutil.rmtree(aside, ignore_errors=True)
            if aside.exists():  # a writer thread created a file meanwhile: once more
                shutil.rmtree(aside, ignore_errors=True)
            if path.name not in removed:
                removed.append(path.name)
    if blockers and writers_done is not None:
        writers_done(100 * settle_s)
    for path in blockers:
        path.unlink(missing_ok=True)
    for path in _in_progress(directory, {int(s) for s in steps}):  # a writer that outlived the wait
        shutil.rmtree(path, ignore_errors=True)
    return removed


def wait_on_thread(fn: Callable[[], object]) -> Callable[[float], bool]:
    """``fn`` (e.g. ``Checkpointer.wait_until_finished``) as a wait with a timeout in seconds:
    run on a daemon thread, its errors dropped (a save that failed on a blocker has ended);
    returns whether it ended in time."""

    def wait(timeout_s: float) -> bool:
        def run():
            try:
                fn()
            except Exception:  # noqa: BLE001, S110 - the save failed: its writers have ended, which is what is waited for
                pass

        t = threading.Thread(target=run, daemon=True, name="preempt-wait-writers")
        t.start()
        t.join(timeout_s)
        return not t.is_alive()

    return wait
