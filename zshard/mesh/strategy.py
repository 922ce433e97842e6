"""Sharding strategies: which mesh axes split the model state, and which only replicate it.

Semantics follow PyTorch FSDP (arXiv 2304.11277, section 3.2) and ZeRO (arXiv 1910.02054,
section 5); docs/design.md section 3 has the table.
"""

from __future__ import annotations

import enum

from zshard.mesh.axes import REPLICA, SHARD, MeshAxes

__all__ = ["ReplicaReduce", "Strategy", "with_context"]


def with_context(axes: tuple[str, ...], mesh) -> tuple[str, ...]:
    """``axes`` on ``mesh``: ``expert`` / ``context`` inserted right after ``shard`` where the mesh has
    one (their devices are data-parallel for the dense parameters: FSDP over ``shard x expert`` or
    ``shard x context``, torchtitan's ``dp_shard`` / ``dp_shard_cp``); unchanged otherwise
    (docs/long-sequences.md, docs/expert-parallel.md)."""
    return MeshAxes.of(mesh).with_context(axes)


class Strategy(enum.Enum):
    """How parameters, gradients and optimizer state are split over the ``(replica, shard)`` mesh.

    "World" is both mesh axes, ``R*S`` devices. PyTorch FSDP names; ZeRO stages in brackets.
    The axes named here are those of a mesh without ``context``; on a mesh with one, every axis
    tuple that holds ``shard`` holds ``context`` right after it (:func:`with_context`: the
    parameters are split, and their gradients reduced, over ``shard x context``); likewise
    ``expert`` for the dense parameters, while an expert parameter is split over ``expert`` and
    FSDP-sharded over these axes without it (docs/expert-parallel.md).

    - ``NO_SHARD`` (ZeRO-0, DDP): everything replicated; gradients all-reduced over world.
    - ``SHARD_OPT`` (ZeRO-1): parameters replicated, optimizer state sharded over world;
      gradients all-reduced, each device updates its slice, updated parameters all-gathered.
    - ``SHARD_GRAD_OP`` (ZeRO-2): parameters sharded over world at rest, gathered once per
      step and kept through backward; gradients reduce-scattered.
    - ``FULL_SHARD`` (ZeRO-3): everything sharded over world; each unit is all-gathered
      before forward and again before backward, gradients reduce-scattered.
    - ``HYBRID_SHARD``: FULL_SHARD inside each ``shard`` group, replicated over ``replica``;
      only the gradient *shard* is all-reduced across ``replica``.
    - ``HYBRID_SHARD_ZERO2``: SHARD_GRAD_OP inside each ``shard`` group, replicated over
      ``replica``.
    - ``HYBRID_SHARD_OPT``: HYBRID_SHARD for the parameters (at rest over ``shard``, gathered
      over ``shard`` only), but gradients and optimizer state sharded over all ``R*S`` devices:
      gradients reduce-scatter over ``shard``, then over ``replica``; each device updates its
      ``1/(R*S)`` slice and the updated slices are all-gathered over ``replica`` once per step.
      DeepSpeed ZeRO++ hpZ (``zero_hpz_partition_size=S``, arXiv 2306.10209 section 3.2) and
      FSDP2 HSDP with the optimizer state sharded across replicas; docs/memory.md has the map.
    """

    NO_SHARD = "NO_SHARD"
    SHARD_OPT = "SHARD_OPT"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    FULL_SHARD = "FULL_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"
    HYBRID_SHARD_OPT = "HYBRID_SHARD_OPT"

    @classmethod
    def parse(cls, value: "Strategy | str | None" = None, *, zero_stage: int | None = None) -> "Strategy":
        """A ``Strategy``, its name (case-insensitive; FSDP's ``_HYBRID_SHARD_ZERO2`` too), or
        DeepSpeed's ``zero_stage`` 0/1/2/3 -> ``Strategy``.

        Raises:
          ValueError: an unknown name or stage, or a name and a stage that disagree; the
            message lists the known values.
        """
        if zero_stage is not None:
            stages = {0: cls.NO_SHARD, 1: cls.SHARD_OPT, 2: cls.SHARD_GRAD_OP, 3: cls.FULL_SHARD}
            if zero_stage not in stages:
                raise ValueError(f"zero_stage={zero_stage!r}; choose 0, 1, 2 or 3 (aliases of {', '.join(m.value for m in stages.values())})")
            from_stage = stages[zero_stage]
            if value is not None and cls.parse(value) is not from_stage:
                raise ValueError(f"strategy={value!r} contradicts zero_stage={zero_stage} ({from_stage.value}); give one of them")
            return from_stage
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper().lstrip("_")
            for member in cls:
                if member.value == key:
                    return member
        known = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown strategy {value!r}; choose one of: {known} (or zero_stage=0/1/2/3)")

    @property
    def zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage of the non-hybrid strategies (``None`` for the hybrids)."""
        return {"NO_SHARD": 0, "SHARD_OPT": 1, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3}.get(self.value)

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes a parameter's FlatParameter is split over at rest (all-gather / reduce-scatter)."""
        if self in (Strategy.NO_SHARD, Strategy.SHARD_OPT):
            return ()
        if self in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2, Strategy.HYBRID_SHARD_OPT):
            return (SHARD,)
        return (REPLICA, SHARD)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes the parameters are replicated over (their gradients all-reduced over)."""
        return tuple(a for a in (REPLICA, SHARD) if a not in self.shard_axes)

    @property
    def opt_axes(self) -> tuple[str, ...]:
        """Mesh axes the optimizer state is split over, major first (SHARD_OPT: world;
        HYBRID_SHARD_OPT: ``(shard, replica)``, each parameter shard split again over
        ``replica``; else as the parameters)."""
        if self is Strategy.SHARD_OPT:
            return (REPLICA, SHARD)
        if self is Strategy.HYBRID_SHARD_OPT:
            return (SHARD, REPLICA)
        return self.shard_axes

    @property
    def scatters_replica(self) -> bool:
        """Gradients are reduce-scattered over ``replica`` to the optimizer's slices in each
        unit's backward, not all-reduced: HYBRID_SHARD_OPT (docs/memory.md)."""
        return self is Strategy.HYBRID_SHARD_OPT

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP's ``reshard_after_forward``: drop gathered units after forward, gather again in backward."""
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_OPT)


class ReplicaReduce(enum.Enum):
    """Who sums a gradient over the replica axes (``Strategy.replica_axes``), and when.

    The one decision of a step about the cross-replica reduction (FSDP2's
    ``foreach_reduce(..., all_reduce_grads)``, levanter's ``ReductionType``), resolved once by
    :meth:`resolve` and carried by the units' communication record
    (:class:`zshard.wire.grad_exit.GradExit`); every place that reduces a gradient matches on it.

    - ``NONE``: nothing to sum over replicas (the parameters are split over every mesh axis:
      FULL_SHARD, SHARD_GRAD_OP), or nothing is differentiated (the eval step, a forward).
    - ``PER_UNIT``: each unit's backward all-reduces its reduce-scattered gradient *shard* over
      the replica axes (HYBRID_SHARD, HYBRID_SHARD_ZERO2; NO_SHARD and SHARD_OPT, whose replica
      axes are the whole mesh, all-reduce the whole gradient).
    - ``PER_STEP``: gradient accumulation (``grad_accum > 1``): the units reduce-scatter over
      the shard axes only and the accumulated shard is all-reduced over replicas once per step
      (FSDP2's ``set_requires_all_reduce(False)`` on all but the last micro-batch).
    - ``TO_SLICES``: HYBRID_SHARD_OPT: each unit's backward reduce-scatters its gradient shard
      over the replica axes into the optimizer's slices, the cotangents of the slices' exit
      values (zshard/wire/grad_exit.py, docs/memory.md), in every micro-batch. ``TO_SINKS``: its
      former name, an alias for one release.
    """

    NONE = "none"
    PER_UNIT = "per_unit"
    PER_STEP = "per_step"
    TO_SLICES = "to_slices"
    TO_SINKS = "to_slices"  # the former name (an alias of TO_SLICES), kept for one release

    @classmethod
    def resolve(cls, strategy: Strategy, grad_accum: int = 1, *, differentiated: bool = True) -> "ReplicaReduce":
        """The reduction of a step of ``strategy`` with ``grad_accum`` micro-batches
        (``differentiated=False``: a forward-only step)."""
        if not differentiated or not strategy.replica_axes:
            return cls.NONE
        if strategy.scatters_replica:
            return cls.TO_SLICES
        return cls.PER_STEP if grad_accum > 1 else cls.PER_UNIT
