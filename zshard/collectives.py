"""All-gather and reduce-scatter of one unit inside ``shard_map``, with hand-written VJPs.

Two primitives, both on a unit's FlatParameters (see ``zshard.flat``), each parameter's
shard gathered into, and its gradient reduce-scattered from, its own buffer (no concatenated
FlatParameter copy either way; docs/benchmarks.md, "Where the S step time went"):

- :func:`gather` -- forward: all-gather; backward: reduce-scatter over the shard axes, then
  all-reduce of the *scattered shard* over the replica axes (HYBRID_SHARD). Used for the
  root unit, whose parameters stay gathered for the whole step.
- :func:`run_unit` -- one unit call: forward gathers, runs the unit and keeps only the
  shards and the unit's inputs as residuals; backward gathers again, recomputes the unit,
  and reduce-scatters the parameter gradient. The gathered weights are never saved for
  backward (ZeRO-3 / FSDP ``reshard_after_forward=True``).

HYBRID_SHARD_OPT passes *gradient sinks* to both: backward reduce-scatters over ``shard`` and
then over ``replica`` (:func:`replica_slices`) and returns ``[n_pad/(R*S)]`` per parameter as
the sinks' cotangent (docs/memory.md, "How the step does it").

Why custom VJPs (docs/design.md section 7): left to autodiff, a parameter gathered over
``shard`` only but used with batch data that varies over ``replica`` is implicitly
broadcast, and the transpose of that broadcast is an all-reduce of the *full* gradient over
``replica``. Here the cross-replica sum happens once, on the shard. And on CPU XLA
merges a rematerialised re-gather with the forward one unless the backward gather depends
on the incoming cotangent; the optimization barriers below make the schedule a data
dependency: the forward gather waits for the unit's input, the backward one for its
output cotangent.

The gradients that come out are sums over devices; the caller scales the loss by
``1 / world`` so that the sum is the gradient of the global mean loss.

Over 400 lines because the two custom VJPs share their gather / scatter helpers and the
schedule tokens of the forced schedule and the prefetch chain; splitting them apart would
export those private helpers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zshard.flat import FlatParameter, ParamLayout
from zshard.precision import FULL_PRECISION, MixedPrecision

__all__ = [
    "REMAT_POLICIES",
    "PrefetchLink",
    "UnitComm",
    "checkpointed",
    "gather",
    "gather_param",
    "remat_policy",
    "run_unit",
    "schedule_token",
    "vary",
    "varying_axes",
]


@dataclasses.dataclass(frozen=True)
class UnitComm:
    """How one unit communicates inside the step: the settings every unit call reads.

    Attributes:
      shard_axes: mesh axes a FlatParameter is split over (all-gather, reduce-scatter).
      replica_axes: mesh axes the reduce-scattered gradient shard is all-reduced over
        (HYBRID_SHARD); empty under gradient accumulation, which all-reduces once per step.
      mp: the :class:`~zshard.MixedPrecision` (gather in ``param_dtype``, reduce in ``reduce_dtype``).
      remat: the activation-checkpointing policy inside the unit (:func:`checkpointed`).
      reshard: reshard after forward (FULL_SHARD, HYBRID_SHARD): backward gathers again.
      scatter_axes: HYBRID_SHARD_OPT: the axes the gradient shard ``[n_pad/S]`` is
        reduce-scattered over right after the ``shard`` reduce-scatter, inside the unit's
        backward, into the parameter's *gradient sink* ``[n_pad/(R*S)]`` (see
        :func:`run_unit`); used only where the caller passes sinks.
      scatter_parts: ``R``, devices along ``scatter_axes``.
      sinks: the unit calls of this step pass gradient sinks (HYBRID_SHARD_OPT in a train
        step; ``zshard.intercept.materialize`` sets it): :func:`run_unit`, :func:`gather` and
        :func:`gather_param` require their ``sinks`` argument exactly when it is set (and
        trainable parameters are gathered).
    """

    shard_axes: tuple[str, ...]
    replica_axes: tuple[str, ...] = ()
    mp: MixedPrecision = FULL_PRECISION
    remat: Any = "block"
    reshard: bool = True
    scatter_axes: tuple[str, ...] = ()
    scatter_parts: int = 1
    sinks: bool = False

    @property
    def vary_axes(self) -> tuple[str, ...]:
        """Every axis a gathered parameter must vary over besides ``shard_axes``: the axes its
        gradient is later summed over (``replica_axes``, and ``scatter_axes`` with sinks)."""
        return self.replica_axes + (self.scatter_axes if self.sinks else ())

    def check_sinks(self, sinks, trainable: bool, where: str) -> None:
        """Raise ``ValueError`` where ``sinks`` are given without :attr:`sinks`, or missing with
        it for ``trainable`` parameters (frozen ones have no sink)."""
        if (sinks is not None and not self.sinks) or (sinks is None and self.sinks and trainable):
            raise ValueError(
                f"zshard: {where} called {'with' if sinks is not None else 'without'} gradient sinks, but its UnitComm has "
                f"sinks={self.sinks}; build the UnitComm with sinks=True exactly when the calls of trainable "
                f"parameters pass sinks"
            )


@dataclasses.dataclass(eq=False)
class PrefetchLink:
    """One block-unit call's place in the prefetch chain (docs/design.md, "Prefetch chain").

    Attributes:
      token: float32 scalar zero that depends on the call's inputs only; a later call's
        forward gather waits on it instead of on its own input.
      trace: the JAX trace the call was made in; a link is only followed from the same
        trace (a unit called inside ``jax.checkpoint``, ``lax.scan``, ``vmap`` ... of the
        model's own code is not prefetched across that boundary).
      taken: set when a later call waits on ``token``; that call's backward then hands a
        token of its output cotangent back, and this call's re-gather waits on it.
    """

    token: Any = None
    trace: Any = None
    taken: bool = False


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over, inside ``shard_map`` (its type's manual-axis record)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def vary(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Mark ``x`` as varying over ``axes`` (no data movement) where it is not already."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def schedule_token(tree) -> jax.Array:
    """A float32 scalar zero that is data-dependent on ``tree`` (``0 * t`` for one finite
    scalar ``t`` read from it; a constant zero when ``tree`` holds no floating array)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    t = leaves[0].reshape(-1)[0]
    return (jnp.where(jnp.isfinite(t), t, 0) * 0).astype(jnp.float32)


def _after(bufs, tree):
    """``bufs`` unchanged, but data-dependent on ``tree`` so XLA cannot schedule or merge early.

    Adds :func:`schedule_token` of ``tree``: exact (``x + 0 == x``), and no NaN or inf in ``tree`` can
    leak into ``bufs``. The XLA CPU compiler drops ``optimization_barrier``, so the
    dependency must be real data flow.
    """
    if not any(jnp.issubdtype(x.dtype, jnp.inexact) and x.size for x in jax.tree.leaves(tree)):
        return bufs
    t = schedule_token(tree)
    return jax.tree.map(lambda b: b + t.astype(b.dtype), tuple(bufs))  # per-parameter shards too


def _after_tree(tree, dep):
    """:func:`_after` on the floating leaves of a pytree (others pass through)."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    for i, x in zip(floats, _after([leaves[i] for i in floats], dep)):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _param_shards(flat: FlatParameter, buf) -> list[jax.Array]:
    """A unit's shards of one FlatParameter -> per parameter ``[n_pad_p/N]`` (a unit is called
    with per-parameter shards; a concatenated ``[L/N]`` is split into them, no copy: slices)."""
    return list(buf) if isinstance(buf, (tuple, list)) else flat.split_shard(buf)


def _gather_all(flats, bufs, comm: UnitComm, ready=None):
    """A unit's shards -> its parameters in logical shapes: one all-gather per parameter
    (XLA:GPU and TPU have a pass that combines independent all-gathers, ``AllGatherCombiner``;
    not measured here. XLA:CPU runs them one by one, like the compiler-sharded peer's
    per-weight gathers).

    Each parameter is gathered straight into its own ``[n_pad]`` buffer, so its logical view
    is a slice + reshape of it (a bitcast where there is no padding): no FlatParameter
    concatenated before the gather, no strided column slices of a gathered ``[N, L/N]`` after
    it, and each gathered weight is its own allocation, freed after its last use (a
    gathered FlatParameter stayed alive until the unit's last small parameter was read).
    Docs: docs/benchmarks.md, "Where the S step time went".

    ``comm.vary_axes``: every axis the gathered parameters must vary over besides the shard
    axes. ``ready``: a prefetched gather (issued before this unit's own input or cotangent
    exists) is cut into logical views only once ``ready`` exists (:func:`_after` on the
    gathered parameters; XLA fuses the scalar add into their consumers). Without it XLA
    materialises a prefetched unit's views as soon as it arrives and holds it twice: one more
    gathered unit of temp (config P, ``prefetch=1``: 4.35 -> 3.22 gathered units,
    docs/benchmarks.md).
    """
    slots = [s for f in flats for s in f.slots]
    shards = [b for f, buf in zip(flats, bufs) for b in _param_shards(f, buf)]  # [n_pad_p/N] each
    # The gathered parameters meet batch data that varies over every mesh axis. Marking the
    # shard varying over replica *before* the gather keeps autodiff from inserting a
    # broadcast whose transpose would all-reduce the full gradient across replicas
    # (docs/design.md section 7, "the replica trap"); the backward sums only the shard instead.
    shards = [vary(b, comm.shard_axes + comm.vary_axes).astype(comm.mp.gather_dtype(s.dtype)) for s, b in zip(slots, shards)]
    if comm.shard_axes:
        # [n_pad_p/N] --all_gather(shard_axes, tiled)--> [n_pad_p], per parameter
        fulls = [_all_gather(b, comm.shard_axes) for b in shards]
    else:  # NO_SHARD / SHARD_OPT: the shard is the whole padded parameter
        fulls = shards
    if ready is not None:
        fulls = _after(fulls, ready)  # [n_pad_p] + 0: the views below wait for ``ready``
    return [s.param.from_storage(full) for s, full in zip(slots, fulls)]  # [n_pad_p] -> [:n_p] -> shape


def _all_gather(b: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[..., n/N] --all_gather(axes, tiled, last dim)--> [..., n]``; a zero-size parameter's
    ``[..., 0]`` is already whole (XLA refuses a zero gather dimension)."""
    return jax.lax.all_gather(b, axes, axis=b.ndim - 1, tiled=True) if b.shape[-1] else b


def _reduce_scatter_last(g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[..., n] --reduce_scatter(axes, tiled, last dim)--> [..., n/N]``; a zero-size
    parameter's ``[..., 0]`` has nothing to sum."""
    return jax.lax.psum_scatter(g, axes, scatter_dimension=g.ndim - 1, tiled=True) if g.shape[-1] else g


def _reduce_scatter(grads, slots, comm: UnitComm, to_sinks: bool) -> list[jax.Array]:
    """Full-size gradients of one FlatParameter's parameters (logical shapes) -> this device's
    summed shards ``[n_pad_p/N]`` in the reduce dtype: one reduce-scatter per parameter (XLA:GPU
    has a combiner pass for them, ``ReduceScatterCombiner``), straight from each gradient's own ``[n_pad_p]``
    (no FlatParameter-layout copy of the unit's gradient); + the replica all-reduce of the
    shards (HYBRID_SHARD) unless ``to_sinks``."""
    axes = comm.shard_axes + comm.vary_axes
    # [*shape] -> [n_pad_p] (zero padding), varying over every axis it is summed over
    full = [vary(s.param.to_storage(g.astype(comm.mp.grad_dtype(s.dtype))), axes) for s, g in zip(slots, grads)]
    if comm.shard_axes:
        # [n_pad_p] --reduce_scatter(shard_axes, tiled)--> [n_pad_p/N], per parameter
        full = [_reduce_scatter_last(g, comm.shard_axes) for g in full]
    if comm.replica_axes and not to_sinks:
        # [n_pad_p/N] --all_reduce(replica_axes)--> [n_pad_p/N]   (only the shards cross replicas)
        full = list(jax.lax.psum(tuple(full), comm.replica_axes))
    return full


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


def _dtypes(sinks):
    """Per flat, the dtypes of its sinks (static, for the backward); ``None`` for no sinks."""
    return None if sinks is None else tuple(tuple(z.dtype for z in per_flat) for per_flat in sinks)


def _scatter_all(flats, bufs, grads, comm, sink_dtypes=None):
    """The gradients of a unit's parameters -> ``(cotangents of bufs, cotangents of sinks)``.

    Without sinks: each parameter's gradient reduce-scattered over ``comm.shard_axes``
    (+ all-reduced over ``comm.replica_axes``), as the bufs' cotangent (per-parameter shards,
    or concatenated where the unit was called with a FlatParameter shard). With sinks
    (HYBRID_SHARD_OPT): reduce-scattered over ``shard`` then over ``comm.scatter_axes``
    (:func:`replica_slices`), as the sinks' cotangent; the bufs get none (they are not
    differentiated), so only ``[n_pad/(R*S)]`` per parameter leaves the unit.
    ``sink_dtypes``: per flat, the sinks' dtypes (``()`` for a frozen flat); ``None``: no sinks.
    """
    out, to_sinks, i = [], [], 0
    for k, (f, b) in enumerate(zip(flats, bufs)):
        n = len(f.slots)
        if not f.trainable:  # frozen: no gradient, no reduce-scatter
            out.append(None if sink_dtypes is not None else jax.tree.map(jnp.zeros_like, b))
            to_sinks.append(())
        else:
            shards = _reduce_scatter(grads[i : i + n], f.slots, comm, sink_dtypes is not None)  # [n_pad_p/N] each
            if sink_dtypes is not None:
                # per parameter [n_pad_p/S] --reduce_scatter(replica)--> [n_pad_p/(R S)]
                mine = replica_slices(shards, comm.scatter_axes, comm.scatter_parts)
                to_sinks.append(tuple(g.astype(dtype) for g, dtype in zip(mine, sink_dtypes[k])))
                out.append(None)
            else:
                shards = [g.astype(f.dtype) for g in shards]
                # per-parameter shards in: ([n_pad_p/N], ...) out; a FlatParameter shard in: [L/N] out
                out.append(tuple(shards) if isinstance(b, (tuple, list)) else f.concat_shards(shards))
                to_sinks.append(())
        i += n
    return tuple(out), (None if sink_dtypes is None else tuple(to_sinks))


def gather(flats: Sequence[FlatParameter], bufs: Sequence[jax.Array], comm: UnitComm, sinks=None) -> list[jax.Array]:
    """All-gather a unit's FlatParameter shards; backward reduce-scatters (+ replica all-reduce).

    Args:
      flats: the unit's layouts, one per dtype.
      bufs: this device's shards, ``[L_k / N]`` each (or per-parameter ``([n_pad/N], ...)``),
        ``PartitionSpec(shard_axes)`` outside.
      comm: the axes and mixed precision (gather in ``param_dtype``, reduce in ``reduce_dtype``).
      sinks: exactly when ``comm.sinks`` (HYBRID_SHARD_OPT): per flat, a tuple of
        per-parameter gradient sinks ``[n_pad/(R*S)]`` (``()`` for a frozen flat); the
        gradient leaves through them (:func:`run_unit`), not through ``bufs``.

    Returns:
      The unit's parameters in logical shapes, in slot order (all flats concatenated).

    Raises:
      ValueError: ``sinks`` given without ``comm.sinks`` or missing with it.
    """
    flats = tuple(flats)
    comm.check_sinks(sinks, any(f.trainable for f in flats), "gather")
    sink_dtypes = _dtypes(sinks)

    @jax.custom_vjp
    def _gather(bufs, sinks):
        return _gather_all(flats, bufs, comm)

    def fwd(bufs, sinks):
        return _gather_all(flats, bufs, comm), bufs

    def bwd(bufs, grads):
        return _scatter_all(flats, bufs, grads, comm, sink_dtypes)

    _gather.defvjp(fwd, bwd)
    return _gather(tuple(bufs), None if sinks is None else tuple(sinks))


def gather_param(slot: ParamLayout, shard: jax.Array, comm: UnitComm, sink: jax.Array | None = None) -> jax.Array:
    """All-gather one parameter where it is read outside its unit's methods; backward
    reduce-scatters its gradient (+ replica all-reduce of the shard), like :func:`gather`.

    Args:
      slot: the parameter's record (logical shape, padded size; ``to_storage`` / ``from_storage``).
      shard: this device's padded slice, ``[n_pad/N]``, or ``[L, n_pad/N]`` for all layers
        of a stacked parameter.
      comm: axes and mixed precision.
      sink: exactly when ``comm.sinks`` (HYBRID_SHARD_OPT): the parameter's gradient sink
        ``[..., n_pad/(R*S)]``; the gradient is reduce-scattered over ``comm.scatter_axes``
        too and leaves through it.

    Returns:
      The parameter in its logical shape (``[L, *shape]`` for a stacked one), in the gather dtype.

    Raises:
      ValueError: ``sink`` given without ``comm.sinks`` or missing with it.
    """
    comm.check_sinks(sink, slot.trainable, f"gather_param ({slot.path})")
    shard_axes, mp, replica_axes = comm.shard_axes, comm.mp, comm.vary_axes
    sink_dtype = None if sink is None else sink.dtype

    def full_of(b):
        b = vary(b, shard_axes + replica_axes).astype(mp.gather_dtype(slot.dtype))
        # [..., n_pad/N] --all_gather(shard_axes, tiled)--> [..., n_pad]
        full = _all_gather(b, shard_axes) if shard_axes else b
        return slot.from_storage(full)  # [..., n_pad] -> [..., n] -> [..., *shape]

    @jax.custom_vjp
    def _gather(b, sink):
        return full_of(b)

    def fwd(b, sink):
        return full_of(b), None

    def bwd(_, g):
        g = vary(slot.to_storage(g.astype(mp.grad_dtype(slot.dtype))), shard_axes + replica_axes)  # [..., *shape] -> [..., n_pad]
        if shard_axes:
            # [..., n_pad] --reduce_scatter(shard_axes, tiled)--> [..., n_pad/N]
            g = _reduce_scatter_last(g, shard_axes)
        if sink_dtype is not None:
            # [..., n_pad/S] --reduce_scatter(replica)--> [..., n_pad/(R S)], into the sink
            (g,) = replica_slices([g], comm.scatter_axes, comm.scatter_parts)
            return None, g.astype(sink_dtype)
        if comm.replica_axes:
            g = jax.lax.psum(g, comm.replica_axes)  # [..., n_pad/N] --all_reduce(replica)--> [..., n_pad/N]
        return g.astype(shard.dtype), None

    _gather.defvjp(fwd, bwd)
    return _gather(shard, sink)


REMAT_POLICIES = ("none", "block", "dots")


def remat_policy(remat):
    """Validate a ``remat=`` value; returns it (a name, or a ``jax.checkpoint`` policy callable).

    Raises:
      ValueError: not one of ``"none"``, ``"block"``, ``"dots"`` or a callable.
    """
    if callable(remat) or remat in REMAT_POLICIES:
        return remat
    raise ValueError(
        f"remat={remat!r}: use one of {', '.join(map(repr, REMAT_POLICIES))} or a jax.checkpoint policy "
        "(for example jax.checkpoint_policies.dots_with_no_batch_dims_saveable)"
    )


def checkpointed(apply: Callable, remat) -> Callable:
    """``apply`` under the activation-checkpointing policy ``remat`` (gathered weights are inputs).

    ``"none"``: no recompute, every activation saved; ``"block"``: save only the inputs
    (``jax.checkpoint``, recompute the whole block); ``"dots"``: save matmul outputs without
    (``jax.checkpoint_policies.dots_saveable``), recompute the rest; a
    callable: ``jax.checkpoint(apply, policy=remat)``.
    """
    if remat == "none":
        return apply
    if remat == "block":
        return jax.checkpoint(apply)
    return jax.checkpoint(apply, policy=jax.checkpoint_policies.dots_saveable if remat == "dots" else remat)


def run_unit(
    apply: Callable,
    flats: Sequence[FlatParameter],
    bufs: Sequence[jax.Array],
    inputs,
    comm: UnitComm,
    after: PrefetchLink | None = None,
    link: PrefetchLink | None = None,
    name: str = "unit",
    sinks=None,
):
    """Run ``apply(params, inputs)`` with the unit's parameters gathered just in time.

    Args:
      apply: ``(list of parameters in logical shapes, inputs) -> outputs``; closes over no
        tracer (only static structure).
      flats / bufs: the unit's layouts and this device's FlatParameter shards ``[L_k/N]``.
      inputs: pytree of arrays, the unit's dynamic inputs.
      comm: axes, mixed precision, remat policy and reshard-after-forward of the unit.
        ``comm.reshard`` (FULL_SHARD, HYBRID_SHARD): the gathered weights are never
        residuals, whatever ``comm.remat``; backward all-gathers again. Otherwise
        (SHARD_GRAD_OP, HYBRID_SHARD_ZERO2) they are kept from forward to backward.
      after: an earlier call's :class:`PrefetchLink` (prefetch): the forward gather waits
        only for that call's *input*, so it can be issued before that unit computes;
        backward hands a token of this call's output cotangent back to it, so that unit's
        re-gather can be issued before this unit's backward computes. ``None``: no prefetch.
      link: this call's own link, filled in here (``link.token``); a later call may take it.
      name: the unit's name, for ``jax.named_scope`` (``zshard.unit.<name>.forward`` /
        ``.backward``: profiles and HLO read by unit and phase).
      sinks: exactly when ``comm.sinks``, HYBRID_SHARD_OPT (docs/memory.md, "Gradient sinks"): per flat, a tuple of
        per-parameter arrays ``[n_pad/(R*S)]`` of the parameter dtype whose values are
        never read (``()`` for a frozen flat). The caller differentiates with respect to
        them instead of ``bufs``: backward reduce-scatters the gradient over ``shard`` and
        then over ``comm.scatter_axes`` and returns it as the sinks' cotangent, so a
        unit's gradient leaves its backward as ``[n_pad/(R*S)]`` per parameter (under
        ``nnx.scan`` the loop stacks ``[L, n_pad/(R*S)]``), never ``[n_pad/S]``.

    Returns:
      ``apply``'s outputs. Residuals are ``bufs``, ``inputs``, the gathered weights only if
      ``not comm.reshard``, and (for ``remat != "block"``) the activations the policy saves;
      backward recomputes what was not saved and reduce-scatters the parameter gradient.

    Raises:
      ValueError: ``sinks`` given without ``comm.sinks`` or missing with it.
    """
    flats = tuple(flats)
    remat, reshard = comm.remat, comm.reshard
    comm.check_sinks(sinks, any(f.trainable for f in flats), f"run_unit ({name})")
    sink_dtypes = _dtypes(sinks)
    link = link if link is not None else PrefetchLink()
    pullback_layout = {}  # set while tracing fwd: the pullback's structure and where the weights sat in it

    @jax.custom_vjp
    def _unit(bufs, sinks, inputs, after_token):
        return apply(_gather_all(flats, bufs, comm), inputs), schedule_token(inputs)

    def fwd(bufs, sinks, inputs, after_token):  # the sinks' values are never read
        with jax.named_scope(f"zshard.unit.{name}.forward"):
            return _fwd(bufs, inputs, after_token)

    def _fwd(bufs, inputs, after_token):
        # The gather may not start before the unit's input exists (or, prefetching, the
        # input of the earlier unit call), so the gathered copy is alive only around this
        # unit (and the one before it). docs/design.md, "Forced schedule".
        ready = None if after is None else inputs  # prefetched: slice only once this unit's input exists
        params = _gather_all(flats, _after(bufs, inputs if after is None else after_token), comm, ready)
        kept = [] if reshard else params
        out_token = schedule_token(inputs)
        if remat == "block":
            return (apply(params, inputs), out_token), (bufs, kept, inputs, [])
        out, pullback = jax.vjp(checkpointed(apply, remat), params, inputs)
        # The pullback's leaves are the saved activations plus the gathered weights; keep
        # the activations, drop the weights (backward gathers them again, or kept has them).
        # docs/design.md, "Pullback splice".
        leaves, pullback_layout["treedef"] = jax.tree.flatten(pullback)
        pullback_layout["weight"] = [next((j for j, p in enumerate(params) if leaf is p), None) for leaf in leaves]
        saved = [leaf for leaf, j in zip(leaves, pullback_layout["weight"]) if j is None]
        return (out, out_token), (bufs, kept, inputs, saved)

    def bwd(res, cts):
        with jax.named_scope(f"zshard.unit.{name}.backward"):
            return _bwd(res, cts)

    def _bwd(res, cts):
        bufs, kept, inputs, saved = res
        primal_inputs = inputs
        g, g_token = cts
        if reshard:
            # The re-gather depends on a cotangent, so it cannot be merged with the forward
            # gather: this unit's own, or (prefetch) the token a later unit handed back as
            # soon as its own backward began.
            ready = g if link.taken else None  # prefetched: slice only once this unit's cotangent exists
            params = _gather_all(flats, _after(bufs, g_token if link.taken else g), comm, ready)
        else:
            params = kept
            # Kept weights: make the recompute depend on the cotangent instead, or XLA folds it
            # into the forward pass and keeps every activation alive.
            inputs, saved = _after_tree(inputs, g), _after_tree(saved, g)
        if remat == "block":
            out, pullback = jax.vjp(apply, params, inputs)
            # The recompute's inputs may vary over more mesh axes than in forward (tied to the
            # cotangent above): give each cotangent the type of the output it belongs to.
            g = jax.tree.map(lambda c, o: vary(c, tuple(varying_axes(o))) if _is_real(c) else c, g, out)
        else:
            rest = iter(saved)
            leaves = [next(rest) if j is None else params[j] for j in pullback_layout["weight"]]
            pullback = jax.tree.unflatten(pullback_layout["treedef"], leaves)
        d_params, d_inputs = pullback(g)
        # An input that is the same on every device (an invariant value, e.g. a BatchNorm
        # statistic) was used by every device: its cotangent is the sum over the axes the
        # computation varied over (the transpose of the implicit broadcast).
        d_inputs = jax.tree.map(_cotangent_like, d_inputs, primal_inputs)
        d_after = () if after is None else _like(schedule_token(g), after_vma)  # the earlier unit's re-gather may start now
        d_bufs, d_sinks = _scatter_all(flats, bufs, d_params, comm, sink_dtypes)
        return d_bufs, d_sinks, d_inputs, d_after

    after_vma = frozenset() if after is None else varying_axes(after.token)
    _unit.defvjp(fwd, bwd)
    out, link.token = _unit(tuple(bufs), None if sinks is None else tuple(sinks), inputs, () if after is None else after.token)
    return out


def _is_real(c) -> bool:
    return hasattr(c, "dtype") and c.dtype != jax.dtypes.float0


def _cotangent_like(c, primal):
    """``c`` summed over the mesh axes it varies over and ``primal`` does not."""
    if not _is_real(c):
        return c
    extra = tuple(sorted(varying_axes(c) - varying_axes(primal)))
    c = jax.lax.psum(c, extra) if extra else c
    return vary(c, tuple(sorted(varying_axes(primal))))


def _like(t: jax.Array, vma: frozenset) -> jax.Array:
    """``t`` with the varying mesh axes ``vma`` of the value it is the cotangent of; a
    constant zero where ``t`` varies over more (an earlier unit whose inputs were integers
    only: its token was a constant, and nothing waits on it)."""
    have = varying_axes(t)
    if have <= vma:
        return vary(t, tuple(sorted(vma)))
    zero = jnp.zeros((), t.dtype)
    return vary(zero, tuple(sorted(vma))) if vma else zero
