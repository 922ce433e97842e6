"""The gradient exit: how a unit's gradients leave its backward, and the one reduce path.

[Note: gradient exit] :class:`GradExit` is the step's one record of how every gradient leaves a
unit: reduce-scattered over the shard axes (each parameter's format and dtype on its
:class:`~zshard.wire.ParamWire`), then over the replica axes as ``reduce`` says
(:class:`~zshard.mesh.strategy.ReplicaReduce`), landing either in the parameter shard's cotangent
(``[n_pad/N]``) or, HYBRID_SHARD_OPT, in its optimizer slice ``[n_pad/(R*S)]``; with error
feedback each quantized gradient takes its residual along and hands the new one back. Where a
gradient lands in an optimizer slice or carries a residual, the unit call is given an *exit
value* per parameter (the slice placeholder, or the residual); the step differentiates with
respect to those values, and the backward returns the slice or the new residual as their
cotangent. :meth:`GradExit.check` refuses a unit call given exit values it should not have, or
missing ones. :func:`reduce_grads` is the one reduce path every unit call, the root unit and a
gather on read take; :func:`reduce_flats` applies it to a unit's FlatParameters.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from zshard.wire import quant
from zshard.mesh.axes import TENSOR, vary
from zshard.mesh.strategy import ReplicaReduce

__all__ = ["GradExit", "all_reduce_replicas", "exit_dtypes_of", "reduce_flats", "reduce_grads", "replica_slices",
           "reduce_scatter_last"]


@dataclasses.dataclass(frozen=True)
class GradExit:
    """How a unit's gradients leave (one per step; every unit call of the step reads it).

    Attributes:
      reduce: the :class:`~zshard.mesh.strategy.ReplicaReduce` over the replica axes.
      replica_axes: the axes the replica reduction runs over.
      slices: ``R`` where the gradient lands in the optimizer slices (``TO_SLICES``:
        ``[n_pad/S] --reduce_scatter(replica)--> [n_pad/(R*S)]``), else 1.
      residuals: error feedback: every trainable parameter's exit value is its residual.
    """

    reduce: ReplicaReduce = ReplicaReduce.NONE
    replica_axes: tuple[str, ...] = ()
    slices: int = 1
    residuals: bool = False

    @property
    def to_slices(self) -> bool:
        """The gradients land in the optimizer slices (HYBRID_SHARD_OPT), through exit values."""
        return self.reduce is ReplicaReduce.TO_SLICES

    @property
    def has_values(self) -> bool:
        """Unit calls take exit values: optimizer slices or residuals."""
        return self.to_slices or self.residuals

    def check(self, exits, trainable: bool, where: str) -> None:
        """Raise ``ValueError`` where exit values are given though :attr:`has_values` is false,
        or missing where the gradients land in optimizer slices for ``trainable`` parameters
        (frozen ones have none; residuals may be missing: a forward-only pass passes none)."""
        if (exits is not None and not self.has_values) or (exits is None and self.to_slices and trainable):
            raise ValueError(
                f"zshard: {where} called {'with' if exits is not None else 'without'} gradient exit values, but its "
                f"gradient exit reduces {self.reduce.name}; exit values are passed exactly when the step reduces "
                "TO_SLICES (HYBRID_SHARD_OPT) or keeps error feedback, and trainable parameters are gathered"
            )


def reduce_scatter_last(g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[..., n] --reduce_scatter(axes, tiled, last dim)--> [..., n/N]``; a zero-size
    parameter's ``[..., 0]`` has nothing to sum."""
    if not axes or not g.shape[-1]:
        return g
    return jax.lax.psum_scatter(g, axes, scatter_dimension=g.ndim - 1, tiled=True)


def piece_spec(lead: int) -> P:
    """The PartitionSpec of a tensor-split parameter's stored pieces ``[..., T, n]`` ([Note: tensor pieces])."""
    return P(*([None] * lead), TENSOR, None)


def _scatter_pieces(rec, wire, g: jax.Array) -> jax.Array:
    """A gradient ``[..., *shape]`` split over ``tensor`` -> ``[..., T, n_pad/N]``, each piece
    reduce-scattered over the wire's shard axes on its own (``reduce_format``: an all-to-all of
    quantized blocks, summed in fp32, cast to the reduce dtype)."""
    lead = g.ndim - len(rec.shape)
    fmt, axes = wire.reduce_format, wire.shard_axes

    def piece(x):  # this tensor device's piece of the gradient, [..., *piece_shape]
        y = rec.piece_to_storage(x)  # [..., *piece_shape] -> [..., n_pad]
        if fmt is None:
            y = reduce_scatter_last(y, axes)  # [..., n_pad] --reduce_scatter(shard axes, tiled)--> [..., n_pad/N]
        else:  # [..., n_pad] --quantize, all_to_all(shard axes), dequantize, sum--> [..., n_pad/N]
            y = quant.reduce_scatter(y, axes, fmt).astype(wire.reduce_dtype)
        return jnp.expand_dims(y, lead)  # [..., 1, n_pad/N]

    return jax.shard_map(piece, in_specs=rec.tp_spec(lead), out_specs=piece_spec(lead), axis_names={TENSOR})(g)


def reduce_grads(slots, grads, comm, exit_dtypes=None, residuals=None):
    """The one reduce path: full-size gradients (logical shapes) -> this device's gradient shards.

    Each gradient is put in its stored form, varying over every axis it is summed over, and
    reduce-scattered over its wire's shard axes in its reduce dtype, straight from its own
    ``[n_pad]`` (XLA:GPU has a combiner pass for the per-parameter reduce-scatters,
    ``ReduceScatterCombiner``); then the gradient exit's ``reduce`` decides the replica axes:

    - ``PER_UNIT``: ``[n_pad/N] --all_reduce(replica)--> [n_pad/N]`` (only the shards cross
      replicas), all parameters in one ``psum``;
    - ``PER_STEP`` / ``NONE``: left as each replica's own sum (the step all-reduces the
      accumulated shard once, or nothing is replicated);
    - ``TO_SLICES``: reduce-scattered over the replica axes too, into the optimizer slices
      ``[n_pad/(R*S)]`` (:func:`replica_slices`), cast to ``exit_dtypes``.

    A parameter whose wire has a ``reduce_format`` / ``replica_format`` takes the all-to-all of
    quantized blocks instead ([Note: quantized collectives], zshard/wire/collectives.py).

    Args:
      slots: the parameters' records (ParamLayouts or slots of them).
      grads: per parameter its gradient ``[..., *shape]``.
      comm: the step's :class:`~zshard.wire.UnitComm` (its wires and :attr:`~zshard.wire.UnitComm.exit`).
      exit_dtypes: ``TO_SLICES``: per parameter the optimizer slice's dtype.
      residuals: error feedback (zshard/wire/feedback.py): per parameter its residual ``f32[..., n_pad]``
        (``f32[..., 0]`` where its wire keeps none).

    Returns:
      Per parameter ``[..., n_pad/N]`` (``TO_SLICES``: ``[..., n_pad/(R*S)]``), in the reduce dtype
      (``TO_SLICES``: ``exit_dtypes``). With ``residuals``: ``(that list, the new residuals)``.
    """
    recs = [getattr(s, "param", s) for s in slots]
    wires = [comm.wire(r) for r in recs]
    shards, new = [], list(residuals) if residuals is not None else None
    for i, (rec, w, g) in enumerate(zip(recs, wires, grads)):
        fmt = w.reduce_format
        if residuals is not None and fmt is not None and residuals[i].shape[-1]:
            # [..., *shape] -> [..., n_pad] (+ residual) --quantize, all_to_all(shard_axes), sum in fp32--> [..., n_pad/N]
            shard, new[i] = quant.reduce_scatter_feedback(vary(rec.to_storage(g), w.vary_axes), residuals[i], w.shard_axes, fmt)
            shards.append(shard.astype(w.reduce_dtype))
            continue
        g = g if fmt is not None else g.astype(w.reduce_dtype)  # quantized: from the gradient as computed
        if w.pieces:  # [..., *shape] split over tensor --per piece: reduce_scatter(shard_axes)--> [..., T, n_pad/N]
            shards.append(_scatter_pieces(rec, w, vary(g, w.vary_axes)))
            continue
        # [..., *shape] -> [..., n_pad] (zero padding), varying over every axis it is summed over;
        # an expert parameter's group [..., E/X, ...] -> [..., n_pad/X], summed over its wire's axes only (never expert)
        full = vary(rec.piece_to_storage(g), w.vary_axes)
        if fmt is not None:  # [..., n_pad] --quantize, all_to_all(shard_axes), dequantize, sum in fp32--> [..., n_pad/N]
            shards.append(quant.reduce_scatter(full, w.shard_axes, fmt).astype(w.reduce_dtype))
            continue
        shards.append(reduce_scatter_last(full, w.shard_axes))  # [..., n_pad] --reduce_scatter(shard_axes, tiled)--> [..., n_pad/N]
    out = _replica_reduce(wires, shards, comm.exit, exit_dtypes)
    return (out, new) if new is not None else out


def _replica_reduce(wires, shards, ex: GradExit, exit_dtypes) -> list[jax.Array]:
    """:func:`reduce_grads`'s replica decision on the shard-reduced gradients ``[..., n_pad/N]``."""
    match ex.reduce:
        case ReplicaReduce.PER_UNIT:
            # [..., n_pad/N] --all_reduce(replica_axes)--> [..., n_pad/N]; replica_format: quantized per parameter
            psum = lambda gs: list(jax.lax.psum(tuple(gs), ex.replica_axes))  # noqa: E731
            return replica_reduction(wires, shards, ex.replica_axes, psum) if ex.replica_axes else shards
        case ReplicaReduce.PER_STEP | ReplicaReduce.NONE:
            return shards
        case ReplicaReduce.TO_SLICES:
            # [..., n_pad/S] --reduce_scatter(replica)--> [..., n_pad/(R S)], into the optimizer slices
            scatter = lambda gs: replica_slices(gs, ex.replica_axes, ex.slices)  # noqa: E731
            mine = replica_reduction(wires, shards, ex.replica_axes, scatter, scatter=True)
            return [g.astype(dtype) for g, dtype in zip(mine, exit_dtypes)]
        case _:  # pragma: no cover - a new member must be handled here
            raise ValueError(f"zshard: unknown replica reduction {ex.reduce!r}")


def replica_reduction(wires, shards, axes: tuple[str, ...], plain, *, scatter: bool = False) -> list:
    """The replica reduction of gradient shards ``[..., n_pad/N]`` (inside ``shard_map``):
    ``plain(shards)`` on those whose wire has no ``replica_format``, all at once (exactly the path
    without formats); on each one that has, :func:`zshard.wire.quant.all_reduce` over ``axes``
    (``scatter``: :func:`zshard.wire.quant.reduce_scatter` to ``[..., n_pad/(R*N)]``, the optimizer slices)."""
    rest = [i for i, w in enumerate(wires) if w.replica_format is None]
    out = list(shards)
    for i, g in zip(rest, plain([shards[i] for i in rest]) if rest else ()):
        out[i] = g
    for i, w in enumerate(wires):
        f = w.replica_format
        if f is not None and scatter:  # [..., n_pad/S] --quantize, all_to_all(replica), dequantize, sum--> [..., n_pad/(R S)]
            out[i] = quant.reduce_scatter(shards[i], axes, f)
        elif f is not None:  # [..., n_pad/N] --all_to_all + all_gather(replica), quantized--> [..., n_pad/N]
            out[i] = quant.all_reduce(shards[i], axes, f).astype(shards[i].dtype)
    return out


def replica_slices(slots_shards: Sequence[jax.Array], axes: tuple[str, ...], parts: int) -> list[jax.Array]:
    """HYBRID_SHARD_OPT: gradient shards summed over ``shard`` -> this device's optimizer
    slices, summed over ``axes`` too (one reduce-scatter for all of them).

    Args:
      slots_shards: per parameter ``[..., n_pad/S]`` (``n_pad`` a multiple of ``S*parts``),
        in the reduce dtype, varying over ``axes`` (each replica's own sum).
      axes / parts: the replica axes and ``R``, the devices along them.

    Returns:
      Per parameter ``[..., n_pad/(R*S)]``: row ``r`` (this device's index along ``axes``)
      of ``[..., R, n_pad/(R*S)]``, summed over ``axes`` (``opt_axes = (shard, replica)``,
      docs/memory.md).
    """
    # each [..., n_pad/S] -> [..., R, n_pad/(R S)]; side by side: [..., R, L/(R S)]
    rows = [vary(g.reshape(g.shape[:-1] + (parts, g.shape[-1] // parts)), axes) for g in slots_shards]
    both = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=-1)
    # [..., R, L/(R S)] --reduce_scatter(replica)--> [..., L/(R S)]
    mine = jax.lax.psum_scatter(both, axes, scatter_dimension=both.ndim - 2, tiled=False)
    out, at = [], 0
    for r in rows:  # [..., L/(R S)] -> ([..., n_pad_p/(R S)], ...)
        out.append(mine[..., at : at + r.shape[-1]])
        at += r.shape[-1]
    return out


def all_reduce_replicas(plan, grads: dict) -> dict:
    """Gradient accumulation (``ReplicaReduce.PER_STEP``): the accumulated shards, a nested dict
    like the trainable parameters, summed over ``plan.replica_axes`` once per step
    (:func:`replica_reduction`; without ``replica_format`` one ``psum`` of the whole tree)."""
    if plan.mp.replica_format is None:
        return jax.lax.psum(grads, plan.replica_axes)  # [n_pad/N] --all_reduce(replica)--> [n_pad/N]
    flat = traverse_util.flatten_dict(grads)
    psum = lambda gs: list(jax.lax.psum(tuple(gs), plan.replica_axes))  # noqa: E731
    out = replica_reduction([plan.wires[p] for p in flat], list(flat.values()), plan.replica_axes, psum)
    return traverse_util.unflatten_dict(dict(zip(flat, out)))


# --- a unit's FlatParameters -------------------------------------------------------------------------


def exit_dtypes_of(exits):
    """Per flat, the dtypes of its exit values (static, for the backward); ``None`` for none."""
    return None if exits is None else tuple(tuple(z.dtype for z in per_flat) for per_flat in exits)


# [Note: reduce-dtype cotangents] A unit's reduced gradients leave its backward in the reduce dtype
# (bf16 with MixedPrecision(reduce_dtype="bfloat16")), not cast to the fp32 shard's dtype there: a
# scanned stack of units otherwise stacks every layer's upcast gradient, fp32 [L, n_pad/N] (llama-3-8b:
# 3.49 GB per GPU against 1.75 GB bf16, docs/performance.md). JAX takes a floating cotangent of another
# dtype than its primal (custom_derivatives._temporary_dtype_exception); the step casts the gradients
# to the masters' dtype before the norm, the clipping and the optimizer: the same values as before.
def reduce_flats(flats, bufs, grads, comm, exit_dtypes=None, residuals=None):
    """The gradients of a unit's parameters -> ``(cotangents of bufs, cotangents of the exit values)``.

    Shards (no exit values): each flat's gradients through :func:`reduce_grads`, as the bufs'
    cotangent in the reduce dtype ([Note: reduce-dtype cotangents]; per-parameter shards, or
    concatenated where the unit was called with a FlatParameter shard); a frozen flat gets zeros. Optimizer slices (``TO_SLICES``,
    ``exit_dtypes``: per flat the slices' dtypes, ``()`` for a frozen flat): the exit values'
    cotangent; the bufs get none (they are not differentiated), so only ``[n_pad/(R*S)]`` per
    parameter leaves the unit. ``residuals``: per flat its residuals (the exit values); their
    cotangents are the new ones (zshard/wire/feedback.py).
    """
    out, exits, i = [], [], 0
    for k, (f, b) in enumerate(zip(flats, bufs)):
        n = len(f.slots)
        if not f.trainable:  # frozen: no gradient, no reduce-scatter
            out.append(None if exit_dtypes is not None else jax.tree.map(jnp.zeros_like, b))
            exits.append(())
        elif residuals is not None:
            reduced, new = reduce_grads(f.slots, grads[i : i + n], comm, residuals=residuals[k])
            shards = [g.astype(f.dtype) for g in reduced]
            out.append(tuple(shards) if isinstance(b, (tuple, list)) else f.concat_shards(shards))
            exits.append(tuple(new))
        elif exit_dtypes is not None:
            exits.append(tuple(reduce_grads(f.slots, grads[i : i + n], comm, exit_dtypes[k])))
            out.append(None)
        else:
            shards = reduce_grads(f.slots, grads[i : i + n], comm)  # in the reduce dtype: [Note: reduce-dtype cotangents]
            # per-parameter shards in: ([n_pad_p/N], ...) out; a FlatParameter shard in: [L/N] out
            out.append(tuple(shards) if isinstance(b, (tuple, list)) else f.concat_shards(shards))
            exits.append(())
        i += n
    return tuple(out), (None if exit_dtypes is None and residuals is None else tuple(exits))
