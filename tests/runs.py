"""``python -m train`` (or the launcher running it) as a background process the tests watch and
signal: its stderr read line by line on a thread, waits for a line or a metrics count, its
processes found by rank. Used by tests/test_preempt.py and tests/test_preempt_mp.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NANO = ["--model", "nano", "--seq-len", "16", "--batch-size", "8", "--eval-every", "0", "--eval-batches", "1",
        "--sample-tokens", "0", "--no-tensorboard", "--warmup", "2"]
"""A nano run without samples (``--sample-tokens 0``: no generation programs compiled); the trainer's
samples: tests/test_cli.py, tests/test_main_eval.py, tests/test_preempt_mp.py's reference, tests/test_readme.py."""


def env(**extra: str) -> dict:
    """This process's environment for a test's subprocess: no ``ZSHARD_*`` variables, this checkout on
    ``PYTHONPATH``, CPU devices, unbuffered output; then ``extra``."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
    e.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return e


def records(out: Path) -> list[dict]:
    """The whole lines of ``OUT/metrics.jsonl`` (a line being appended as it is read is left out)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def step_records(out: Path) -> dict[int, dict]:
    """``{step: record}`` of the training steps in ``OUT/metrics.jsonl``."""
    return {r["step"]: r for r in records(out) if "loss" in r}


class Run:
    """A started command; ``lines`` fills as it prints (stdout and stderr together)."""

    def __init__(self, cmd: list[str], timeout: float = 400):
        self.cmd, self.lines, self.t0 = cmd, [], time.monotonic()
        self.deadline = self.t0 + timeout
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # text mode: tqdm's \r redraws arrive as lines too
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, predicate, what: str) -> None:
        """Poll ``predicate()`` every 20 ms until true; fails (and kills) when the run ends first or times out."""
        while not predicate():
            if self.proc.poll() is not None and not predicate():
                self._reader.join(timeout=5)
                raise AssertionError(f"ended (status {self.proc.returncode}) before {what}:\n{self.text[-4000:]}")
            if time.monotonic() > self.deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}:\n{self.text[-4000:]}")
            time.sleep(0.02)

    def wait_line(self, needle: str) -> str:
        self.wait_for(lambda: any(needle in line for line in self.lines), repr(needle))
        return next(line for line in self.lines if needle in line)

    def signal(self, signum: int, pid: int | None = None) -> float:
        """Send ``signum`` to ``pid`` (default: the command itself); returns the monotonic time."""
        os.kill(self.proc.pid if pid is None else pid, signum)
        return time.monotonic()

    def finish(self) -> int:
        """Wait for the exit (within the timeout); returns the status."""
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"did not exit in time:\n{self.text[-4000:]}") from None
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.children()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def children(self) -> list[int]:
        """Pids of the direct children (the launcher's ranks)."""
        kids = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    kids.append(int(name))
        return kids

    def rank_pid(self, rank: int) -> int:
        """The pid of the launcher's process ``rank`` (its ``ZSHARD_PROCESS_ID``)."""
        for pid in self.children():
            try:
                if f"ZSHARD_PROCESS_ID={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                continue
        raise AssertionError(f"no process of rank {rank} among {self.children()}")


def train_cmd(*args: str) -> list[str]:
    return [PY, "-m", "train", *args]


LAUNCH = [PY, "-c", f"import runpy; runpy.run_path({str(ROOT / 'zshard' / 'launch.py')!r}, run_name='__main__')"]
"""``python -m zshard.launch`` without importing the zshard package: the launcher's own file (standard
library only) run as ``__main__``, the same code and flags. ``python -m`` imports ``zshard/__init__.py``
first (jax, flax, optax, orbax: 1.5 s of CPU a launch, nothing the launcher uses). The ``-m`` entry
itself: tests/test_readme.py (README's command) and tests/test_multiprocess.py's launcher test."""


def launch_cmd(*args: str, nproc: int = 2, devices: int = 4, launcher: tuple = ()) -> list[str]:
    """``python -m zshard.launch --nproc P --devices-per-proc D [launcher flags] -- python -m train ARGS``
    (:data:`LAUNCH`)."""
    return [*LAUNCH, "--nproc", str(nproc), "--devices-per-proc", str(devices), *launcher, "--", "python", "-m", "train", *args]


def train_main(argv: list[str]) -> int:
    """``python -m train``'s ``main`` (train/__main__.py) in this process, for a test that reads what the run
    wrote rather than how a process ends (a subprocess spent seconds importing jax and the trainer): returns
    the exit status. The run's ``Stops`` takes SIGINT, SIGTERM, SIGUSR1 and the signal wake-up fd; they are
    given back to the test process after it. The process's own exit statuses: tests/test_main_job.py,
    tests/test_preempt.py."""
    from train.__main__ import main  # noqa: PLC0415

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    wakeup = signal.set_wakeup_fd(-1)
    try:
        return main([str(a) for a in argv])
    finally:
        signal.set_wakeup_fd(wakeup)
        for s, h in handlers.items():
            signal.signal(s, h)
