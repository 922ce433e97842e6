"""Signals that stop ``python -m train`` at any moment: Ctrl-C (SIGINT) and preemption
(SIGTERM, SIGUSR1), turned into a :class:`Stop` the training loop acts on (docs/main-job.md,
"Ctrl-C" and "Preemption"). No jax here: ``train/__main__.py`` installs this first, before
importing jax takes seconds.

- Before training (importing jax, building the state, compiling, the first evaluation):
  exit at once with one line, nothing written (130 after Ctrl-C, 143 after SIGTERM / SIGUSR1).
- During training, Ctrl-C: :attr:`Stops.pending` becomes :attr:`Stop.INTERRUPT`; the loop
  finishes the step in flight, saves it when checkpointing is on, writes the weights and the
  summary, exits 130. A second Ctrl-C exits 130 at once; one arriving within
  :data:`SAME_PRESS_S` of the first is the same press (a wrapper such as a package manager's
  ``run`` that forwards the terminal's SIGINT to the child, which the terminal also sent it).
- During training, SIGTERM or SIGUSR1: :attr:`Stop.PREEMPT`; the loop finishes the step,
  saves a checkpoint (whatever ``--ckpt-every``), writes the summary, exits 143. A second one
  changes nothing. With ``--preempt-grace S`` a thread ends the process S seconds after the
  signal whatever the loop is doing (:meth:`Stops.set_deadline`: the trainer's callback
  removes a half-written checkpoint first and names the latest complete one).

How: the C-level signal handler writes the signal number to a ``signal.set_wakeup_fd`` pipe
at once, and a daemon thread blocked on that pipe does the work; a Python handler would only
run after the native call the main thread is in (an XLA compile, a step) returns.
``jax.distributed.initialize`` would install its own SIGTERM handler (its preemption service:
the process then ignores SIGTERM apart from a log line): ``train.trainer.start`` turns that
service off (``jax_enable_preemption_service``) and runs :meth:`Stops.install` again after it.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from train.output import PROG

__all__ = ["EXIT_INTERRUPTED", "EXIT_PREEMPTED", "SAME_PRESS_S", "Stop", "Stops"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM; also after SIGUSR1 (the run saved its checkpoint and stopped: resume it)
SAME_PRESS_S = 0.5  # s: a second SIGINT sooner than this after the first is the same Ctrl-C
DEADLINE_CLEANUP_S = 60.0  # s: the most the main thread waits for the deadline's clean-up (it takes about 10 s at most)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _tell(message: str) -> None:
    """One line on stderr above the progress bar, on every process (the one a signal reached may not be rank 0)."""
    tqdm.write(message, file=sys.stderr)


class Stop(enum.IntEnum):
    """Why the loop stops early; ordered: the larger wins when processes disagree."""

    NONE = 0
    INTERRUPT = 1  # Ctrl-C: save if checkpointing is on, weights and summary, exit 130
    PREEMPT = 2  # SIGTERM / SIGUSR1: save a checkpoint, summary, exit 143


class Stops:
    """The stop this process has been asked for, from the moment it is created.

    Attributes:
      pending: the :class:`Stop` asked for (set by the watcher thread, read by the loop).
      signal_name: ``"SIGTERM"``, ``"SIGUSR1"`` or ``"SIGINT"`` of the first stopping signal.
      t_signal: ``time.monotonic()`` when it arrived.
      before_training: what the exit line says is on disk when a signal ends the process
        before training (the trainer names the checkpoint a ``--resume`` would continue).
    """

    def __init__(self):
        self.pending, self.signal_name, self.t_signal = Stop.NONE, None, None
        self.in_training, self.presses, self._last_press = False, 0, float("-inf")
        self.before_training = "nothing was written"
        self._lock = threading.Lock()
        self._grace: float | None = None
        self._on_deadline: Callable[[], str] | None = None
        self._deadline_started = False
        self._deadline_thread: threading.Thread | None = None
        self._deadline_reached = threading.Event()  # the grace ran out: the clean-up is under way
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._read = r
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self.install()
        threading.Thread(target=self._watch, daemon=True, name="stop-signals").start()

    def install(self) -> None:
        """(Re)install the handlers of SIGINT, SIGTERM and SIGUSR1 (main thread; again after
        ``jax.distributed.initialize``, which takes SIGTERM for its preemption service)."""
        for s in SIGNALS:
            signal.signal(s, self._handler)

    @staticmethod
    def _handler(signum, frame) -> None:  # main thread, between bytecodes: the watcher thread already acted
        pass

    def _watch(self) -> None:  # its own thread: runs even while the main thread compiles or steps
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            for signum in data:
                if signum == signal.SIGINT:
                    self._interrupt()
                elif signum in (signal.SIGTERM, signal.SIGUSR1):
                    self._preempt(signal.Signals(signum).name)

    def _first(self, name: str) -> None:
        if self.signal_name is None:
            self.signal_name, self.t_signal = name, time.monotonic()

    def _interrupt(self) -> None:
        now = time.monotonic()
        if now - self._last_press < SAME_PRESS_S:
            return  # the same press, delivered twice
        self._last_press = now
        self.presses += 1
        self._first("SIGINT")
        if not self.in_training:
            self.exit(EXIT_INTERRUPTED, f"interrupted before training started; {self.before_training}")
        if self.presses >= 2:
            self.exit(EXIT_INTERRUPTED, "interrupted again: stopped at once (files written so far are complete)")
        if self.pending < Stop.INTERRUPT:
            self.pending = Stop.INTERRUPT
            _tell(f"{PROG}: interrupted: finishing the step in flight, then saving and writing the summary "
                "(Ctrl-C again to stop at once)")

    def _preempt(self, name: str) -> None:
        self._first(name)
        if not self.in_training:
            self.exit(EXIT_PREEMPTED, f"{name} before training started; {self.before_training}")
        if self.pending == Stop.PREEMPT:
            return  # a second notice (a scheduler repeating it, the launcher forwarding it): already stopping
        self.pending = Stop.PREEMPT
        within = "" if self._grace is None else f" within --preempt-grace {self._grace:g} s"
        _tell(f"{PROG}: {name}: finishing the step in flight, saving a checkpoint and exiting {EXIT_PREEMPTED}{within}")
        self._start_deadline()

    def agree(self, stop: Stop) -> None:
        """The stop every process agreed on (``train.preempt.StopAgreement``), which a signal
        to another process may have started: this process stops too, and its grace runs from now."""
        if stop > self.pending:
            if self.t_signal is None:
                self.t_signal = time.monotonic()
            self.pending = stop
            if stop == Stop.PREEMPT:
                self._start_deadline()

    def training(self) -> None:
        """From here on a signal stops the loop after the step in flight instead of exiting."""
        self.in_training = True  # a signal the watcher has not read yet is then a stop of the loop: nothing is lost

    def set_deadline(self, grace_s: float | None, on_deadline: Callable[[], str]) -> None:
        """After a SIGTERM / SIGUSR1, end the process ``grace_s`` seconds after the signal
        (``None``: never), exit status 143, with the line ``on_deadline()`` returns (called on
        the deadline thread: it may clean up, e.g. remove a half-written checkpoint)."""
        with self._lock:
            self._grace, self._on_deadline = grace_s, on_deadline
        if self.pending == Stop.PREEMPT:
            self._start_deadline()

    def _start_deadline(self) -> None:
        with self._lock:
            if self._grace is None or self._deadline_started or self.t_signal is None:
                return
            self._deadline_started = True
            self._deadline_thread = threading.Thread(target=self._deadline, daemon=True, name="preempt-grace")
        self._deadline_thread.start()

    def _deadline(self) -> None:
        time.sleep(max(0.0, self.t_signal + self._grace - time.monotonic()))
        self._deadline_reached.set()  # before the clean-up: the errors it causes on the main thread wait for it
        _silence()  # the errors the clean-up causes on other threads are noise: the line below says it
        try:
            message = self._on_deadline() if self._on_deadline is not None else ""
        except Exception as e:  # noqa: BLE001 - the exit below must happen whatever the clean-up met
            message = f"(while cleaning up: {type(e).__name__}: {e})"
        what = self.signal_name or "the stop agreed with the other processes"
        self.exit(EXIT_PREEMPTED, f"--preempt-grace {self._grace:g} s after {what} ran out: {message}")

    def outlast(self) -> None:
        """The main thread is ending (an error, or the run's end): when the ``--preempt-grace``
        deadline has been reached, the deadline thread owns the ending, so wait for it; it removes
        what is half-written and exits 143 with the last line. Otherwise return at once. Two
        races without it: the main thread's save, broken by the blockers the clean-up puts in
        Orbax's way on purpose, ended the process 1 with Orbax's traceback (CI); and a run that
        finished meanwhile could end the process (its daemon threads with it) before the
        clean-up and the deadline's line (under load here; tests/test_preempt.py pins both)."""
        if self._deadline_reached.is_set() and self._deadline_thread is not threading.current_thread():
            self._deadline_thread.join(DEADLINE_CLEANUP_S)  # ends in os._exit: this returns only if the clean-up hung

    @staticmethod
    def exit(code: int, message: str) -> None:
        """One line on stderr (every process; on a terminal after a line break), the last thing the process writes, then
        ``os._exit(code)``: nothing more runs, no file is touched."""
        try:
            fd = _silence()
            lead = "\n" if os.isatty(fd) else ""  # a terminal: off the line of the bar or of the echoed ^C; a log: no blank line
            os.write(fd, f"{lead}{PROG}: {message}\n".encode())
        finally:
            os._exit(code)


_STDERR: list[int] = []  # the real stderr's file descriptor, once _silence has run
_SILENCE_LOCK = threading.Lock()  # the deadline and the watchdog threads may both exit


def _silence() -> int:
    """Point file descriptors 1 and 2 at /dev/null (every thread's writes: Orbax's log records
    and tracebacks during the deadline's clean-up) and return a descriptor of the real stderr,
    for the one line :meth:`Stops.exit` writes last: nothing another thread writes can follow
    it (``sys.stderr`` alone does not reach a logging handler that holds the stream, as the
    Orbax traceback CI printed shows). Falls back to 2 where ``dup`` fails."""
    with _SILENCE_LOCK:
        if not _STDERR:
            try:
                real = os.dup(2)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                _STDERR.append(real)
            except OSError:
                return 2
        return _STDERR[0]
