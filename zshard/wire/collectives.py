"""The collectives of a parameter inside ``shard_map``: the one all-gather path, and the custom VJPs.

Every parameter that zshard gathers goes through :func:`gather_params` (all-gather of its
shard, ``[n_pad/N] -> [n_pad] -> logical shape``), as its wire says (:class:`~zshard.wire.ParamWire`,
resolved once by the planner: axes, dtype, format, tensor pieces), and every gradient that leaves
a unit goes through :func:`zshard.wire.grad_exit.reduce_grads` (the gradient exit: reduce-scatter of
each gradient over the shard axes, then the step's :class:`~zshard.mesh.strategy.ReplicaReduce`
decision over the replica axes). Nothing here decides how bytes travel. Three callers
use them: a unit call (:mod:`zshard.programs.unit_call`), the root unit's :func:`gather`, and
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

from typing import Sequence

import jax
import jax.numpy as jnp

from zshard.wire import quant
from zshard.mesh.axes import TENSOR, vary, varying_axes
from zshard.params.flat import FlatParameter, ParamLayout
from zshard.wire.grad_exit import exit_dtypes_of, piece_spec, reduce_flats, reduce_grads, replica_slices
from zshard.wire.wire import ParamWire, UnitComm

__all__ = [
    "ParamWire",
    "UnitComm",
    "after",
    "after_tree",
    "all_gather_last",
    "gather",
    "gather_param",
    "gather_params",
    "reduce_flats",
    "reduce_grads",
    "replica_slices",
    "schedule_token",
    "vary",
    "varying_axes",
]


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
    if invariant:  # jax 0.12 refuses this gather of a value typed the same on every device: vary it first (no data moves)
        return jax.lax.all_gather(vary(b, axes), axes, axis=b.ndim - 1, tiled=True, to="invarying")
    return jax.lax.all_gather(b, axes, axis=b.ndim - 1, tiled=True)


# [Note: quantized collectives] With a format on a parameter's wire (zshard/wire/wire.py: set by the
# planner where a format of MixedPrecision quantizes it, :func:`zshard.wire.quant.quantizes`, from its
# shape and the devices its buffer splits over, as the planner padded it) it is gathered as ZeRO++ qwZ:
# its shard quantized in blocks, ``u8`` payload and ``f32`` scales all-gathered, dequantized to
# the gather dtype; its gradient leaves as qgZ: an all-to-all of quantized blocks, dequantized
# and summed in fp32, cast to the reduce dtype; the replica reduction likewise with
# ``replica_format``. Every other parameter, and every parameter without formats, takes the
# unquantized path unchanged. Split parameters do the same inside their piece function.


def _gather_one(rec: ParamLayout, shard: jax.Array, comm: UnitComm, keep=None) -> jax.Array:
    """One parameter's shard ``[..., n_pad/N]`` -> its stored form ``[..., n_pad]`` in the gather
    dtype; split over ``tensor`` (``[..., T, n_pad/N]``): its logical value, split over ``tensor``
    (and, with ``keep``, ``keep`` of each gathered piece: :func:`_gather_pieces`). How: its wire
    (:class:`~zshard.wire.ParamWire`, read, never decided here)."""
    w = comm.wire(rec)
    # Marking the shard varying over replica *before* the gather keeps autodiff from inserting a
    # broadcast whose transpose would all-reduce the full gradient across replicas ("the
    # replica trap"); the backward sums only the shard instead (zshard.wire.grad_exit.reduce_grads).
    b = vary(shard, w.vary_axes)
    if w.gather_format is None:
        b = b.astype(w.gather_dtype)  # plain: cast first; quantized: the master shard is quantized, no cast first
    if w.pieces:
        return _gather_pieces(rec, w, b, keep)
    if w.gather_format is not None:  # [..., n_pad/N] --quantize, all_gather(shard_axes), dequantize--> [..., n_pad]
        return quant.all_gather(b, w.shard_axes, w.gather_format, w.gather_dtype)
    return all_gather_last(b, w.shard_axes)  # [..., n_pad/N] --all_gather(shard_axes, tiled)--> [..., n_pad]


# [Note: tensor pieces] A parameter split over ``tensor`` is stored ``[..., T, n_pad/N]`` per device
# of the data axes, ``T`` left to the compiler. Its all-gather runs inside a ``shard_map`` manual
# over ``tensor`` too, so each device gathers only its own piece over the data axes and the model
# gets the weight as a logical array split over ``tensor`` (the piece order is ParamLayout's);
# the reduce-scatter of its gradient runs the same way. Left to the compiler, XLA first
# replicates every such weight over ``tensor`` (T times the gather bytes).




def _gather_pieces(rec: ParamLayout, w: ParamWire, b: jax.Array, keep=None):
    """``[..., T, n_pad/N]`` -> the logical value ``[..., *shape]``, split over ``tensor`` along
    ``tp_dim`` (a ``gather_format`` on the wire: each piece quantized, dequantized to the gather
    dtype). ``keep``: also ``keep(piece [..., n_pad]) -> [..., m]`` per piece, returned ``[..., T, m]``
    (hpZ's slice)."""
    lead = b.ndim - 2
    fmt, axes = w.gather_format, w.shard_axes

    def piece(x):  # this tensor device's piece, [..., 1, n_pad/N]
        # squeezed before the collective: a [.., 1, n] all-gather output gets a layout with the unit
        # dimension minor, and XLA copied every gathered piece into the dot's layout (twice the bytes)
        x = jnp.squeeze(x, lead)  # [..., 1, n_pad/N] -> [..., n_pad/N]
        if fmt is None:
            x = all_gather_last(x, axes)  # [..., n_pad/N] --all_gather(shard axes, tiled)--> [..., n_pad]
        else:  # [..., n_pad/N] --quantize, all_gather(shard axes), dequantize--> [..., n_pad]
            x = quant.all_gather(x, axes, fmt, w.gather_dtype)
        if keep is not None:
            return rec.piece_from_storage(x), jnp.expand_dims(keep(x), lead)  # and [..., m] -> [..., 1, m]
        return rec.piece_from_storage(x)  # [..., n_pad] -> [..., *piece_shape]

    out_specs = rec.tp_spec(lead) if keep is None else (rec.tp_spec(lead), piece_spec(lead))
    return jax.shard_map(piece, in_specs=piece_spec(lead), out_specs=out_specs, axis_names={TENSOR})(b)


def gather_params(slots, shards, comm: UnitComm, ready=None) -> list[jax.Array]:
    """Parameter shards -> the parameters in logical shapes: one all-gather per parameter.

    Each parameter is gathered straight into its own ``[n_pad]`` buffer, so its logical view is
    a slice + reshape of it (a bitcast where there is no padding): no FlatParameter
    concatenated before the gather, no strided column slices after it, and each gathered
    weight is its own allocation, freed after its last use (docs/benchmarks.md, "Where the S
    step time went"). XLA:GPU and TPU have a pass that combines independent all-gathers
    (``AllGatherCombiner``; not measured here); XLA:CPU runs them one by one.

    Args:
      slots: the parameters' records (:class:`~zshard.params.flat.ParamLayout`), or slots of them.
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
    # [..., n_pad] -> [..., :n] -> shape (a split parameter comes out of its gather logical already);
    # an expert parameter's [..., n_pad/X] -> its group [..., E/X, ...]
    return [full if rec.split else rec.piece_from_storage(full) for rec, full in zip(recs, fulls)]


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


def gather(flats: Sequence[FlatParameter], bufs: Sequence[jax.Array], comm: UnitComm, exits=None) -> list[jax.Array]:
    """All-gather a unit's shards for the whole step (the root unit); backward reduces them.

    Args:
      flats: the unit's FlatParameters, one per dtype.
      bufs: per flat, this device's per-parameter shards ``([n_pad/N], ...)`` (or one
        concatenated ``[L_k/N]``), ``PartitionSpec(shard_axes)`` outside.
      comm: the wires and the gradient exit (:class:`~zshard.wire.UnitComm`).
      exits: the gradient exit values ([Note: gradient exit], zshard/wire/grad_exit.py): exactly when
        the gradients land in optimizer slices (HYBRID_SHARD_OPT), per flat a tuple of
        per-parameter slices ``[n_pad/(R*S)]`` (``()`` for a frozen flat), the gradient leaving
        through them, not through ``bufs``; with error feedback, per flat the residuals.

    Returns:
      The unit's parameters in logical shapes, in slot order (all flats concatenated).

    Raises:
      ValueError: ``exits`` given where the gradient exit takes none, or missing where it lands in slices.
    """
    flats = tuple(flats)
    ex = comm.exit
    ex.check(exits, any(f.trainable for f in flats), "gather")
    exit_dtypes = None if ex.residuals else exit_dtypes_of(exits)

    @jax.custom_vjp
    def _gather(bufs, exits):
        return gather_flats(flats, bufs, comm)

    def fwd(bufs, exits):
        return gather_flats(flats, bufs, comm), (bufs, exits if ex.residuals else None)

    def bwd(res, grads):
        bufs, residuals = res
        return reduce_flats(flats, bufs, grads, comm, exit_dtypes, residuals)

    _gather.defvjp(fwd, bwd)
    return _gather(tuple(bufs), None if exits is None else tuple(exits))


def gather_param(slot: ParamLayout, shard: jax.Array, comm: UnitComm, exit_value: jax.Array | None = None) -> jax.Array:
    """All-gather one parameter where it is read outside its unit's methods; backward reduces
    its gradient through the same path as a unit's (:func:`zshard.wire.grad_exit.reduce_grads`).

    Args:
      slot: the parameter's record (logical shape, padded size; ``to_storage`` / ``from_storage``).
      shard: this device's padded slice, ``[n_pad/N]``, or ``[L, n_pad/N]`` for all layers
        of a stacked parameter.
      comm: the wires and the gradient exit.
      exit_value: the parameter's gradient exit value (as :func:`gather`'s ``exits``): its optimizer
        slice ``[..., n_pad/(R*S)]`` (HYBRID_SHARD_OPT) or its residual (error feedback).

    Returns:
      The parameter in its logical shape (``[L, *shape]`` for a stacked one), in the gather dtype.

    Raises:
      ValueError: ``exit_value`` given where the gradient exit takes none, or missing where it lands in slices.
    """
    ex = comm.exit
    ex.check(exit_value, slot.trainable, f"gather_param ({slot.path})")
    residual = ex.residuals and exit_value is not None  # the exit value is the residual (zshard/wire/feedback.py)
    exit_dtypes = None if exit_value is None or residual else (exit_value.dtype,)

    @jax.custom_vjp
    def _gather(b, exit_value):
        return gather_params([slot], [b], comm)[0]

    def fwd(b, exit_value):
        return gather_params([slot], [b], comm)[0], (exit_value if residual else None)

    def bwd(e, g):
        if residual:
            (r,), (new,) = reduce_grads([slot], [g], comm, residuals=[e])
            return r.astype(slot.dtype), new
        (r,) = reduce_grads([slot], [g], comm, exit_dtypes)
        return (None, r) if exit_dtypes is not None else (r.astype(slot.dtype), None)

    _gather.defvjp(fwd, bwd)
    return _gather(shard, exit_value)
