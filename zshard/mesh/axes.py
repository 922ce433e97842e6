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

__all__ = ["AXES", "CONTEXT", "MeshAxes", "REPLICA", "SHARD", "TENSOR", "vary", "varying_axes"]

REPLICA = "replica"
SHARD = "shard"
CONTEXT = "context"
TENSOR = "tensor"
AXES = (REPLICA, SHARD)  # the batch axes: the batch dimension is split over them (and over context without a sequence axis)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The degrees of a zshard mesh ``(replica, shard[, context][, tensor])``, validated once.

    Attributes:
      replica: ``R``, devices of the ``replica`` axis (hosts).
      shard: ``S``, devices of the ``shard`` axis (inside a host).
      context: ``C``, devices of the ``context`` axis (1: the mesh has no such axis).
      tensor: ``T``, devices of the ``tensor`` axis (1: the mesh has no such axis).
      names: the mesh's axis names, outer first; ``None``: ``("replica", "shard")`` followed by
        ``"context"`` where ``C > 1`` and ``"tensor"`` where ``T > 1`` (as :func:`zshard.make_mesh`
        builds it). A mesh may hold a ``context`` or ``tensor`` axis of size 1.

    Raises:
      ValueError: a degree that is not a positive integer, or names out of zshard's order
        (each named).
    """

    replica: int = 1
    shard: int = 1
    context: int = 1
    tensor: int = 1
    names: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in (REPLICA, SHARD, CONTEXT, TENSOR):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"MeshAxes: {name}={v!r} must be a positive integer (devices along the {name} axis)")
            object.__setattr__(self, name, int(v))
        if self.names is None:
            names = AXES + ((CONTEXT,) if self.context > 1 else ()) + ((TENSOR,) if self.tensor > 1 else ())
            object.__setattr__(self, "names", names)
        allowed = (AXES, AXES + (TENSOR,), AXES + (CONTEXT,), AXES + (CONTEXT, TENSOR))
        if tuple(self.names) not in allowed:
            raise ValueError(f"MeshAxes: axes {tuple(self.names)}; zshard's meshes have the axes {AXES}, {AXES + (TENSOR,)}, "
                             f"{AXES + (CONTEXT,)} or {AXES + (CONTEXT, TENSOR)} (zshard.make_mesh builds them)")
        object.__setattr__(self, "names", tuple(self.names))
        for name, v in ((CONTEXT, self.context), (TENSOR, self.tensor)):
            if v > 1 and name not in self.names:
                raise ValueError(f"MeshAxes: {name}={v} but the axes {self.names} have no {name!r} axis")

    @classmethod
    def of(cls, mesh) -> "MeshAxes":
        """The record of a ``jax.sharding.Mesh`` (or anything with ``.shape``: axis name -> size).

        Raises:
          ValueError: an axis zshard does not know (the known ones named).
        """
        shape = dict(mesh.shape)
        return cls(**{a: int(v) for a, v in shape.items() if a in (REPLICA, SHARD, CONTEXT, TENSOR)}, names=tuple(shape))

    @property
    def context_enabled(self) -> bool:
        """The mesh has a ``context`` axis."""
        return CONTEXT in self.names

    @property
    def tensor_enabled(self) -> bool:
        """The mesh has a ``tensor`` axis."""
        return TENSOR in self.names

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every axis the data (batch rows or sequence chunks) is split over, ``("replica", "shard"[,
        "context"])``: the loss, metrics and statistics are reduced over them."""
        return AXES + ((CONTEXT,) if self.context_enabled else ())

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
        """Devices the batch rows split over when sequences are split over ``context``: ``R*S``."""
        return self.size(AXES)

    def size(self, axes: Sequence[str]) -> int:
        """Devices along ``axes`` (the product of their degrees; 1 for ``()``)."""
        return math.prod(getattr(self, a) for a in axes)

    def with_context(self, axes: Sequence[str]) -> tuple[str, ...]:
        """``axes`` with ``context`` right after ``shard`` where the mesh has a context axis (its
        devices are data-parallel for the parameters: FSDP over ``shard x context``, torchtitan's
        ``dp_shard_cp``); unchanged otherwise."""
        axes = tuple(axes)
        if not self.context_enabled or SHARD not in axes:
            return axes
        at = axes.index(SHARD) + 1
        return axes[:at] + (CONTEXT,) + axes[at:]

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
