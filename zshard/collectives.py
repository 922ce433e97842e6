"""The collectives of a parameter inside ``shard_map``: one all-gather path, one reduce path.

Every parameter that zshard gathers goes through :func:`gather_params` (all-gather of its
shard, ``[n_pad/N] -> [n_pad] -> logical shape``), and every gradient that leaves a unit goes
through :func:`reduce_grads` (reduce-scatter of each gradient over the shard axes, then the
step's :class:`~zshard.strategy.ReplicaReduce` decision over the replica axes). Three callers
use them: a unit call (:mod:`zshard.unit_call`), the root unit's :func:`gather`, and
:func:`gather_param` for a unit parameter read outside its unit. Each has a hand-written VJP:

- the replica trap (docs/design.md section 7): left to autodiff, a parameter gathered over
  ``shard`` only but used with batch data that varies over ``replica`` is implicitly
  broadcast, and the transpose of that broadcast all-reduces the *full* gradient over
  ``replica``. Here the shard is marked varying over ``replica`` before the gather and the
  cross-replica sum happens once, on the scattered shard;
- the forced schedule (docs/design.md section 8.1): :func:`schedule_token` / :func:`after`
  make a gather wait for a value by data flow (XLA:CPU drops optimization barriers).

The gradients that come out are sums over devices; the caller scales the loss by
``1 / world`` so that the sum is the gradient of the global mean loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zshard import quant
from zshard.flat import FlatParameter, ParamLayout
from zshard.mesh import TENSOR
from zshard.precision import FULL_PRECISION, MixedPrecision
from zshard.quant import replica_slices
from zshard.strategy import ReplicaReduce

__all__ = [
    "UnitComm",
    "after",
    "after_tree",
    "all_gather_last",
    "gather",
    "gather_param",
    "gather_params",
    "reduce_grads",
    "replica_slices",
    "schedule_token",
    "vary",
    "varying_axes",
]


@dataclasses.dataclass(frozen=True)
class UnitComm:
    """How the units of one step communicate: the record every gather and reduction reads.

    Attributes:
      shard_axes: mesh axes a parameter is split over at rest (all-gather, reduce-scatter).
      replica_axes: mesh axes the parameters are replicated over: a gradient is summed over
        them as ``replica_reduce`` says, and a gathered parameter is marked varying over them
        (its gradient stays each replica's own until it is reduced).
      replica_reduce: the step's :class:`~zshard.strategy.ReplicaReduce`.
      replica_parts: ``R``, devices along ``replica_axes`` (``TO_SINKS``: the gradient shard
        ``[n_pad/S]`` is reduce-scattered into ``R`` slices ``[n_pad/(R*S)]``).
      mp: the :class:`~zshard.MixedPrecision` (gather in ``param_dtype``, reduce in ``reduce_dtype``;
        quantized on the wire where its formats say: [Note: quantized collectives]).
      remat: the activation-checkpointing policy inside a unit (:func:`zshard.unit_call.checkpointed`).
      reshard: reshard after forward (FULL_SHARD, HYBRID_SHARD): backward gathers again.
      hpz: ZeRO++ hpZ (zshard/hpz.py): forward keeps ``[n_pad/S]`` slices; backward gathers them over ``shard``.
    """

    shard_axes: tuple[str, ...]
    replica_axes: tuple[str, ...] = ()
    replica_reduce: ReplicaReduce = ReplicaReduce.NONE
    replica_parts: int = 1
    mp: MixedPrecision = FULL_PRECISION
    remat: Any = "block"
    reshard: bool = True
    hpz: bool = False

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
        )

    @property
    def vary_axes(self) -> tuple[str, ...]:
        """The axes a gathered parameter must vary over besides ``shard_axes``: ``replica_axes``."""
        return self.replica_axes

    @property
    def sinks(self) -> bool:
        """Gradients leave through gradient sinks (``ReplicaReduce.TO_SINKS``)."""
        return self.replica_reduce is ReplicaReduce.TO_SINKS

    def check_sinks(self, sinks, trainable: bool, where: str) -> None:
        """Raise ``ValueError`` where ``sinks`` are given without :attr:`sinks` (or error feedback's
        residuals, zshard/feedback.py, which may also be missing), or missing with it for
        ``trainable`` parameters (frozen ones have no sink)."""
        if (sinks is not None and not (self.sinks or self.mp.error_feedback)) or (sinks is None and self.sinks and trainable):
            raise ValueError(
                f"zshard: {where} called {'with' if sinks is not None else 'without'} gradient sinks, but its UnitComm has "
                f"replica_reduce={self.replica_reduce.name}; gradient sinks are passed exactly when the step reduces "
                f"TO_SINKS (HYBRID_SHARD_OPT) or keeps error feedback, and trainable parameters are gathered"
            )


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over, inside ``shard_map`` (its type's manual-axis record)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Mark ``x`` as varying over ``axes`` (no data movement) where it is not already."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# --- [Note: forced schedule] (docs/design.md section 8.1) --------------------------------------------


def schedule_token(tree) -> jax.Array:
    """A float32 scalar zero that is data-dependent on ``tree`` (``0 * t`` for one finite
    scalar ``t`` read from it; a constant zero when ``tree`` holds no floating array)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    t = leaves[0].reshape(-1)[0]
    return (jnp.where(jnp.isfinite(t), t, 0) * 0).astype(jnp.float32)


def after(bufs, tree):
    """``bufs`` unchanged, but data-dependent on ``tree`` so XLA cannot schedule or merge early.

    Adds :func:`schedule_token` of ``tree``: exact (``x + 0 == x``), and no NaN or inf in ``tree``
    can leak into ``bufs``. The XLA CPU compiler drops ``optimization_barrier``, so the
    dependency must be real data flow.
    """
    if not any(jnp.issubdtype(x.dtype, jnp.inexact) and x.size for x in jax.tree.leaves(tree)):
        return bufs
    t = schedule_token(tree)
    return jax.tree.map(lambda b: b + t.astype(b.dtype), tuple(bufs))


def after_tree(tree, dep):
    """:func:`after` on the floating leaves of a pytree (others pass through)."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    for i, x in zip(floats, after([leaves[i] for i in floats], dep)):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


# --- one parameter -----------------------------------------------------------------------------------


def all_gather_last(b: jax.Array, axes: tuple[str, ...], *, invariant: bool = False) -> jax.Array:
    """``[..., n/N] --all_gather(axes, tiled, last dim)--> [..., n]`` (``invariant``: the result
    typed as the same on every device of ``axes``); a zero-size parameter's ``[..., 0]`` is
    already whole (XLA refuses a zero gather dimension)."""
    if not axes or not b.shape[-1]:
        return b
    if invariant:
        return jax.lax.all_gather(b, axes, axis=b.ndim - 1, tiled=True, to="invarying")
    return jax.lax.all_gather(b, axes, axis=b.ndim - 1, tiled=True)


def _reduce_scatter_last(g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[..., n] --reduce_scatter(axes, tiled, last dim)--> [..., n/N]``; a zero-size
    parameter's ``[..., 0]`` has nothing to sum."""
    if not axes or not g.shape[-1]:
        return g
    return jax.lax.psum_scatter(g, axes, scatter_dimension=g.ndim - 1, tiled=True)


# [Note: quantized collectives] With a format on ``comm.mp`` (zshard/quant.py, docs/quantized.md),
# a parameter it quantizes (:func:`zshard.quant.quantizes`, decided per parameter from its shape
# and the devices its buffer splits over, as the planner padded it) is gathered as ZeRO++ qwZ:
# its shard quantized in blocks, ``u8`` payload and ``f32`` scales all-gathered, dequantized to
# the gather dtype; its gradient leaves as qgZ: an all-to-all of quantized blocks, dequantized
# and summed in fp32, cast to the reduce dtype; the replica reduction likewise with
# ``replica_format``. Every other parameter, and every parameter without formats, takes the
# unquantized path unchanged. Split parameters do the same inside their piece function.


def _format(fmt: quant.Quant | None, rec: ParamLayout, axes: tuple[str, ...]) -> quant.Quant | None:
    """``fmt`` where it quantizes ``rec`` split over the devices of ``axes``, else ``None``."""
    if fmt is None or not axes:
        return None
    return fmt if quant.quantizes(fmt, rec, jax.lax.axis_size(axes)) else None


def _gather_one(rec: ParamLayout, shard: jax.Array, comm: UnitComm, keep=None) -> jax.Array:
    """One parameter's shard ``[..., n_pad/N]`` -> its stored form ``[..., n_pad]`` in the gather
    dtype; split over ``tensor`` (``[..., T, n_pad/N]``): its logical value, split over ``tensor``
    (and, with ``keep``, ``keep`` of each gathered piece: :func:`_gather_pieces`)."""
    # Marking the shard varying over replica *before* the gather keeps autodiff from inserting a
    # broadcast whose transpose would all-reduce the full gradient across replicas ("the
    # replica trap"); the backward sums only the shard instead (reduce_grads).
    b = vary(shard, comm.shard_axes + comm.vary_axes)
    fmt = _format(comm.mp.gather_format, rec, comm.shard_axes)
    if fmt is not None:  # [Note: quantized collectives]: the master shard is quantized, no cast first
        dtype = comm.mp.gather_dtype(rec.dtype)
        if rec.split:
            return _gather_pieces(rec, b, comm.shard_axes, fmt, dtype, keep)
        return quant.all_gather(b, comm.shard_axes, fmt, dtype)  # [..., n_pad/N] --quantized all_gather--> [..., n_pad]
    b = b.astype(comm.mp.gather_dtype(rec.dtype))
    if rec.split:
        return _gather_pieces(rec, b, comm.shard_axes, keep=keep)
    return all_gather_last(b, comm.shard_axes)  # [..., n_pad/N] --all_gather(shard_axes, tiled)--> [..., n_pad]


# [Note: tensor pieces] A parameter split over ``tensor`` is stored ``[..., T, n_pad/N]`` per device
# of the data axes, ``T`` left to the compiler. Its all-gather runs inside a ``shard_map`` manual
# over ``tensor`` too, so each device gathers only its own piece over the data axes and the model
# gets the weight as a logical array split over ``tensor`` (the piece order is ParamLayout's);
# the reduce-scatter of its gradient runs the same way. Left to the compiler, XLA first
# replicates every such weight over ``tensor`` (T times the gather bytes).


def _piece_spec(lead: int) -> P:
    return P(*([None] * lead), TENSOR, None)


def _gather_pieces(rec: ParamLayout, b: jax.Array, axes: tuple[str, ...], fmt=None, dtype=None, keep=None):
    """``[..., T, n_pad/N]`` -> the logical value ``[..., *shape]``, split over ``tensor`` along
    ``tp_dim`` (``fmt``: each piece quantized on the wire, dequantized to ``dtype``). ``keep``: also
    ``keep(piece [..., n_pad]) -> [..., m]`` per piece, returned ``[..., T, m]`` (hpZ's slice)."""
    lead = b.ndim - 2

    def piece(x):  # this tensor device's piece, [..., 1, n_pad/N]
        # squeezed before the collective: a [.., 1, n] all-gather output gets a layout with the unit
        # dimension minor, and XLA copied every gathered piece into the dot's layout (twice the bytes)
        x = jnp.squeeze(x, lead)  # [..., 1, n_pad/N] -> [..., n_pad/N]
        if fmt is None:
            x = all_gather_last(x, axes)  # [..., n_pad/N] --all_gather(shard axes, tiled)--> [..., n_pad]
        else:  # [..., n_pad/N] --quantize, all_gather(shard axes), dequantize--> [..., n_pad]
            x = quant.all_gather(x, axes, fmt, dtype)
        if keep is not None:
            return rec.piece_from_storage(x), jnp.expand_dims(keep(x), lead)  # and [..., m] -> [..., 1, m]
        return rec.piece_from_storage(x)  # [..., n_pad] -> [..., *piece_shape]

    out_specs = rec.tp_spec(lead) if keep is None else (rec.tp_spec(lead), _piece_spec(lead))
    return jax.shard_map(piece, in_specs=_piece_spec(lead), out_specs=out_specs, axis_names={TENSOR})(b)


def _scatter_pieces(rec: ParamLayout, g: jax.Array, axes: tuple[str, ...], fmt=None, dtype=None) -> jax.Array:
    """A gradient ``[..., *shape]`` split over ``tensor`` -> ``[..., T, n_pad/N]``, each piece
    reduce-scattered over the data ``axes`` on its own (``fmt``: an all-to-all of quantized
    blocks, summed in fp32, cast to ``dtype``)."""
    lead = g.ndim - len(rec.shape)

    def piece(x):  # this tensor device's piece of the gradient, [..., *piece_shape]
        y = rec.piece_to_storage(x)  # [..., *piece_shape] -> [..., n_pad]
        if fmt is None:
            y = _reduce_scatter_last(y, axes)  # [..., n_pad] --reduce_scatter(shard axes, tiled)--> [..., n_pad/N]
        else:  # [..., n_pad] --quantize, all_to_all(shard axes), dequantize, sum--> [..., n_pad/N]
            y = quant.reduce_scatter(y, axes, fmt).astype(dtype)
        return jnp.expand_dims(y, lead)  # [..., 1, n_pad/N]

    return jax.shard_map(piece, in_specs=rec.tp_spec(lead), out_specs=_piece_spec(lead), axis_names={TENSOR})(g)


def gather_params(slots, shards, comm: UnitComm, ready=None) -> list[jax.Array]:
    """Parameter shards -> the parameters in logical shapes: one all-gather per parameter.

    Each parameter is gathered straight into its own ``[n_pad]`` buffer, so its logical view is
    a slice + reshape of it (a bitcast where there is no padding): no FlatParameter
    concatenated before the gather, no strided column slices after it, and each gathered
    weight is its own allocation, freed after its last use (docs/benchmarks.md, "Where the S
    step time went"). XLA:GPU and TPU have a pass that combines independent all-gathers
    (``AllGatherCombiner``; not measured here); XLA:CPU runs them one by one.

    Args:
      slots: the parameters' records (:class:`~zshard.flat.ParamLayout`), or slots of them.
      shards: per parameter ``[..., n_pad/N]``.
      comm: the axes and mixed precision.
      ready: a prefetched gather (issued before this unit's own input or cotangent exists) is
        cut into logical views only once ``ready`` exists (:func:`after` on the gathered
        parameters; XLA fuses the scalar add into their consumers). Without it XLA
        materialises a prefetched unit's views as soon as it arrives and holds it twice
        (config P, ``prefetch=1``: 4.35 -> 3.22 gathered units, docs/benchmarks.md).
    """
    recs = [getattr(s, "param", s) for s in slots]
    fulls = [_gather_one(rec, b, comm) for rec, b in zip(recs, shards)]
    if ready is not None:
        fulls = after(fulls, ready)  # [n_pad] + 0: the views below wait for ``ready``
    # [..., n_pad] -> [..., :n] -> shape (a split parameter comes out of its gather logical already)
    return [full if rec.split else rec.from_storage(full) for rec, full in zip(recs, fulls)]


def reduce_grads(slots, grads, comm: UnitComm, sink_dtypes=None, feedback=None):
    """The one reduce path: full-size gradients (logical shapes) -> this device's gradient shards.

    Each gradient is put in its stored form, varying over every axis it is summed over, and
    reduce-scattered over ``comm.shard_axes`` in the reduce dtype, straight from its own
    ``[n_pad]`` (XLA:GPU has a combiner pass for the per-parameter reduce-scatters,
    ``ReduceScatterCombiner``); then ``comm.replica_reduce`` decides the replica axes:

    - ``PER_UNIT``: ``[n_pad/N] --all_reduce(replica)--> [n_pad/N]`` (only the shards cross
      replicas), all parameters in one ``psum``;
    - ``PER_STEP`` / ``NONE``: left as each replica's own sum (the step all-reduces the
      accumulated shard once, or nothing is replicated);
    - ``TO_SINKS``: reduce-scattered over the replica axes too, into the optimizer slices
      ``[n_pad/(R*S)]`` (:func:`replica_slices`), cast to ``sink_dtypes``.

    With ``comm.mp.reduce_format`` / ``replica_format``, the parameters they quantize take the
    all-to-all of quantized blocks instead ([Note: quantized collectives]).

    ``feedback`` (error feedback, zshard/feedback.py): per parameter its residual ``f32[..., n_pad]``
    (``f32[..., 0]`` where its format does not quantize it).

    Returns:
      Per parameter ``[..., n_pad/N]`` (``TO_SINKS``: ``[..., n_pad/(R*S)]``), in the reduce dtype
      (``TO_SINKS``: the sinks' dtypes). With ``feedback``: ``(that list, the new residuals)``.
    """
    recs = [getattr(s, "param", s) for s in slots]
    axes = comm.shard_axes + comm.vary_axes
    shards, residuals = [], list(feedback) if feedback is not None else None
    for i, (rec, g) in enumerate(zip(recs, grads)):
        fmt = _format(comm.mp.reduce_format, rec, comm.shard_axes)
        dtype = comm.mp.grad_dtype(rec.dtype)
        if feedback is not None and fmt is not None and feedback[i].shape[-1]:
            # [..., *shape] -> [..., n_pad] (+ residual) --quantize, all_to_all(shard_axes), sum in fp32--> [..., n_pad/N]
            shard, residuals[i] = quant.reduce_scatter_feedback(vary(rec.to_storage(g), axes), feedback[i], comm.shard_axes, fmt)
            shards.append(shard.astype(dtype))
            continue
        g = g if fmt is not None else g.astype(dtype)  # quantized: from the gradient as computed
        if rec.split:  # [..., *shape] split over tensor --per piece: reduce_scatter(shard_axes)--> [..., T, n_pad/N]
            shards.append(_scatter_pieces(rec, vary(g, axes), comm.shard_axes, fmt, dtype))
            continue
        # [..., *shape] -> [..., n_pad] (zero padding), varying over every axis it is summed over
        full = vary(rec.to_storage(g), axes)
        if fmt is not None:  # [..., n_pad] --quantize, all_to_all(shard_axes), dequantize, sum in fp32--> [..., n_pad/N]
            shards.append(quant.reduce_scatter(full, comm.shard_axes, fmt).astype(dtype))
            continue
        shards.append(_reduce_scatter_last(full, comm.shard_axes))  # [..., n_pad] --reduce_scatter(shard_axes, tiled)--> [..., n_pad/N]
    if residuals is not None:
        return _replica_reduce(recs, shards, comm, sink_dtypes), residuals
    return _replica_reduce(recs, shards, comm, sink_dtypes)


def _replica_reduce(recs, shards, comm: UnitComm, sink_dtypes) -> list[jax.Array]:
    """:func:`reduce_grads`'s replica decision on the shard-reduced gradients ``[..., n_pad/N]``."""
    match comm.replica_reduce:
        case ReplicaReduce.PER_UNIT:
            # [..., n_pad/N] --all_reduce(replica_axes)--> [..., n_pad/N]; replica_format: quantized per parameter
            psum = lambda gs: list(jax.lax.psum(tuple(gs), comm.replica_axes))  # noqa: E731
            return quant.replica_reduction(recs, shards, comm, psum) if comm.replica_axes else shards
        case ReplicaReduce.PER_STEP | ReplicaReduce.NONE:
            return shards
        case ReplicaReduce.TO_SINKS:
            # [..., n_pad/S] --reduce_scatter(replica)--> [..., n_pad/(R S)], into the sinks
            scatter = lambda gs: replica_slices(gs, comm.replica_axes, comm.replica_parts)  # noqa: E731
            mine = quant.replica_reduction(recs, shards, comm, scatter, scatter=True)
            return [g.astype(dtype) for g, dtype in zip(mine, sink_dtypes)]
        case _:  # pragma: no cover - a new member must be handled here
            raise ValueError(f"zshard: unknown replica reduction {comm.replica_reduce!r}")


# --- a unit's FlatParameters -------------------------------------------------------------------------


def param_shards(flat: FlatParameter, buf) -> list[jax.Array]:
    """A unit's shards of one FlatParameter -> per parameter ``[n_pad_p/N]`` (a unit is called
    with per-parameter shards; a concatenated ``[L/N]`` is split into them, no copy: slices)."""
    return list(buf) if isinstance(buf, (tuple, list)) else flat.split_shard(buf)


def gather_flats(flats, bufs, comm: UnitComm, ready=None) -> list[jax.Array]:
    """A unit's shards, per FlatParameter -> its parameters in logical shapes, in slot order."""
    slots = [s for f in flats for s in f.slots]
    shards = [b for f, buf in zip(flats, bufs) for b in param_shards(f, buf)]  # [n_pad_p/N] each
    return gather_params(slots, shards, comm, ready)


def sink_dtypes_of(sinks):
    """Per flat, the dtypes of its sinks (static, for the backward); ``None`` for no sinks."""
    return None if sinks is None else tuple(tuple(z.dtype for z in per_flat) for per_flat in sinks)


def reduce_flats(flats, bufs, grads, comm: UnitComm, sink_dtypes=None, feedback=None):
    """The gradients of a unit's parameters -> ``(cotangents of bufs, cotangents of sinks)``.

    Without sinks: each flat's gradients through :func:`reduce_grads`, as the bufs' cotangent
    (per-parameter shards, or concatenated where the unit was called with a FlatParameter
    shard); a frozen flat gets zeros. With sinks (``TO_SINKS``): the sinks' cotangent; the bufs
    get none (they are not differentiated), so only ``[n_pad/(R*S)]`` per parameter leaves the
    unit. ``sink_dtypes``: per flat, the sinks' dtypes (``()`` for a frozen flat). ``feedback``:
    per flat, its residuals (the sinks' values); their cotangents are the new ones (zshard/feedback.py).
    """
    out, to_sinks, i = [], [], 0
    for k, (f, b) in enumerate(zip(flats, bufs)):
        n = len(f.slots)
        if not f.trainable:  # frozen: no gradient, no reduce-scatter
            out.append(None if sink_dtypes is not None else jax.tree.map(jnp.zeros_like, b))
            to_sinks.append(())
        elif feedback is not None:
            reduced, new = reduce_grads(f.slots, grads[i : i + n], comm, feedback=feedback[k])
            shards = [g.astype(f.dtype) for g in reduced]
            out.append(tuple(shards) if isinstance(b, (tuple, list)) else f.concat_shards(shards))
            to_sinks.append(tuple(new))
        elif sink_dtypes is not None:
            to_sinks.append(tuple(reduce_grads(f.slots, grads[i : i + n], comm, sink_dtypes[k])))
            out.append(None)
        else:
            shards = [g.astype(f.dtype) for g in reduce_grads(f.slots, grads[i : i + n], comm)]
            # per-parameter shards in: ([n_pad_p/N], ...) out; a FlatParameter shard in: [L/N] out
            out.append(tuple(shards) if isinstance(b, (tuple, list)) else f.concat_shards(shards))
            to_sinks.append(())
        i += n
    return tuple(out), (None if sink_dtypes is None and feedback is None else tuple(to_sinks))


def gather(flats: Sequence[FlatParameter], bufs: Sequence[jax.Array], comm: UnitComm, sinks=None) -> list[jax.Array]:
    """All-gather a unit's shards for the whole step (the root unit); backward reduces them.

    Args:
      flats: the unit's FlatParameters, one per dtype.
      bufs: per flat, this device's per-parameter shards ``([n_pad/N], ...)`` (or one
        concatenated ``[L_k/N]``), ``PartitionSpec(shard_axes)`` outside.
      comm: the axes, mixed precision and replica reduction.
      sinks: exactly when ``comm.sinks`` (HYBRID_SHARD_OPT): per flat, a tuple of
        per-parameter gradient sinks ``[n_pad/(R*S)]`` (``()`` for a frozen flat); the
        gradient leaves through them, not through ``bufs``.

    Returns:
      The unit's parameters in logical shapes, in slot order (all flats concatenated).

    Raises:
      ValueError: ``sinks`` given without ``comm.sinks`` or missing with it.
    """
    flats = tuple(flats)
    comm.check_sinks(sinks, any(f.trainable for f in flats), "gather")
    ef = comm.mp.error_feedback  # the sinks are the residuals (zshard/feedback.py)
    sink_dtypes = None if ef else sink_dtypes_of(sinks)

    @jax.custom_vjp
    def _gather(bufs, sinks):
        return gather_flats(flats, bufs, comm)

    def fwd(bufs, sinks):
        return gather_flats(flats, bufs, comm), (bufs, sinks if ef else None)

    def bwd(res, grads):
        bufs, feedback = res
        return reduce_flats(flats, bufs, grads, comm, sink_dtypes, feedback)

    _gather.defvjp(fwd, bwd)
    return _gather(tuple(bufs), None if sinks is None else tuple(sinks))


def gather_param(slot: ParamLayout, shard: jax.Array, comm: UnitComm, sink: jax.Array | None = None) -> jax.Array:
    """All-gather one parameter where it is read outside its unit's methods; backward reduces
    its gradient through the same path as a unit's (:func:`reduce_grads`).

    Args:
      slot: the parameter's record (logical shape, padded size; ``to_storage`` / ``from_storage``).
      shard: this device's padded slice, ``[n_pad/N]``, or ``[L, n_pad/N]`` for all layers
        of a stacked parameter.
      comm: axes, mixed precision and replica reduction.
      sink: exactly when ``comm.sinks`` (HYBRID_SHARD_OPT): the parameter's gradient sink
        ``[..., n_pad/(R*S)]``; the gradient leaves through it.

    Returns:
      The parameter in its logical shape (``[L, *shape]`` for a stacked one), in the gather dtype.

    Raises:
      ValueError: ``sink`` given without ``comm.sinks`` or missing with it.
    """
    comm.check_sinks(sink, slot.trainable, f"gather_param ({slot.path})")
    ef = comm.mp.error_feedback and sink is not None  # the sink is the residual (zshard/feedback.py)
    sink_dtypes = None if sink is None or ef else (sink.dtype,)

    @jax.custom_vjp
    def _gather(b, sink):
        return gather_params([slot], [b], comm)[0]

    def fwd(b, sink):
        return gather_params([slot], [b], comm)[0], (sink if ef else None)

    def bwd(e, g):
        if ef:
            (r,), (new,) = reduce_grads([slot], [g], comm, feedback=[e])
            return r.astype(slot.dtype), new
        (r,) = reduce_grads([slot], [g], comm, sink_dtypes)
        return (None, r) if sink_dtypes is not None else (r.astype(slot.dtype), None)

    _gather.defvjp(fwd, bwd)
    return _gather(shard, sink)
