"""The wire: how each parameter's bytes travel, decided once, read by the collectives.

[Note: the wire record] :class:`ParamWire` is one frozen record per parameter: the mesh axes its
shard is all-gathered and its gradient reduce-scattered over, the axes it is replicated over,
the dtypes on the wire, the quantized format of each collective *where that format quantizes
this parameter* (``None`` elsewhere: its shape, the devices its buffer splits over and the
format's block decide, :func:`zshard.wire.quant.quantizes`), whether it travels in tensor pieces
([Note: tensor pieces], zshard/wire/collectives.py) and whether error feedback keeps a residual
for it. :func:`resolve_wires` fills the records from the strategy, the mesh axes
(:class:`~zshard.mesh.axes.MeshAxes`), the mixed precision and the formats; the planner calls it
once (``Plan.wires``). The collectives, hpZ and the gradient exit read the record and never
decide again (PyTorch FSDP2: a parameter group's collective options are fixed by
``fully_shard`` and passed to ``foreach_all_gather`` / ``foreach_reduce`` as values). A new format
or axis is a field here and a line in :func:`resolve_wires`.

:class:`UnitComm` is the step's part: what every unit call of one step shares (the replica
reduction, remat, reshard after forward, hpZ) and the plan's wires.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from zshard.wire.grad_exit import GradExit
from zshard.wire.precision import FULL_PRECISION, MixedPrecision
from zshard.wire.quant import Quant, quantizes
from zshard.mesh.axes import MeshAxes
from zshard.mesh.strategy import ReplicaReduce

__all__ = ["ParamWire", "UnitComm", "resolve_wire", "resolve_wires"]


@dataclasses.dataclass(frozen=True)
class ParamWire:
    """How one parameter's bytes travel (one per parameter, ``Plan.wires[path]``).

    Attributes:
      path: the parameter's path.
      shard_axes: mesh axes its shard is all-gathered and its gradient reduce-scattered over
        (``Plan.shard_axes``, without ``expert`` for an expert parameter; ``()``: replicated).
      replica_axes: mesh axes it is replicated over: its gathered value is marked varying over
        them and its gradient is summed over them as the gradient exit says.
      gather_dtype: the dtype it is all-gathered and computed in (``param_dtype`` for floats).
      reduce_dtype: the dtype its gradient is reduced in (``reduce_dtype``).
      gather_format: the :class:`~zshard.wire.quant.Quant` of its all-gather (qwZ), or ``None``: plain.
      reduce_format: the format of its shard-axis gradient reduction (qgZ), or ``None``.
      replica_format: the format of its replica-axis gradient reduction, or ``None``.
      pieces: split over ``tensor``: gathered and reduce-scattered piece by piece.
      residual: error feedback keeps an fp32 residual ``[n_pad]`` for it (trainable, and
        ``reduce_format`` set with ``error_feedback`` and quantizing it).
    """

    path: tuple
    shard_axes: tuple[str, ...]
    replica_axes: tuple[str, ...] = ()
    gather_dtype: Any = np.dtype(np.float32)
    reduce_dtype: Any = np.dtype(np.float32)
    gather_format: Quant | None = None
    reduce_format: Quant | None = None
    replica_format: Quant | None = None
    pieces: bool = False
    residual: bool = False

    @property
    def vary_axes(self) -> tuple[str, ...]:
        """Every axis the parameter's shard and gradient vary over inside the step: ``shard_axes + replica_axes``."""
        return self.shard_axes + self.replica_axes


def resolve_wire(rec, mp: MixedPrecision, shard_axes: tuple[str, ...], replica_axes: tuple[str, ...], num_shards: int,
                 world: int) -> ParamWire:
    """The :class:`ParamWire` of parameter ``rec`` (a :class:`~zshard.params.flat.ParamLayout`).

    ``num_shards``: ``N``, the devices of ``shard_axes`` (the gather and the shard-axis reduction
    split the buffer ``N`` ways); ``world``: the data devices (the replica reduction's all-to-all
    splits the shard ``[n_pad/N]`` ``R`` ways, the buffer ``world`` ways).

    An expert parameter (``rec.expert``) is gathered and reduce-scattered over ``shard_axes``
    without ``expert`` (``N/X`` devices: its expert group's FSDP split) and never reduced over
    ``expert``: each expert lives in one expert group (docs/expert-parallel.md)."""
    if rec.expert:
        shard_axes, num_shards = MeshAxes.without_expert(shard_axes), num_shards // rec.ep
    on = lambda fmt, parts, axes: fmt if axes and quantizes(fmt, rec, parts) else None  # noqa: E731
    reduce_format = on(mp.reduce_format, num_shards, shard_axes)
    return ParamWire(
        path=rec.path,
        shard_axes=tuple(shard_axes),
        replica_axes=tuple(replica_axes),
        gather_dtype=mp.gather_dtype(rec.dtype),
        reduce_dtype=mp.grad_dtype(rec.dtype),
        gather_format=on(mp.gather_format, num_shards, shard_axes),
        reduce_format=reduce_format,
        replica_format=on(mp.replica_format, world, replica_axes),
        pieces=bool(rec.split),
        residual=bool(rec.trainable and reduce_format is not None and reduce_format.error_feedback),
    )


def resolve_wires(plan) -> dict[tuple, ParamWire]:
    """Every parameter's :class:`ParamWire` on ``plan`` (path -> record, in ``plan.layouts`` order)."""
    return {p: resolve_wire(rec, plan.mp, plan.shard_axes, plan.replica_axes, plan.num_shards, plan.world)
            for p, rec in plan.layouts.items()}


@dataclasses.dataclass(frozen=True)
class UnitComm:
    """How the units of one step communicate: the step's decisions, and the plan's wires.

    Attributes:
      shard_axes: mesh axes a parameter is split over at rest (all-gather, reduce-scatter).
      replica_axes: mesh axes the parameters are replicated over: a gradient is summed over
        them as ``replica_reduce`` says, and a gathered parameter is marked varying over them
        (its gradient stays each replica's own until it is reduced).
      replica_reduce: the step's :class:`~zshard.mesh.strategy.ReplicaReduce`.
      replica_parts: ``R``, devices along ``replica_axes`` (``TO_SLICES``: the gradient shard
        ``[n_pad/S]`` is reduce-scattered into ``R`` slices ``[n_pad/(R*S)]``).
      mp: the :class:`~zshard.MixedPrecision` (what the wires were resolved from).
      remat: the activation-checkpointing policy inside a unit (:func:`zshard.programs.unit_call.checkpointed`).
      reshard: reshard after forward (FULL_SHARD, HYBRID_SHARD): backward gathers again.
      hpz: ZeRO++ hpZ (zshard/wire/hpz.py): forward keeps ``[n_pad/S]`` slices; backward gathers them over ``shard``.
      wires: parameter path -> its :class:`ParamWire` (``Plan.wires``).
    """

    shard_axes: tuple[str, ...]
    replica_axes: tuple[str, ...] = ()
    replica_reduce: ReplicaReduce = ReplicaReduce.NONE
    replica_parts: int = 1
    mp: MixedPrecision = FULL_PRECISION
    remat: Any = "block"
    reshard: bool = True
    hpz: bool = False
    wires: Mapping = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def of(cls, plan, replica_reduce: ReplicaReduce, remat: Any = "block") -> "UnitComm":
        """The record of ``plan``'s units under ``replica_reduce`` and ``remat``."""
        st = plan.strategy
        return cls(
            plan.shard_axes,
            plan.replica_axes,
            replica_reduce,
            plan.opt_shards // plan.num_shards if st.scatters_replica else 1,
            plan.mp,
            remat,
            st.reshard_after_forward,
            wires=plan.wires,
        )

    def wire(self, rec) -> ParamWire:
        """The :class:`ParamWire` of parameter ``rec`` (a ParamLayout or a slot of one).

        Raises:
          KeyError: ``rec``'s path has no wire (a record that is not the plan's), named.
        """
        rec = getattr(rec, "param", rec)
        try:
            return self.wires[rec.path]
        except KeyError:
            raise KeyError(f"zshard: parameter {rec.path} has no wire record on this UnitComm; build it with "
                           "UnitComm.of(plan, ...) (Plan.wires, zshard/wire/wire.py)") from None

    @property
    def vary_axes(self) -> tuple[str, ...]:
        """The axes a gathered parameter must vary over besides ``shard_axes``: ``replica_axes``."""
        return self.replica_axes

    @property
    def exit(self) -> GradExit:
        """The step's :class:`~zshard.wire.grad_exit.GradExit`: how every unit's gradients leave."""
        to_slices = self.replica_reduce is ReplicaReduce.TO_SLICES
        return GradExit(self.replica_reduce, self.replica_axes, self.replica_parts if to_slices else 1, self.mp.error_feedback)
