"""Hardware -> the 2D ``("replica", "shard")`` device mesh, and the presets in ``zshard/meshes/``.

The mesh is the only topology zshard knows. ``shard`` is the fast axis (devices of one
host, NVLink): FULL_SHARD and HYBRID_SHARD all-gather parameters over it. ``replica`` is
the slow axis (hosts, InfiniBand): HYBRID_SHARD only all-reduces gradient shards over it.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

__all__ = ["AXES", "REPLICA", "SHARD", "MeshPreset", "make_mesh", "mesh_preset", "mesh_presets", "parse_mesh"]

REPLICA = "replica"
SHARD = "shard"
AXES = (REPLICA, SHARD)

PRESET_DIR = Path(__file__).resolve().parent / "meshes"  # package data: found after a non-editable install


def _factorizations(n: int) -> str:
    return ", ".join(f"{r}x{n // r}" for r in range(1, n + 1) if n % r == 0)


def _ordered_devices(devices) -> list:
    # Devices of one process (host) adjacent, so each row of the mesh is one host and the
    # shard axis stays on the fast intra-host link.
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _hybrid_grid(devices: list) -> np.ndarray:
    """``[processes, devices per process]`` grid from JAX's hybrid-mesh helper, each process a granule."""
    per = {}
    for d in devices:
        per.setdefault(d.process_index, []).append(d)
    counts = {p: len(ds) for p, ds in sorted(per.items())}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"make_mesh: processes hold different numbers of devices {counts} (process -> devices); "
            "give every process the same devices (e.g. --devices-per-proc), or pass replica=, shard= and devices="
        )
    local = next(iter(counts.values()))
    # [1, local] inside each process ("ICI") x [processes, 1] across processes ("DCN")
    return mesh_utils.create_hybrid_device_mesh((1, local), (len(per), 1), devices, process_is_granule=True)


def make_mesh(replica: int | None = None, shard: int | None = None, *, devices=None) -> Mesh:
    """Build the ``(replica, shard)`` mesh with explicit axis types.

    Args:
      replica: size of the ``replica`` axis (hosts; data-parallel groups of HYBRID_SHARD).
        Default: the number of processes, or ``len(devices) // shard``.
      shard: size of the ``shard`` axis (devices that split each parameter). Default:
        devices per process, or ``len(devices) // replica``. With neither given in a
        multi-process run, the grid comes from ``jax.experimental.mesh_utils.
        create_hybrid_device_mesh`` with each process as a granule: row ``r`` holds exactly
        the devices of process ``r``.
      devices: the devices to lay out (default ``jax.devices()``), ordered by
        ``(process_index, id)`` so that one host's devices are adjacent on ``shard``.

    Returns:
      ``jax.sharding.Mesh`` of shape ``(replica, shard)``, axis names ``("replica", "shard")``,
      axis types ``(AxisType.Explicit, AxisType.Explicit)``.

    Raises:
      ValueError: a size is not positive, or ``replica * shard`` is not the device count
        (the message lists every factorization of the device count), or (no sizes, many
        processes) the processes hold different numbers of devices.
    """
    devices = _ordered_devices(jax.devices() if devices is None else list(devices))
    n = len(devices)
    for name, size in ((REPLICA, replica), (SHARD, shard)):
        if size is not None and (not isinstance(size, (int, np.integer)) or size < 1):
            raise ValueError(f"make_mesh: {name}={size!r} must be a positive integer")
    if replica is None and shard is None and len({d.process_index for d in devices}) > 1:
        # One row per process (host): replica = processes, shard = that process's devices,
        # so HYBRID_SHARD's gathers and reduce-scatters never leave a process.
        return Mesh(_hybrid_grid(devices), AXES, axis_types=(AxisType.Explicit, AxisType.Explicit))
    if replica is None and shard is None:
        replica, shard = 1, n
    elif replica is None:
        replica = n // shard if n % shard == 0 else 0
    elif shard is None:
        shard = n // replica if n % replica == 0 else 0
    if replica * shard != n or replica == 0:
        want = replica * shard
        if want > n:  # more devices than there are: on CPU, emulate them
            fix = (f"Only {n} device(s) here: for {want} emulated CPU devices call "
                   f'jax.config.update("jax_num_cpu_devices", {want}) before jax first runs '
                   "(docs/main-job.md), or pick one of these shapes.")
        else:
            fix = f"Pick one of these, or pass devices=jax.devices()[:{want}]."
        raise ValueError(
            f"make_mesh: replica={replica} x shard={shard} does not use the {n} available "
            f"devices; valid (replica x shard) shapes for {n} devices: {_factorizations(n)}. {fix}"
        )
    grid = np.asarray(devices, dtype=object).reshape(replica, shard)
    return Mesh(grid, AXES, axis_types=(AxisType.Explicit, AxisType.Explicit))


@dataclasses.dataclass(frozen=True)
class MeshPreset:
    """A named topology from ``zshard/meshes/NAME.toml``.

    Attributes:
      name: file stem, e.g. ``"cpu-2x4"``.
      replica: replica-axis size (hosts).
      shard: shard-axis size (devices per host).
      platform: ``"cpu"`` (emulated devices) or ``"gpu"``.
      description: one line for humans.
    """

    name: str
    replica: int
    shard: int
    platform: str
    description: str = ""

    @property
    def devices(self) -> int:
        return self.replica * self.shard


def mesh_presets() -> dict[str, MeshPreset]:
    """All presets in ``zshard/meshes/``, by name."""
    out = {}
    for path in sorted(PRESET_DIR.glob("*.toml")):
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        out[path.stem] = MeshPreset(
            name=path.stem,
            replica=int(raw["replica"]),
            shard=int(raw["shard"]),
            platform=str(raw.get("platform", "cpu")),
            description=str(raw.get("description", "")),
        )
    return out


def mesh_preset(name: str) -> MeshPreset:
    """The preset ``zshard/meshes/NAME.toml``; ``ValueError`` listing the known names if missing."""
    presets = mesh_presets()
    if name not in presets:
        raise ValueError(f"unknown mesh preset {name!r}; known presets: {', '.join(presets)} (or give RxS, e.g. 2x4)")
    return presets[name]


def parse_mesh(spec: str) -> tuple[int, int]:
    """``"RxS"`` or a preset name -> ``(replica, shard)``.

    Raises:
      ValueError: neither an ``RxS`` shape nor a known preset.
    """
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if m:
        r, s = int(m.group(1)), int(m.group(2))
        if r < 1 or s < 1:
            raise ValueError(f"mesh {spec!r}: both sizes must be >= 1")
        return r, s
    preset = mesh_preset(spec)
    return preset.replica, preset.shard
