"""``python -m zshard.launch``: run P processes of one program on this host, for development and tests.

    python -m zshard.launch --nproc 2 --devices-per-proc 4 -- python -m train --strategy HYBRID_SHARD

starts ``--nproc`` copies of the command after ``--``, each with

- ``ZSHARD_COORDINATOR=127.0.0.1:PORT`` (a free port unless ``--port``),
  ``ZSHARD_NUM_PROCESSES=P`` and ``ZSHARD_PROCESS_ID=i``, which
  :func:`zshard.distributed.initialize` reads;
- ``XLA_FLAGS=--xla_force_host_platform_device_count=D`` (``--devices-per-proc``; other
  XLA flags are kept) and ``JAX_PLATFORMS=cpu`` unless already set: D emulated CPU devices.

A command starting with ``python`` runs with the launcher's own interpreter
(``sys.executable``, its virtual environment). Every line a process prints (stdout and
stderr) is echoed whole, with a ``[rank i]`` prefix, never mixed with another rank's line.
Library chatter (:data:`CHATTER`: Gloo's "Rank N is connected", glog ``I`` lines of the
XLA / coordination service) is hidden unless ``--verbose``; the count of hidden lines is
printed at the end. Progress bars (text ended by ``\r``, as tqdm redraws) are shown at
most every :data:`PROGRESS_EVERY_S` seconds per rank, each as its own line.
If a process exits with a non-zero status (or a signal), the launcher stops the others
(SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with that status
(``128 + signal`` for a signal); it exits 0 when every process does. A SIGTERM, SIGUSR1 or
Ctrl-C (SIGINT) to the launcher is forwarded to every process (rank 0, which hosts the
coordination service, last), which for ``python -m train``
means: finish the step in flight, save, exit (143 after SIGTERM / SIGUSR1, 130 after Ctrl-C);
the same signal again (or Ctrl-C after any) stops them at once. Statuses of ``python -m
train`` are named in the launcher's line (:data:`MEANING`).

It emulates hosts on one machine; on real hosts, start one process per host with
``--coordinator/--num-processes/--process-id`` or through SLURM (docs/multihost.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["free_port", "launch", "main"]

PROG = "python -m zshard.launch"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
PROGRESS_EVERY_S = 10.0  # s: a rank's progress-bar redraws are shown at most this often
COORDINATOR_LAST_S = 5.0  # s: the most a forwarded signal waits for ranks 1.. to exit before it reaches rank 0
CHATTER = (
    re.compile(rb"^I\d{4} [\d:.]+\s+\d+ \S+:\d+\].*"),  # glog INFO lines (coordination service, XLA)
    # Gloo's connection notes, one per rank and group. Several C++ threads print them at once,
    # so they arrive glued to each other and to other text, even cut short: removed wherever they are.
    re.compile(rb"\[Gloo\] Rank \d+(?: is connected to \d+ peer ranks\.(?: Expected number of connected peer ranks is : \d+)?)?"),
    re.compile(rb"\[Gloo\][\w .:]*"),  # a note cut anywhere: its own letters, digits, spaces, '.' and ':'
)
"""Library output hidden unless ``--verbose`` (warnings and errors always show)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(rank: int, nproc: int, port: int, devices: int | None, heartbeat: int | None, init: int | None) -> dict:
    env = dict(os.environ)
    env.update(ZSHARD_COORDINATOR=f"127.0.0.1:{port}", ZSHARD_NUM_PROCESSES=str(nproc), ZSHARD_PROCESS_ID=str(rank))
    if heartbeat is not None:
        env["ZSHARD_HEARTBEAT_TIMEOUT_S"] = str(heartbeat)
    if init is not None:
        env["ZSHARD_INIT_TIMEOUT_S"] = str(init)
    if devices is not None:
        flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_FLAG}={devices}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, in order per rank
    return env


class _Pump:
    """Copies one process's output to ``out``: whole lines, prefixed, chatter and most
    progress redraws dropped (see the module docstring)."""

    def __init__(self, prefix: bytes, out, lock: threading.Lock, verbose: bool):
        self.prefix, self.out, self.lock, self.verbose = prefix, out, lock, verbose
        self.hidden, self.last_progress = 0, float("-inf")

    def clean(self, line: bytes, ended_by: bytes) -> bytes | None:
        """``line`` to print (chatter cut out), or ``None`` to drop it."""
        if not self.verbose:
            for pattern in CHATTER:
                line, n = pattern.subn(b"", line)
                self.hidden += n
        if not line.strip():
            return None  # blank, or only chatter; progress bars clear their line with blanks
        if ended_by == b"\r" and not self.verbose:  # a progress bar redraw
            now = time.monotonic()
            if now - self.last_progress < PROGRESS_EVERY_S:
                return None
            self.last_progress = now
        return line

    def run(self, stream) -> None:
        buf = b""
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                break
            buf += chunk
            parts = re.split(rb"(\r\n|\r|\n)", buf)  # [text, end, text, end, ..., rest]
            buf = parts.pop()
            lines = [self.clean(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
            self.write([line for line in lines if line is not None])
        last = self.clean(buf, b"\n") if buf else None
        if last is not None:
            self.write([last])

    def write(self, lines: list[bytes]) -> None:
        if lines:
            with self.lock:
                self.out.write(b"".join(self.prefix + line + b"\n" for line in lines))
                self.out.flush()


MEANING = {2: "bad input", 124: "its watchdog: a part of its loop hung", 130: "interrupted",
           143: "SIGTERM / SIGUSR1: python -m train stopped, with a checkpoint when it was training"}
"""What ``python -m train``'s exit statuses mean (docs/multihost.md, "When something goes wrong")."""

_received: list[int] = []  # signals the launcher got (main()'s handler), forwarded by launch()


def _note_signal(signum, frame) -> None:
    _received.append(signum)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}" + (f" ({MEANING[code]})" if code in MEANING else "")


def _signal(p, signum: int) -> None:
    """``signum`` to ``p``'s process group, if it is still running."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signum)
        except ProcessLookupError:
            pass


def _forward(procs: list, signum: int) -> None:
    """``signum`` to every running process group, rank 0 last. Rank 0 hosts jax.distributed's
    coordination service, and JAX ends a process whose service has gone at once (a fatal
    "Socket closed" and a stack trace), before it acts on its own signal: a SIGTERM while
    compiling reached both ranks, rank 0 exited first and rank 1 died so (seen under load). So
    rank 0 gets the signal once ranks 1.. have exited, or after :data:`COORDINATOR_LAST_S`
    seconds; a run that is training stops together anyway (the stop agreement reaches rank 0)."""
    coordinator, others = procs[0], procs[1:]
    for p in others:
        _signal(p, signum)
    deadline = time.monotonic() + COORDINATOR_LAST_S
    while any(p.poll() is None for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(coordinator, signum)


def _stop(procs: list, grace: float) -> None:
    """SIGTERM every running process group at once (a failure path: no rank waits for another,
    unlike :func:`_forward`), then SIGKILL what is left after ``grace`` seconds."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


class _Stopped(Exception):
    def __init__(self, status: int):
        self.status = status


def launch(
    command: list[str],
    nproc: int,
    devices_per_proc: int | None = None,
    *,
    port: int | None = None,
    grace: float = 10.0,
    heartbeat_timeout_s: int | None = None,
    init_timeout_s: int | None = None,
    out=None,
    verbose: bool = False,
) -> int:
    """Run ``command`` as ``nproc`` processes of one job; returns the launcher's exit status.

    Args:
      command: the program and its arguments (e.g. ``["python", "-m", "train"]``).
      nproc: number of processes ``P`` (ranks ``0..P-1``).
      devices_per_proc: emulated CPU devices per process (``None``: leave ``XLA_FLAGS``).
      port: coordinator port on 127.0.0.1 (default: a free one).
      grace: seconds between SIGTERM and SIGKILL when stopping the others, s.
      heartbeat_timeout_s: ``ZSHARD_HEARTBEAT_TIMEOUT_S`` for the processes (default: zshard's).
      init_timeout_s: ``ZSHARD_INIT_TIMEOUT_S`` for the processes (default: zshard's).
      out: binary stream for the prefixed output (default ``sys.stdout.buffer``).
      verbose: show library chatter (:data:`CHATTER`) and every progress-bar redraw.

    Returns:
      0 if every process exits 0; else the status of the first process to fail
      (``128 + signal`` if it was killed by a signal).
    """
    out = out if out is not None else sys.stdout.buffer
    port = port if port is not None else free_port()
    lock, procs, pumps = threading.Lock(), [], []

    def say(msg: str) -> None:
        with lock:
            out.write(f"[zshard.launch] {msg}\n".encode())
            out.flush()

    say(f"{nproc} processes x {devices_per_proc or 'default'} devices, coordinator 127.0.0.1:{port}: {shlex.join(command).replace(chr(10), ' ')}")
    try:
        for rank in range(nproc):
            env = _child_env(rank, nproc, port, devices_per_proc, heartbeat_timeout_s, init_timeout_s)
            p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(p)
            pump = _Pump(f"[rank {rank}] ".encode(), out, lock, verbose)
            t = threading.Thread(target=pump.run, args=(p.stdout,), daemon=True)
            t.start()
            pumps.append((t, pump))
        status, forwarded = 0, set()
        while True:
            while _received:  # SIGTERM / SIGUSR1 / SIGINT to the launcher: once forwarded, twice stops all
                signum = _received.pop(0)
                name = signal.Signals(signum).name
                if signum in forwarded or (signum == signal.SIGINT and forwarded):
                    say(f"{name} again: stopping every process")
                    _stop(procs, grace)
                    raise _Stopped(128 + signum)
                forwarded.add(signum)
                _forward(procs, signum)
                say(f"{name}: forwarded to every process (python -m train finishes the step, saves and exits; "
                    f"{name} again stops them at once)")
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                running = sum(c is None for c in codes)
                say(f"rank {rank} {_describe(code)}; stopping the other {running} running process(es)")
                _stop(procs, grace)
                status = 128 - code if code < 0 else code
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    except _Stopped as e:
        status = e.status
    except KeyboardInterrupt:  # launch() called without main()'s handlers
        say("interrupted; stopping every process")
        _stop(procs, grace)
        status = 130
    except BaseException:
        _stop(procs, grace)
        raise
    for t, _ in pumps:
        t.join(timeout=5)
    hidden = sum(pump.hidden for _, pump in pumps)
    if hidden:
        say(f"hid {hidden} line(s) of library output (--verbose shows them)")
    if status:
        say(f"failed with status {status}")
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="Start P processes of one JAX program on 127.0.0.1 (zshard.distributed.initialize joins them), "
        "each with D emulated CPU devices; prefix their output with the rank; if one fails, stop the others.",
        usage=f"{PROG} --nproc P [--devices-per-proc D] [options] -- COMMAND ...",
    )
    p.add_argument("--nproc", metavar="P", type=int, required=True, help="number of processes (ranks 0..P-1)")
    p.add_argument("--devices-per-proc", metavar="D", type=int, default=None,
                   help="emulated CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count=D)")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free port)")
    p.add_argument("--grace", metavar="S", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping processes (default: 10)")
    p.add_argument("--heartbeat-timeout", metavar="S", type=int, default=None,
                   help="seconds without heartbeat before a process counts as dead (default: zshard's, 30)")
    p.add_argument("--init-timeout", metavar="S", type=int, default=None,
                   help="seconds for all processes to register with the coordinator (default: zshard's, 120)")
    p.add_argument("--verbose", action="store_true",
                   help="show library chatter (Gloo connections, glog INFO lines) and every progress-bar redraw")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run, after --")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: put the program after --, e.g. -- python -m train --strategy HYBRID_SHARD")
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: must be >= 1")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        parser.error(f"--devices-per-proc {args.devices_per_proc}: must be >= 1")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be in 1..65535")
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # forwarded to the processes (launch())
        signal.signal(signum, _note_signal)
    if command[0] == "python":
        command = [sys.executable, *command[1:]]  # the interpreter running the launcher (its venv)
    return launch(
        command,
        args.nproc,
        args.devices_per_proc,
        port=args.port,
        grace=args.grace,
        heartbeat_timeout_s=args.heartbeat_timeout,
        init_timeout_s=args.init_timeout,
        verbose=args.verbose,
    )


if __name__ == "__main__":
    sys.exit(main())
