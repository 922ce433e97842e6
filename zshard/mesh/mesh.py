"""Hardware -> the ``("replica", "shard"[, "expert" | "context"][, "tensor"])`` device mesh, and the topology presets.

The presets are the repository's top-level ``meshes/*.toml``, installed as the package data
``zshard.meshes`` (``pyproject.toml`` maps the package onto that folder).

The mesh is the only topology zshard knows. ``shard`` is the fast axis (devices of one
host, NVLink): FULL_SHARD and HYBRID_SHARD all-gather parameters over it. ``replica`` is
the slow axis (hosts, InfiniBand): HYBRID_SHARD only all-reduces gradient shards over it.
``tensor`` (tensor parallelism, Megatron-LM arXiv 1909.08053) is innermost, inside one host:
the batch is not split over it, parameters that the model's TP plan splits are cut along one
dimension over it, and the compiler moves the activations (an ``Auto`` axis, while
``replica`` and ``shard`` are ``Explicit`` and manual inside zshard's ``shard_map``).
``context`` (context parallelism, docs/long-sequences.md) sits between ``shard`` and ``tensor``:
each sequence is split over it, parameters are FSDP-sharded over ``shard x context`` (its devices
are data-parallel for the parameters), and ``zshard.attention`` gathers keys and values over it.
It is ``Explicit`` and manual inside zshard's ``shard_map``, as the data axes are.
``expert`` (expert parallelism, docs/expert-parallel.md) sits right after ``shard``: a data axis
(the batch rows are split over ``replica x shard x expert``, dense parameters FSDP-sharded over
``shard x expert``), over which each expert parameter's expert dimension is split (``E/X`` whole
experts per device) and tokens travel by all-to-all (``zshard.moe``). One expert group stays
inside one host. ``Explicit`` and manual inside zshard's ``shard_map``. Not combined with
``context`` or ``tensor`` (refused, with the fix).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import tomllib
from importlib.resources.abc import Traversable
from pathlib import Path

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "AXES", "CONTEXT", "EXPERT", "REPLICA", "SHARD", "TENSOR", "MeshAxes", "MeshPreset", "context_size", "data_axes", "make_mesh", "manual_axes",
    "manual_specs", "mesh_preset", "mesh_presets", "parse_mesh", "sharded_map", "tensor_size", "tensor_specs",
]  # fmt: skip

from zshard.mesh.axes import AXES, CONTEXT, EXPERT, REPLICA, SHARD, TENSOR, MeshAxes  # noqa: F401  (the names, re-exported)


def preset_dir() -> Traversable:
    """The folder of the presets: the package ``zshard.meshes`` (installed, editable or not), or
    ``meshes/`` beside ``zshard/`` when the sources run from a checkout without being installed."""
    try:
        return importlib.resources.files("zshard.meshes")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent.parent / "meshes"


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


def make_mesh(
    replica: int | None = None, shard: int | None = None, tensor: int = 1, *, context: int = 1, expert: int = 1, devices=None
) -> Mesh:
    """Build the ``(replica, shard)`` mesh with explicit axis types (``(replica, shard[, context][,
    tensor])`` with ``context > 1`` / ``tensor > 1``).

    Args:
      replica: size of the ``replica`` axis (hosts; data-parallel groups of HYBRID_SHARD).
        Default: the number of processes, or ``len(devices) // shard``.
      shard: size of the ``shard`` axis (devices that split each parameter). Default:
        devices per process, or ``len(devices) // replica``. With neither given in a
        multi-process run, the grid comes from ``jax.experimental.mesh_utils.
        create_hybrid_device_mesh`` with each process as a granule: row ``r`` holds exactly
        the devices of process ``r``.
      context: size of the ``context`` axis (context parallelism: each sequence split over it;
        default 1: no such axis). Between ``shard`` and ``tensor``: each group of ``context *
        tensor`` consecutive devices holds one ``(replica, shard)`` position. Axis type
        ``AxisType.Explicit`` (manual inside zshard's ``shard_map``, as ``replica`` and ``shard``).
      tensor: size of the ``tensor`` axis (tensor parallelism; default 1: no such axis, the
        mesh is exactly the 2D one). Innermost: each group of ``tensor`` consecutive devices
        of one process is a tensor group, so tensor-parallel all-reduces stay inside a host.
        Its axis type is ``AxisType.Auto``: the compiler places activations over it.
      expert: size of the ``expert`` axis (expert parallelism, docs/expert-parallel.md; default 1: no
        such axis). Right after ``shard``: each group of ``expert`` consecutive devices (one process's)
        holds one ``(replica, shard)`` position, so the all-to-all of the tokens stays inside a host.
        A data axis (``AxisType.Explicit``, manual inside zshard's ``shard_map``): the batch rows are
        split over ``replica x shard x expert``. Not combined with ``context`` or ``tensor``.
      devices: the devices to lay out (default ``jax.devices()``), ordered by
        ``(process_index, id)`` so that one host's devices are adjacent on ``shard``.

    Returns:
      ``jax.sharding.Mesh`` of shape ``(replica, shard)``, axis names ``("replica", "shard")``,
      axis types ``(AxisType.Explicit, AxisType.Explicit)``; with ``tensor > 1`` of shape
      ``(replica, shard, tensor)``, axis names ``("replica", "shard", "tensor")``, types
      ``(Explicit, Explicit, Auto)``; with ``context > 1`` the axis ``"context"`` (Explicit) comes
      after ``"shard"``: ``("replica", "shard", "context"[, "tensor"])``; with ``expert > 1``
      ``("replica", "shard", "expert")``, all Explicit.

    Raises:
      ValueError: a size is not positive, or ``replica * shard * context * tensor`` is not the device
        count (the message lists every factorization of the device count), or (no sizes, many
        processes) the processes hold different numbers of devices, or a tensor or expert group
        would span two processes, or ``expert > 1`` with ``context > 1`` or ``tensor > 1``.
    """
    devices = _ordered_devices(jax.devices() if devices is None else list(devices))
    for name, size in ((REPLICA, replica), (SHARD, shard), (CONTEXT, context), (TENSOR, tensor), (EXPERT, expert)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1):
            raise ValueError(f"make_mesh: {name}={size!r} must be a positive integer")
    if expert > 1 and (context > 1 or tensor > 1):
        other = f"context={context}" if context > 1 else f"tensor={tensor}"
        raise ValueError(
            f"make_mesh: expert={expert} with {other} is not supported: expert parallelism composes with replica and "
            f"shard only (the expert axis is carved out of data parallelism); drop {other.split('=')[0]}= or expert= "
            "(docs/expert-parallel.md)"
        )
    if expert > 1:
        return _inner_mesh(devices, replica, shard, int(expert), 1, inner_axis=EXPERT)
    if tensor > 1 or context > 1:
        return _inner_mesh(devices, replica, shard, int(context), int(tensor))
    n = len(devices)
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


def _inner_mesh(devices: list, replica, shard, context: int, tensor: int, inner_axis: str = CONTEXT) -> Mesh:
    """The ``(replica, shard[, context][, tensor])`` mesh: ``context * tensor`` consecutive devices
    per ``(replica, shard)`` position, ``tensor`` consecutive ones (one process's) per tensor group.
    ``inner_axis="expert"``: the ``(replica, shard, expert)`` mesh, ``context`` read as the expert
    size, each expert group inside one process."""
    n, inner = len(devices), context * tensor
    CONTEXT = inner_axis  # noqa: N806  (the axis between shard and tensor: context, or expert)
    named = " x ".join(f"{a}={v}" for a, v in ((CONTEXT, context), (TENSOR, tensor)) if v > 1)
    if n % inner:
        what = f"tensor={tensor}" if context == 1 else f"{CONTEXT}={context} x tensor={tensor}" if tensor > 1 else f"{CONTEXT}={context}"
        raise ValueError(f"make_mesh: {what} does not divide the {n} devices; valid {'tensor' if context == 1 else 'inner'} sizes: "
                         f"{', '.join(str(t) for t in range(1, n + 1) if n % t == 0)}")
    groups = n // inner
    procs = len({d.process_index for d in devices})
    if replica is None and shard is None:
        replica = procs if procs > 1 else 1
        shard = groups // replica if groups % replica == 0 else 0
    elif replica is None:
        replica = groups // shard if groups % shard == 0 else 0
    elif shard is None:
        shard = groups // replica if groups % replica == 0 else 0
    if replica * shard * inner != n or replica == 0 or shard == 0:
        tail = "".join(f"x{v}" for v in (context, tensor) if v > 1)
        names = " x ".join(["replica", "shard"] + [a for a, v in ((CONTEXT, context), (TENSOR, tensor)) if v > 1])
        shapes = [f"{r}x{groups // r}{tail}" for r in range(1, groups + 1) if groups % r == 0]
        raise ValueError(
            f"make_mesh: replica={replica} x shard={shard} x {named} does not use the {n} available devices; "
            f"valid ({names}) shapes with {named.replace(' x ', ', ')}: {', '.join(shapes)}"
        )
    axes = AXES + ((CONTEXT,) if context > 1 else ()) + ((TENSOR,) if tensor > 1 else ())
    sizes = (replica, shard) + ((context,) if context > 1 else ()) + ((tensor,) if tensor > 1 else ())
    grid = np.asarray(devices, dtype=object).reshape(replica, shard, context, tensor)
    for r, s in np.ndindex(replica, shard):
        group = {d.process_index for d in grid[r, s].reshape(-1)}
        if inner_axis == EXPERT and len(group) > 1:  # the all-to-all of the tokens must stay on a host's links
            raise ValueError(
                f"make_mesh: the expert group at replica={r}, shard={s} spans processes {sorted(group)}; an expert group "
                f"(its all-to-all of the tokens) must stay inside one host: use an expert size that divides the devices "
                f"per process ({sum(d.process_index == devices[0].process_index for d in devices)})"
            )
    for r, s, c in np.ndindex(replica, shard, context):
        if tensor > 1 and len({d.process_index for d in grid[r, s, c]}) > 1:
            raise ValueError(
                f"make_mesh: the tensor group at replica={r}, shard={s}{f', context={c}' if context > 1 else ''} spans processes "
                f"{sorted({d.process_index for d in grid[r, s, c]})}; tensor-parallel all-reduces must stay inside one host: "
                f"use a tensor size that divides the devices per process ({sum(d.process_index == 0 for d in devices)})"
            )
    types = (AxisType.Explicit,) * (len(axes) - (tensor > 1)) + ((AxisType.Auto,) if tensor > 1 else ())
    return Mesh(grid.reshape(sizes), axes, axis_types=types)


def tensor_size(mesh) -> int:
    """``T``: devices of the mesh's ``tensor`` axis (1 without one; :class:`~zshard.mesh.axes.MeshAxes`)."""
    return MeshAxes.of(mesh).tensor


def context_size(mesh) -> int:
    """``C``: devices of the mesh's ``context`` axis (1 without one; :class:`~zshard.mesh.axes.MeshAxes`)."""
    return MeshAxes.of(mesh).context


def manual_axes(mesh) -> tuple[str, ...]:
    """The mesh axes zshard's ``shard_map`` is manual over: all but ``tensor``
    (:attr:`zshard.mesh.axes.MeshAxes.manual_axes`)."""
    return MeshAxes.of(mesh).manual_axes


def data_axes(mesh) -> tuple[str, ...]:
    """The data axes of ``mesh``, ``("replica", "shard"[, "context"])``
    (:attr:`zshard.mesh.axes.MeshAxes.data_axes`)."""
    return MeshAxes.of(mesh).data_axes


def _strip(spec: P) -> P:
    """``spec`` without the ``tensor`` axis (its dimensions left to the compiler)."""
    out = []
    for entry in spec:
        if entry == TENSOR:
            out.append(None)
        elif isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != TENSOR)
            out.append(kept if kept else None)
        else:
            out.append(entry)
    return P(*out)


def manual_specs(tree):
    """A PartitionSpec tree with ``tensor`` removed: the ``in_specs`` / ``out_specs`` of a
    ``shard_map`` that is manual over the data axes only."""
    return jax.tree.map(_strip, tree, is_leaf=lambda x: isinstance(x, P))


def tensor_specs(tree):
    """A PartitionSpec tree with only its ``tensor`` entries (the rest ``None``): the sharding
    constraint that keeps an output of a partly manual ``shard_map`` split over ``tensor``."""

    def only(spec: P) -> P:
        return P(*[TENSOR if entry == TENSOR or (isinstance(entry, tuple) and TENSOR in entry) else None for entry in spec])

    return jax.tree.map(only, tree, is_leaf=lambda x: isinstance(x, P))


def sharded_map(fn, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map(fn)`` over the data axes, with ``tensor`` (where the mesh has it) left to
    the compiler: the specs' ``tensor`` entries are removed for the ``shard_map`` (manual over
    ``replica``, ``shard`` and ``context`` only, ``axis_names``) and the outputs are constrained to their
    ``tensor`` split (``with_sharding_constraint`` on the Auto axis), so a state that enters split
    over ``tensor`` leaves split the same way. Without a ``tensor`` axis: plain ``jax.shard_map``."""
    if TENSOR not in mesh.axis_names:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    inner = jax.shard_map(
        fn, mesh=mesh, in_specs=manual_specs(in_specs), out_specs=manual_specs(out_specs), axis_names=set(manual_axes(mesh))
    )
    constraints = tensor_specs(out_specs)

    def run(*args):
        out = inner(*args)
        return jax.tree.map(
            lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)) if any(e is not None for e in spec) else x,
            constraints, out, is_leaf=lambda x: isinstance(x, P),
        )

    return run


@dataclasses.dataclass(frozen=True)
class MeshPreset:
    """A named topology from ``meshes/NAME.toml``.

    Attributes:
      name: file stem, e.g. ``"cpu-2x4"``.
      replica: replica-axis size (hosts).
      shard: shard-axis size (devices per host, or groups of ``tensor`` devices).
      platform: ``"cpu"`` (emulated devices) or ``"gpu"``.
      description: one line for humans.
      tensor: tensor-axis size (1: no tensor axis).
    """

    name: str
    replica: int
    shard: int
    platform: str
    description: str = ""
    tensor: int = 1

    @property
    def devices(self) -> int:
        return self.replica * self.shard * self.tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """``(replica, shard)``, or ``(replica, shard, tensor)`` with a tensor axis."""
        return (self.replica, self.shard) + ((self.tensor,) if self.tensor > 1 else ())


def mesh_presets() -> dict[str, MeshPreset]:
    """All presets in ``meshes/`` (:func:`preset_dir`), by name."""
    out = {}
    for path in sorted((p for p in preset_dir().iterdir() if p.name.endswith(".toml")), key=lambda p: p.name):
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        name = path.name.removesuffix(".toml")
        out[name] = MeshPreset(
            name=name,
            replica=int(raw["replica"]),
            shard=int(raw["shard"]),
            platform=str(raw.get("platform", "cpu")),
            description=str(raw.get("description", "")),
            tensor=int(raw.get("tensor", 1)),
        )
    return out


def mesh_preset(name: str) -> MeshPreset:
    """The preset ``meshes/NAME.toml``; ``ValueError`` listing the known names if missing."""
    presets = mesh_presets()
    if name not in presets:
        raise ValueError(f"unknown mesh preset {name!r}; known presets: {', '.join(presets)} (or give RxS[xT], e.g. 2x4 or 1x4x2)")
    return presets[name]


def parse_mesh(spec: str) -> tuple[int, ...]:
    """``"RxS"``, ``"RxSxT"`` or a preset name -> ``(replica, shard)``, or ``(replica, shard,
    tensor)`` for ``RxSxT`` and presets with a tensor axis (``T > 1``; ``"2x4x1"`` is ``(2, 4)``).

    Raises:
      ValueError: neither an ``RxS[xT]`` shape nor a known preset; a size below 1.
    """
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", spec)
    if m:
        sizes = tuple(int(g) for g in m.groups() if g is not None)
        if min(sizes) < 1:
            raise ValueError(f"mesh {spec!r}: every size must be >= 1")
        return sizes[:2] if len(sizes) == 3 and sizes[2] == 1 else sizes
    return mesh_preset(spec).shape
