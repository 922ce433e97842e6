"""Multi-process (multi-host) start-up around :func:`jax.distributed.initialize`.

One process per host (or per group of devices); every process runs the same program.
``initialize`` must be the first thing that touches JAX: it connects the process to the
coordinator (process 0), after which ``jax.devices()`` lists the devices of *every*
process and ``jax.local_devices()`` this process's own. A ``zshard.make_mesh()`` built
afterwards has ``replica`` = processes and ``shard`` = local devices.

Where the settings come from, first match wins:

1. the arguments (``python -m train --coordinator HOST:PORT --num-processes P --process-id I``);
2. ``ZSHARD_COORDINATOR`` / ``ZSHARD_NUM_PROCESSES`` / ``ZSHARD_PROCESS_ID``, set for each
   process by ``python -m zshard.launch`` (:mod:`zshard.launch`);
3. a cluster JAX detects: SLURM (``srun``) or Open MPI (``mpirun``), when it runs more than
   one task; JAX reads the coordinator, the count and the rank from the scheduler;
4. nothing: a single-process run; :func:`initialize` does nothing and returns ``False``.

Failures are errors, never hangs (times in seconds, defaults below):

- bad values (``HOST:PORT`` malformed, ``process_id`` outside ``0..P-1``): ``ValueError``
  before anything starts;
- coordinator unreachable for ``init_timeout_s``: ``TimeoutError`` naming the address;
- the coordinator port already taken on process 0 (a second process 0?): ``RuntimeError``;
- ``num_processes`` differing between processes: the process whose count differs from the
  coordinator's prints why and exits with status 2 (it cannot leave the job cleanly: JAX's
  shutdown barrier would wait for the others); if the coordinator waits for more processes than
  ever come, JAX aborts every process after ``init_timeout_s`` (``DEADLINE_EXCEEDED ...
  RegisterTask``), after the line this module prints before connecting;
- a process dying mid-run: it stops sending heartbeats; after ``heartbeat_timeout_s`` the
  coordination service tells the others and JAX aborts them ("Terminating process because
  the JAX distributed service detected fatal errors ... another task died"); if process 0
  (the service) dies, the others lose it the same way.

On CPU the cross-process collectives are gloo (``jax_cpu_collectives_implementation``);
GPUs use NCCL as JAX sets up.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time

import jax

__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "initialize", "parse_coordinator"]

ENV_COORDINATOR = "ZSHARD_COORDINATOR"
"""``HOST:PORT`` of process 0's coordinator (set by ``python -m zshard.launch``)."""
ENV_NUM_PROCESSES = "ZSHARD_NUM_PROCESSES"
"""Number of processes in the run."""
ENV_PROCESS_ID = "ZSHARD_PROCESS_ID"
"""This process's rank, ``0..P-1``."""
ENV_INIT_TIMEOUT = "ZSHARD_INIT_TIMEOUT_S"
"""Override of ``init_timeout_s``, seconds."""
ENV_HEARTBEAT_TIMEOUT = "ZSHARD_HEARTBEAT_TIMEOUT_S"
"""Override of ``heartbeat_timeout_s``, seconds."""

DEFAULT_INIT_TIMEOUT_S = 120
"""Seconds every process has to reach the coordinator and register."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
"""Seconds without a heartbeat after which a process counts as dead (JAX's default is 100)."""

_STATE: dict = {}  # what this module started: {"num_processes", "process_id", "coordinator"}


def parse_coordinator(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6) -> ``(host, port)``.

    Raises:
      ValueError: not ``HOST:PORT``, or the port is not in ``1..65535``.
    """
    m = re.fullmatch(r"\s*(\[[^\]]+\]|[^:\s\[\]]+):(\d+)\s*", str(address))
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(
            f"--coordinator {address!r}: expected HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:12355 "
            "(the address of process 0, reachable from every process)"
        )
    return m.group(1).strip("[]"), int(m.group(2))


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: must be an integer") from None


def _cluster_tasks() -> int:
    """Tasks of a SLURM step or an Open MPI job this process belongs to (0: none detected)."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1")))
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    return 0


def _wait_for_coordinator(host: str, port: int, timeout_s: float, who: str) -> None:
    """Retry a TCP connection to the coordinator until it answers or ``timeout_s`` passes."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
            time.sleep(0.25)
    raise TimeoutError(
        f"zshard.distributed.initialize: {who} could not reach the coordinator {host}:{port} within "
        f"{timeout_s:g} s ({last}). Check that process 0 is running with the same --coordinator, that "
        f"{host} is its address as seen from this host and port {port} is open, and that exactly one "
        f"process has --process-id 0."
    )


def _check_port_free(host: str, port: int) -> None:
    """On process 0: the coordinator port must be free (a second process 0 would find it taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise RuntimeError(
                f"zshard.distributed.initialize: process 0 cannot start the coordinator on port {port} "
                f"({e.strerror}): another program, or a second process started with --process-id 0, holds it. "
                f"Give each process a distinct --process-id in 0..P-1, or pick a free port."
            ) from None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    init_timeout_s: int | None = None,
    heartbeat_timeout_s: int | None = None,
) -> bool:
    """Start (or join) the multi-process JAX runtime; call once, before any JAX computation.

    Args:
      coordinator: ``"HOST:PORT"`` of process 0 (it starts the coordination service there);
        default ``$ZSHARD_COORDINATOR``, else the cluster's (SLURM / Open MPI).
      num_processes: ``P``, processes in the run (the same on every process); default
        ``$ZSHARD_NUM_PROCESSES`` or the cluster's task count.
      process_id: this process's rank in ``0..P-1`` (distinct per process); default
        ``$ZSHARD_PROCESS_ID`` or the cluster's.
      local_device_ids: GPUs this process uses (``jax.distributed.initialize`` meaning);
        default ``$JAX_LOCAL_DEVICE_IDS``, else all visible ones, except under SLURM / Open
        MPI where JAX gives each task one GPU (set ``JAX_LOCAL_DEVICE_IDS=0,...,7`` for one
        task per host; docs/multihost.md).
      init_timeout_s: seconds to reach the coordinator and for all ``P`` processes to
        register (default ``$ZSHARD_INIT_TIMEOUT_S`` or 120).
      heartbeat_timeout_s: seconds of silence after which a process counts as dead and the
        others are stopped (default ``$ZSHARD_HEARTBEAT_TIMEOUT_S`` or 30).

    Returns:
      ``True`` if the multi-process runtime was started; ``False`` for a single-process run
      (no argument, no ``ZSHARD_*`` variable, no multi-task cluster job): nothing is done.

    Raises:
      ValueError: malformed ``coordinator``, ``num_processes < 1``, ``process_id`` outside
        ``0..P-1``, or only some of the three given without a cluster to fill in the rest.
      RuntimeError: called twice, called after JAX has computed (its backends exist), or the
        coordinator port is taken on process 0.
      TimeoutError: the coordinator is unreachable for ``init_timeout_s``.

    Exits the process (status 2, the reason on stderr) when its ``num_processes`` differs
    from the coordinator's.
    """
    if _STATE or jax.distributed.is_initialized():
        raise RuntimeError(
            "zshard.distributed.initialize: the distributed runtime is already initialized "
            f"({_STATE or 'by another call to jax.distributed.initialize'}); call it once, at the start of the program"
        )
    coordinator = coordinator if coordinator is not None else os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    init_timeout_s = int(init_timeout_s if init_timeout_s is not None else _env_int(ENV_INIT_TIMEOUT) or DEFAULT_INIT_TIMEOUT_S)
    heartbeat_timeout_s = int(
        heartbeat_timeout_s if heartbeat_timeout_s is not None else _env_int(ENV_HEARTBEAT_TIMEOUT) or DEFAULT_HEARTBEAT_TIMEOUT_S
    )
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if all(v is None for v in given.values()) and _cluster_tasks() <= 1:
        return False  # single process: nothing to start
    from jax._src import xla_bridge  # noqa: PLC0415  (the check jax.distributed itself makes)

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "zshard.distributed.initialize must run before any JAX computation: JAX's backends already exist "
            "(something called jax.devices(), created an array, jit-compiled or device_put). Call it first thing "
            "in main(), before building the mesh, the model or any data on devices."
        )
    if None in given.values() and _cluster_tasks() <= 1:
        missing = ", ".join(k for k, v in given.items() if v is None)
        raise ValueError(
            f"zshard.distributed.initialize: {missing} missing; outside SLURM / Open MPI give all three of "
            "--coordinator HOST:PORT --num-processes P --process-id I (or start with python -m zshard.launch)"
        )
    for name, value in (("--num-processes", num_processes), ("--process-id", process_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} {value!r}: must be an integer")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes {num_processes}: must be >= 1")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id {process_id} is outside 0..{num_processes - 1} (--num-processes {num_processes}); "
            "give every process a distinct id in that range, 0 on the coordinator's host"
        )
    for name, value in (("init_timeout_s", init_timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1 second")

    if coordinator is not None:
        host, port = parse_coordinator(coordinator)
        who = f"process {process_id} of {num_processes}"
        if process_id == 0:
            _check_port_free(host, port)
        elif process_id is not None:
            _wait_for_coordinator(host, port, init_timeout_s, who)
        # If the coordinator waits for processes that never come, JAX aborts from C++ after
        # init_timeout_s with "DEADLINE_EXCEEDED ... RegisterTask"; this line says why.
        print(
            f"zshard.distributed: {who} registering with {host}:{port}; all {num_processes} processes must "
            f"register within {init_timeout_s} s (same --num-processes everywhere)",
            file=sys.stderr,
            flush=True,
        )
    # Cross-process collectives of the CPU backend (the only ones it has); no effect on GPUs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    _STATE.update(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
    if num_processes is not None and jax.process_count() != num_processes:
        # This process has joined a job of another size and cannot leave it cleanly (JAX's
        # shutdown barrier at exit would wait for the others): say why and exit, as JAX does
        # on its own fatal coordination errors; the others then see its heartbeats stop.
        print(
            f"zshard.distributed.initialize: error: --num-processes {num_processes} on process {process_id}, but the "
            f"coordinator {coordinator} runs {jax.process_count()} processes; give every process the same "
            "--num-processes. Exiting with status 2.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)
    return True
