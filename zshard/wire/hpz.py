"""ZeRO++ hpZ: hierarchical partitioning of the backward re-gather (Wang et al., arXiv 2306.10209 section 3.2).

Under FULL_SHARD a unit's parameters rest as ``[n_pad/N]`` per device, ``N = R*S`` over
``(replica, shard)`` (``replica`` spans nodes, ``shard`` is inside one). The forward all-gathers
them over the world, as without hpZ; then each device also keeps, as a residual of the unit,
its *secondary partition*: its slice of the gathered parameter split over ``shard`` only,
``[n_pad/S]`` in the gather dtype (``param_dtype``; the dequantized values when a
``gather_format`` is set, so backward computes with exactly the forward's weights). The backward
re-gather then all-gathers that slice over ``shard`` only (inside a node) instead of the
master shard over the world. The gradient reduce-scatter is unchanged.

Per unit of ``M`` bytes in the gather dtype: the backward gather's volume over the slow
(``replica``, cross-node) link is ``0`` instead of ``M`` (ZeRO++ section 3.2; each device
receives ``M (S-1)/S`` over ``shard``, inside its node), and the secondary slices hold ``M/S``
more bytes from forward to backward (DeepSpeed ``zero_hpz_partition_size = S``). On a mesh with a
``context`` axis the secondary partition is over ``(shard, context)`` (the data axes inside a node);
a parameter split over ``tensor`` keeps ``[..., T, n_pad/S]``, each piece cut and gathered inside
its own ``shard_map`` ([Note: tensor pieces], zshard/wire/collectives.py).

``make_train_step(loss_fn, hpz=True)`` turns it on; :func:`check_hpz` refuses it where it
makes no sense, before anything compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zshard.mesh.axes import REPLICA, TENSOR
from zshard.wire.collectives import _gather_one, after, all_gather_last, param_shards
from zshard.wire.grad_exit import piece_spec
from zshard.wire.wire import UnitComm
from zshard.mesh.strategy import Strategy

__all__ = ["check_hpz", "gather_keeping_secondary", "regather_secondary", "secondary_axes"]


def secondary_axes(shard_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes the secondary partition is split over: the data ``shard_axes`` without ``replica``
    (``("shard",)``, or ``("shard", "context")`` on a mesh with a context axis)."""
    return tuple(a for a in shard_axes if a != REPLICA)


def _slots_and_shards(flats, bufs):
    slots = [s for f in flats for s in f.slots]
    shards = [b for f, buf in zip(flats, bufs) for b in param_shards(f, buf)]  # [n_pad_p/N] each
    return [getattr(s, "param", s) for s in slots], shards


def gather_keeping_secondary(flats, bufs, comm: UnitComm, ready=None):
    """The forward gather of a unit with hpZ: ``(params, secondary)``.

    Args:
      flats / bufs: the unit's FlatParameters and, per flat, this device's shards
        ``([n_pad/N], ...)``, ``PartitionSpec(("replica", "shard"))`` outside.
      comm: the step's record (``comm.hpz`` set).
      ready: as :func:`zshard.wire.collectives.gather_params` (prefetch).

    Returns:
      ``params``: the parameters in logical shapes, in the gather dtype, exactly as
      :func:`zshard.wire.collectives.gather_flats` returns them; ``secondary``: per parameter (slot
      order, all flats), this device's ``[n_pad/S]`` of the gathered ``[n_pad]``, the slice
      ``axis_index(shard) * n_pad/S`` of it, in the gather dtype: ``PartitionSpec("shard")``
      over the parameter, replicated over ``replica``; ``n_pad/S * itemsize`` bytes per
      parameter held to backward (``M/S`` per unit of ``M`` bytes). A parameter split over
      ``tensor``: ``[..., T, n_pad/S]`` (per device its piece's slice).
    """
    recs, shards = _slots_and_shards(flats, bufs)
    whole = [i for i, rec in enumerate(recs) if not rec.split]
    fulls = [None] * len(recs)
    secondary = [None] * len(recs)
    for i in whole:  # [n_pad/N] --all_gather(world)--> [n_pad]
        fulls[i] = _gather_one(recs[i], shards[i], comm)
    for i, sec in zip(whole, _cut(comm, [fulls[i] for i in whole])):
        secondary[i] = sec
    for i, rec in enumerate(recs):
        if rec.split:  # [..., T, n_pad/N] --all_gather(world) per piece--> logical, and [..., T, n_pad/S] cut
            fulls[i], secondary[i] = _gather_one(rec, shards[i], comm, keep=lambda x: _cut(comm, [x])[0])
    if ready is not None:
        fulls = after(fulls, ready)  # prefetched: the views wait for ``ready``
    return [full if rec.split else rec.from_storage(full) for rec, full in zip(recs, fulls)], secondary


def _cut(comm: UnitComm, fulls: list) -> list:
    """Per gathered ``[..., n_pad]``, this device's ``[..., n_pad/S]`` (the slice ``axis_index(shard)``).

    [n_pad] --slice(axis_index(shard))--> [n_pad/S]: one static slice per branch of a switch on the
    device's index: a conditional's result is a buffer of its own, made where the forward holds the
    gathered [n_pad]. A dynamic_slice instead is fused into its backward reader, and XLA keeps the
    whole gathered [n_pad] alive from forward to backward (ResMLP 4 x 128x128 on 2x4: temp +157,120 B
    instead of the slices' 66,048 B; an optimization_barrier is dropped by XLA:CPU).
    """
    if not fulls:
        return []
    axes = secondary_axes(comm.shard_axes)
    parts = jax.lax.axis_size(axes)

    def part(k):
        return lambda fs: [f[..., k * (f.shape[-1] // parts) : (k + 1) * (f.shape[-1] // parts)] for f in fs]

    return jax.lax.switch(jax.lax.axis_index(axes), [part(k) for k in range(parts)], fulls)


def regather_secondary(flats, secondary, comm: UnitComm, ready=None) -> list[jax.Array]:
    """The backward re-gather with hpZ: the secondary slices ``[n_pad/S]`` all-gathered over
    ``shard`` only (intra-node) -> the parameters in logical shapes, bit-identical to the
    forward's (``ready``: as :func:`zshard.wire.collectives.gather_params`)."""
    recs = [getattr(s, "param", s) for f in flats for s in f.slots]
    axes = secondary_axes(comm.shard_axes)
    # [n_pad/S] --all_gather(shard)--> [n_pad] (split over tensor: per piece, [T, n_pad/S] -> the logical value)
    fulls = [_regather_pieces(rec, sec, axes) if rec.split else all_gather_last(sec, axes) for rec, sec in zip(recs, secondary)]
    if ready is not None:
        fulls = after(fulls, ready)
    return [full if rec.split else rec.from_storage(full) for rec, full in zip(recs, fulls)]


def _regather_pieces(rec, sec: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[..., T, n_pad/S]`` -> the logical value split over ``tensor``, each piece gathered over ``shard``."""
    lead = sec.ndim - 2

    def piece(x):  # [..., 1, n_pad/S] -> [..., n_pad/S] --all_gather(shard)--> [..., n_pad] -> the piece
        return rec.piece_from_storage(all_gather_last(jnp.squeeze(x, lead), axes))

    return jax.shard_map(piece, in_specs=piece_spec(lead), out_specs=rec.tp_spec(lead), axis_names={TENSOR})(sec)


def check_hpz(plan) -> None:
    """Refuse ``hpz=True`` where it makes no sense, before anything compiles.

    Raises:
      ValueError: a strategy other than FULL_SHARD (HYBRID_SHARD / HYBRID_SHARD_OPT gather over
        ``shard`` only already; SHARD_GRAD_OP / HYBRID_SHARD_ZERO2 keep the gathered weights
        from forward to backward; NO_SHARD / SHARD_OPT gather nothing), a mesh with
        ``replica = 1`` (the world gather is already intra-node: hpZ would only add ``M/S``
        bytes), or with ``shard = 1`` (and no context axis: the secondary partition would be the
        whole weights, SHARD_GRAD_OP's memory).
    """
    st = plan.strategy
    if st is not Strategy.FULL_SHARD:
        why = {
            Strategy.HYBRID_SHARD: "already gathers over shard only (the backward re-gather never crosses replica)",
            Strategy.HYBRID_SHARD_OPT: "already gathers over shard only (the backward re-gather never crosses replica)",
            Strategy.SHARD_GRAD_OP: "keeps the gathered weights from forward to backward (there is no re-gather)",
            Strategy.HYBRID_SHARD_ZERO2: "keeps the gathered weights from forward to backward (there is no re-gather)",
        }.get(st, "keeps every parameter whole (there is no gather)")
        raise ValueError(
            f"hpz=True (ZeRO++ hierarchical partitioning) with strategy {st.value}: {st.value} {why}. hpZ applies to "
            "FULL_SHARD only: use strategy='FULL_SHARD' with hpz=True, or drop hpz=True"
        )
    if getattr(plan, "expert_split", None):
        raise ValueError(
            f"hpz=True (ZeRO++ hierarchical partitioning) with expert parallelism (the mesh's expert={plan.axes.expert}) is "
            "not supported: drop hpz=True, or build the mesh without expert= (docs/expert-parallel.md)"
        )
    if plan.axes.replica == 1:
        raise ValueError(
            f"hpz=True (ZeRO++ hierarchical partitioning) on the mesh {dict(plan.mesh.shape)} with replica=1: the world "
            "all-gather is already inside one node, so hpZ would move the same bytes and only hold M/S more. Drop hpz=True, "
            "or put the nodes on a replica axis (zshard.make_mesh(nodes, devices_per_node))"
        )
    if plan.axes.size(secondary_axes(plan.data_axes)) == 1:
        raise ValueError(
            f"hpz=True (ZeRO++ hierarchical partitioning) on the mesh {dict(plan.mesh.shape)} with shard=1: the secondary "
            "partition over shard would be the whole weights, kept from forward to backward, which is SHARD_GRAD_OP. Use "
            "strategy='SHARD_GRAD_OP', or give each node's devices the shard axis (zshard.make_mesh(nodes, devices_per_node))"
        )
