"""The mesh's axes as one validated record, and a value's varying axes inside ``shard_map``.

:class:`MeshAxes` holds the degrees of the mesh (``replica``, ``shard``, ``context``, ``tensor``),
checked once, and answers every question a component asks about the axes (which exist, which the
data is split over, which ``shard_map`` is manual over, how many devices an axis tuple spans);
no other module reads an axis size from the mesh itself (torchtitan's ``ParallelDims``). A new
axis is one field here, one line of validation and one entry of :attr:`MeshAxes.names`.

:func:`vary` / :func:`varying_axes` read and set the varying-axes type of a value inside
``shard_map`` (``jax.typeof(x).manual_axis_type``); the collectives, the error-feedback
residuals and the step mark values with them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import jax

__all__ = ["AXES", "CONTEXT", "EXPERT", "MeshAxes", "REPLICA", "SHARD", "TENSOR", "vary", "varying_axes"]

REPLICA = "replica"
SHARD = "shard"
CONTEXT = "context"
TENSOR = "tensor"
EXPERT = "expert"
AXES = (REPLICA, SHARD)  # the batch axes: the batch dimension is split over them (and over context without a sequence axis)
# every axis tuple a zshard mesh may have, in order (expert with context or tensor: refused)
ALLOWED = (AXES, AXES + (TENSOR,), AXES + (CONTEXT,), AXES + (CONTEXT, TENSOR), AXES + (EXPERT,))


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The degrees of a zshard mesh ``(replica, shard[, expert | context][, tensor])``, validated once.

    Attributes:
      replica: ``R``, devices of the ``replica`` axis (hosts).
      shard: ``S``, devices of the ``shard`` axis (inside a host).
      context: ``C``, devices of the ``context`` axis (1: the mesh has no such axis).
      tensor: ``T``, devices of the ``tensor`` axis (1: the mesh has no such axis).
      expert: ``X``, devices of the ``expert`` axis (expert parallelism, docs/expert-parallel.md;
        1: the mesh has no such axis). A data axis: the batch rows are split over
        ``replica x shard x expert``, dense parameters FSDP-sharded over ``shard x expert``.
      names: the mesh's axis names, outer first; ``None``: ``("replica", "shard")`` followed by
        ``"expert"`` where ``X > 1``, ``"context"`` where ``C > 1`` and ``"tensor"`` where ``T > 1``
        (as :func:`zshard.make_mesh` builds it). A mesh may hold a ``context``, ``expert`` or
        ``tensor`` axis of size 1.

    Raises:
      ValueError: a degree that is not a positive integer, names out of zshard's order, or
        ``expert`` together with ``context`` or ``tensor`` (not supported: the fix named).
    """

    replica: int = 1
    shard: int = 1
    context: int = 1
    tensor: int = 1
    names: tuple[str, ...] | None = None
    expert: int = 1

    def __post_init__(self):
        for name in (REPLICA, SHARD, CONTEXT, TENSOR, EXPERT):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"MeshAxes: {name}={v!r} must be a positive integer (devices along the {name} axis)")
            object.__setattr__(self, name, int(v))
        if self.names is None:
            names = (AXES + ((EXPERT,) if self.expert > 1 else ()) + ((CONTEXT,) if self.context > 1 else ())
                     + ((TENSOR,) if self.tensor > 1 else ()))
            object.__setattr__(self, "names", names)
        names = tuple(self.names)
        if EXPERT in names and (CONTEXT in names or TENSOR in names):
            other = CONTEXT if CONTEXT in names else TENSOR
            raise ValueError(
                f"MeshAxes: axes {names}: the expert axis with a {other} axis is not supported (expert parallelism "
                f"composes with replica and shard only); drop {other}= or expert= from zshard.make_mesh "
                "(docs/expert-parallel.md)")
        if names not in ALLOWED:
            raise ValueError(f"MeshAxes: axes {names}; zshard's meshes have the axes "
                             f"{', '.join(map(str, ALLOWED[:-1]))} or {ALLOWED[-1]} (zshard.make_mesh builds them)")
        object.__setattr__(self, "names", names)
        for name, v in ((CONTEXT, self.context), (TENSOR, self.tensor), (EXPERT, self.expert)):
            if v > 1 and name not in self.names:
                raise ValueError(f"MeshAxes: {name}={v} but the axes {self.names} have no {name!r} axis")

    @classmethod
    def of(cls, mesh) -> "MeshAxes":
        """The record of a ``jax.sharding.Mesh`` (or anything with ``.shape``: axis name -> size).

        Raises:
          ValueError: an axis zshard does not know (the known ones named).
        """
        shape = dict(mesh.shape)
        return cls(**{a: int(v) for a, v in shape.items() if a in (REPLICA, SHARD, CONTEXT, TENSOR, EXPERT)}, names=tuple(shape))

    @property
    def context_enabled(self) -> bool:
        """The mesh has a ``context`` axis."""
        return CONTEXT in self.names

    @property
    def tensor_enabled(self) -> bool:
        """The mesh has a ``tensor`` axis."""
        return TENSOR in self.names

    @property
    def expert_enabled(self) -> bool:
        """The mesh has an ``expert`` axis."""
        return EXPERT in self.names

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every axis the data (batch rows or sequence chunks) is split over, ``("replica", "shard"[,
        "expert"][, "context"])``: the loss, metrics and statistics are reduced over them."""
        return AXES + ((EXPERT,) if self.expert_enabled else ()) + ((CONTEXT,) if self.context_enabled else ())

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes zshard's ``shard_map`` is manual over: all but ``tensor`` (the data axes)."""
        return self.data_axes

    @property
    def world(self) -> int:
        """Devices of the data axes, ``R*S*C``."""
        return self.size(self.data_axes)

    @property
    def rows(self) -> int:
        """Devices the batch rows split over when sequences are split over ``context``: ``R*S``
        (``R*S*X`` with an expert axis)."""
        return self.size(tuple(a for a in self.data_axes if a != CONTEXT))

    def size(self, axes: Sequence[str]) -> int:
        """Devices along ``axes`` (the product of their degrees; 1 for ``()``)."""
        return math.prod(getattr(self, a) for a in axes)

    def with_context(self, axes: Sequence[str]) -> tuple[str, ...]:
        """``axes`` with ``expert`` and ``context`` right after ``shard`` where the mesh has them (their
        devices are data-parallel for the dense parameters: FSDP over ``shard x expert`` or ``shard x
        context``, torchtitan's ``dp_shard`` / ``dp_shard_cp``); unchanged otherwise."""
        axes = tuple(axes)
        extra = tuple(a for a in (EXPERT, CONTEXT) if a in self.names)
        if not extra or SHARD not in axes:
            return axes
        at = axes.index(SHARD) + 1
        return axes[:at] + extra + axes[at:]

    @staticmethod
    def expert_axes(axes: Sequence[str]) -> tuple[str, ...]:
        """The at-rest axes of an expert parameter from a dense parameter's ``axes``: ``expert`` first
        (each device holds ``E/X`` whole experts), then the rest of ``axes`` (the FSDP split of those
        experts inside one expert group, over ``shard`` only; HYBRID's ``replica`` untouched)."""
        return (EXPERT,) + tuple(a for a in axes if a != EXPERT)

    @staticmethod
    def without_expert(axes: Sequence[str]) -> tuple[str, ...]:
        """``axes`` without ``expert``: what an expert parameter is gathered and its gradient
        reduce-scattered over (never over ``expert``: each expert lives in one expert group)."""
        return tuple(a for a in axes if a != EXPERT)

    def shape_dict(self) -> dict:
        """``{axis: size}`` of the mesh's axes, in order (as ``dict(mesh.shape)``)."""
        return {a: getattr(self, a) for a in self.names}


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over, inside ``shard_map`` (its type's manual-axis record)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Mark ``x`` as varying over ``axes`` (no data movement) where it is not already."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
