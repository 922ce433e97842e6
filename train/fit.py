"""Will the run fit, asked before its first step: ``python -m train`` compares the compiled train
and eval steps' per-device memory with what each device has and refuses a run that cannot fit,
in one line naming the numbers and the cheapest fixes (exit 2; ``--no-fit-check`` skips it).

Need, per device: ``argument + output - alias + temp`` of the compiled step's
``memory_analysis()`` (XLA's buffer assignment: the inputs, the outputs not written in place
of a donated input, and the temporaries at their peak), the larger of the train and eval steps.

Have, per device (what the device may use at most, not what is free this second):

- GPU / TPU: ``device.memory_stats()["bytes_limit"]``, the memory JAX's allocator may use
  on the device (the state already placed there is part of both sides);
- CPU: the host's memory (``MemTotal`` of ``/proc/meminfo``, or the cgroup memory limit when
  it is lower) shared by this process's emulated devices. Processes sharing one host each see
  the whole of it. Free memory is not the measure: it moves from second to second with other
  processes and the page cache (the available-memory reading this check used before,
  ``MemAvailable`` or the cgroup's limit less its usage, once gave 0.8 MiB on a 24 GB CI
  machine and refused a nano run needing 0.7 MiB per device), and a refusal must say the same
  thing each time it is asked.

Several processes: every process's need and have are all-gathered, and every process stops
when any one does not fit (the one with the least room is named).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["Fit", "check", "fixes", "host_memory_bytes", "refusal", "step_bytes"]

GiB = 2**30
_NO_LIMIT = 2**60  # a cgroup "limit" at least this large is no limit


def step_bytes(mem: dict | None) -> int:
    """``argument + output - alias + temp`` of a ``memory_analysis()`` dict (bytes per device); 0 for ``None``."""
    if not mem:
        return 0
    return int(mem["argument"]) + int(mem["output"]) - int(mem.get("alias", 0)) + int(mem["temp"])


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``);
    ``None`` without one (``max``, or v1's "no limit" of about 2**63)."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        limit = _read_int(root / name)
        if limit is not None and limit < _NO_LIMIT:
            return limit
    return None


def host_memory_bytes() -> int | None:
    """The host memory this process may use: ``MemTotal``, or the cgroup limit when lower (bytes)."""
    values = [v for v in (_meminfo_total(), _cgroup_limit()) if v is not None]
    return min(values) if values else None


@dataclasses.dataclass
class Fit:
    """One process's side of the check (bytes).

    Attributes:
      need: per device, the larger of the train and eval steps' ``argument + output - alias + temp``.
      have: per device, what it may use (see the module docstring); ``None``: unknown (not checked).
      platform: ``"cpu"``, ``"gpu"``, ...
      devices: this process's devices.
      host: CPU: the host's memory (bytes, shared by ``devices``); else 0.
    """

    need: int
    have: int | None
    platform: str
    devices: int
    host: int = 0

    @property
    def fits(self) -> bool:
        return self.have is None or self.need <= self.have


def local_fit(train_mem: dict, eval_mem: dict | None, devices) -> Fit:
    """This process's :class:`Fit`: ``devices`` its devices (``jax.local_devices()`` of the mesh)."""
    need = max(step_bytes(train_mem), step_bytes(eval_mem))
    platform = devices[0].platform
    if platform == "cpu":
        host = host_memory_bytes()
        return Fit(need, None if host is None else host // len(devices), platform, len(devices), host or 0)
    limits = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" in stats:
            limits.append(int(stats["bytes_limit"]))
    return Fit(need, min(limits) if limits else None, platform, len(devices))


def _b(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def fixes(run, strategy: str, mem: dict, n_devices: int) -> list[str]:
    """The cheapest changes that lower the per-device need, the larger part's first: activations
    (``temp``) or the model state (``argument``)."""
    t = run.training
    acts = []
    if t.remat != "block":
        acts.append("--remat block (recompute each block in backward)")
    if t.batch_size % (n_devices * t.grad_accum * 2) == 0:
        acts.append(f"--grad-accum {2 * t.grad_accum} (the same global batch in twice the micro-batches)")
    if (t.batch_size // 2) % (n_devices * t.grad_accum) == 0 and t.batch_size >= 2:
        acts.append(f"--batch-size {t.batch_size // 2}")
    if run.model.seq_len >= 2:
        acts.append(f"--seq-len {run.model.seq_len // 2}")
    state = []
    if strategy in ("NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP"):
        state.append("--strategy FULL_SHARD (parameters, gradients and optimizer state sharded over all devices)")
    elif strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        state.append("--strategy HYBRID_SHARD_OPT (optimizer state over all devices) or FULL_SHARD")
    state.append("more devices")
    order = acts + state if int(mem["temp"]) >= int(mem["argument"]) else state + acts
    return order


def refusal(fit: Fit, process: int, processes: int, mem: dict, eval_mem: dict | None, fix: list[str]) -> str:
    """The one line of a run that does not fit (without the ``python -m train: error:`` prefix)."""
    parts = (f"argument {_b(mem['argument'])} + output {_b(mem['output'])} - alias {_b(mem.get('alias', 0))} "
             f"+ temp {_b(mem['temp'])}")
    ev = f"; the eval step {_b(step_bytes(eval_mem))}" if eval_mem else ""
    who = f" on process {process} of {processes}" if processes > 1 else ""
    if fit.platform == "cpu":
        have = f"each of the {fit.devices} cpu devices{who} has {_b(fit.have)} (the host's {_b(fit.host)}, shared by {fit.devices} emulated devices)"
    else:
        have = f"each {fit.platform} device{who} has {_b(fit.have)} (memory_stats()['bytes_limit'])"
    largest = "temp (activations)" if int(mem["temp"]) >= int(mem["argument"]) else "argument (the model state)"
    return (f"the run does not fit: the compiled step needs {_b(fit.need)} per device ({parts}{ev}), but {have}; "
            f"{largest} is the largest part: try {', '.join(fix)}; or --no-fit-check to run it anyway")


def check(run, strategy: str, train_mem: dict | None, eval_mem: dict | None, devices) -> str | None:
    """The refusal line when this run cannot fit on some process, else ``None``.

    Args:
      run: the ``train.config.Config``.
      strategy: its strategy name.
      train_mem, eval_mem: the compiled steps' ``memory_analysis()`` as dicts (argument, output,
        temp, alias; bytes per device), ``None`` where XLA gives none (then nothing is checked).
      devices: every device of the mesh.

    Every process calls it (it all-gathers with several processes).
    """
    if train_mem is None:
        return None
    me = jax.process_index()
    mine = [d for d in devices if d.process_index == me]
    fit = local_fit(train_mem, eval_mem, mine)
    procs = jax.process_count()
    row = np.array([fit.need, -1 if fit.have is None else fit.have, fit.host], np.int64)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(procs, 3) if procs > 1 else row[None]
    room = [(r[1] - r[0]) if r[1] >= 0 else np.inf for r in rows]
    worst = int(np.argmin(room))
    if room[worst] >= 0:
        return None
    need, have, host = (int(x) for x in rows[worst])
    fit = dataclasses.replace(fit, need=need, have=have, host=host)
    return refusal(fit, worst, procs, train_mem, eval_mem, fixes(run, strategy, train_mem, len(devices)))
