"""A parameter-shaped value held as this device's shard, and the arithmetic on it that the
global-view optimizer (:mod:`zshard.optim.optim_global`) evaluates equations with.

:class:`Layout` says how one logical parameter shape lies in its shards (``[*lead, n_pad/N]``
per device); :class:`Shard` holds such a value; ``_Partial`` a scalar partial sum. ``_Ctx``
owns the element arithmetic (flat indices, the padding mask, logical coordinates), turning
whole values into shards and back (one all-gather, :func:`zshard.wire.collectives.all_gather_last`),
the all-reduces of locally reduced values, reductions of a shard over all or some axes, and
``random_bits`` drawn element for element as on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from zshard.wire.collectives import all_gather_last
from zshard.params.flat import ParamLayout, padded_size

__all__ = ["Layout", "Shard", "Ctx", "Partial", "random_bits", "reduce_shard"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one logical parameter shape lies in its shards.

    Attributes:
      shape: logical shape; ``[L, *inner]`` for a stacked parameter (``lead=1``).
      lead: leading (layer) dimensions kept whole on every device: 0 or 1.
      num_shards: ``N``.
      tp_dim: the dimension of ``inner`` split over the ``tensor`` axis (``None``: not split);
        each device then holds ``[*lead, T, n_pad/N]``: every tensor piece's slice, ``T`` left to
        the compiler ([Note: tensor pieces] in zshard/wire/collectives.py, ParamLayout's order).
      tp: ``T``.
      padded: ``n_pad`` of one layer (one piece) where the parameter is padded beyond a multiple
        of ``N`` (a quantized format's blocks), else ``None``.
    """

    shape: tuple
    lead: int
    num_shards: int
    tp_dim: int | None = None
    tp: int = 1
    padded: int | None = None

    @property
    def inner(self) -> tuple:  # one layer's logical shape
        return tuple(self.shape[self.lead :])

    @property
    def piece(self) -> tuple:  # one tensor piece of one layer (the layer, unsplit)
        inner, d = self.inner, self.tp_dim
        return inner if d is None else inner[:d] + (inner[d] // self.tp,) + inner[d + 1 :]

    @property
    def pieces(self) -> tuple:  # (T,) split, else ()
        return () if self.tp_dim is None else (self.tp,)

    @property
    def n(self) -> int:  # elements of one piece of one layer
        return int(np.prod(self.piece, dtype=np.int64))

    @property
    def n_pad(self) -> int:  # elements of one stored layer
        return padded_size(self.n, self.num_shards) if self.padded is None else self.padded

    @property
    def n_loc(self) -> int:  # n_pad / N
        return self.n_pad // self.num_shards

    def storage(self, dtype) -> ParamLayout:
        """The stored form of a ``dtype`` value of this shape (``[*lead, (T,) n_pad]``)."""
        return ParamLayout.build((), self.inner, dtype, self.n_pad, self.shape[0] if self.lead else None,
                                 tp_dim=self.tp_dim, tp=self.tp)

    @property
    def local_shape(self) -> tuple:  # [*lead, (T,) n_pad/N]
        return tuple(self.shape[: self.lead]) + self.pieces + (self.n_loc,)

    @property
    def flat_dim(self) -> int:  # the dimension of the local shape that runs over a piece's elements
        return len(self.local_shape) - 1


@dataclasses.dataclass(frozen=True)
class Shard:
    """A parameter-shaped value held as this device's shard ``[*lead, n_pad/N]`` (padding arbitrary)."""

    x: jax.Array
    layout: Layout


@dataclasses.dataclass
class Partial:
    """A scalar partial sum: the whole value is its ``psum`` over the optimizer axes
    (computed once, on first use, and kept in ``total``)."""

    x: jax.Array
    total: Any = None


class Ctx:
    """Where the evaluation runs: the optimizer's mesh axes and this device's index on them."""

    def __init__(self, axes: tuple, num_shards: int, layouts: dict, record: list | None = None):
        self.axes, self.num_shards = axes, num_shards
        self.index = jax.lax.axis_index(axes) if axes and num_shards > 1 else 0
        by_shape: dict = {}
        for lay in layouts.values():
            by_shape.setdefault(lay.shape, set()).add(lay)
        # a shape shared by a stacked and an unstacked parameter is ambiguous: held whole
        self.by_shape = {s: next(iter(v)) for s, v in by_shape.items() if len(v) == 1}
        # ("all-gather" | "all-reduce", X: bytes of the whole buffer) of each collective issued
        self.collectives: list = record if record is not None else []
        # [Note: one matrix at a time] The shard of the last whole-parameter result: the next
        # all-gather's input adds a zero read from it (real data flow: XLA:CPU drops
        # optimization barriers), so XLA cannot gather every matrix
        # and run every Newton-Schulz iteration at once; at most one gathered parameter (and
        # the temporaries of its update) is alive at a time.
        self.last = None

    # ---- layout arithmetic -------------------------------------------------------------
    def flat_index(self, lay: Layout) -> jax.Array:
        """Index of each local element inside its layer (inside its tensor piece, split):
        ``r * n_loc + j``, int32 of ``lay.local_shape``."""
        j = jax.lax.broadcasted_iota(jnp.int32, lay.local_shape, lay.flat_dim)
        return j + jnp.int32(lay.n_loc) * self.index

    def valid(self, lay: Layout) -> jax.Array:
        """bool of ``lay.local_shape``: the element is a real one, not padding."""
        return self.flat_index(lay) < lay.n

    def coords(self, lay: Layout) -> list:
        """Logical coordinates of each local element, one int32 of ``lay.local_shape`` per
        dimension of ``lay.shape`` (padding clipped to the last element); a split parameter's
        piece ``t`` starts at ``t * piece[tp_dim]`` along ``tp_dim``."""
        out = [jax.lax.broadcasted_iota(jnp.int32, lay.local_shape, d) for d in range(lay.lead)]
        f = jnp.minimum(self.flat_index(lay), lay.n - 1)
        piece = lay.piece
        for d in range(len(piece)):
            stride = int(np.prod(piece[d + 1 :], dtype=np.int64))
            c = (f // stride) % piece[d]
            if d == lay.tp_dim:  # + the piece's offset: t * s_d / T
                c = c + jax.lax.broadcasted_iota(jnp.int32, lay.local_shape, lay.lead) * piece[d]
            out.append(c)
        return out

    def logical_index(self, lay: Layout) -> jax.Array:
        """Each local element's flat index in its whole logical layer (``ravel`` of :meth:`coords`
        over one layer's shape), int32 of ``lay.local_shape``; its layer's flat index unsplit."""
        if lay.tp_dim is None:
            return jnp.minimum(self.flat_index(lay), lay.n - 1)
        coords, inner = self.coords(lay)[lay.lead :], lay.inner
        flat = jnp.zeros(lay.local_shape, jnp.int32)
        for c, size in zip(coords, inner):
            flat = flat * size + c
        return flat

    def to_shard(self, x, lay: Layout) -> Shard:
        """A whole value of ``lay.shape`` (or broadcastable to it) -> this device's shard."""
        x = jnp.asarray(x)
        if x.size == 1:
            return Shard(jnp.broadcast_to(x.reshape(()), lay.local_shape), lay)
        if tuple(x.shape) != tuple(lay.shape):  # [.., 1, ..] -> index arithmetic, no full-size copy
            return self.broadcast(x, lay, tuple(range(len(lay.shape))))
        lead = tuple(lay.shape[: lay.lead]) + lay.pieces
        flat = lay.storage(x.dtype).to_storage(x)  # [*lead, *inner] -> [*lead, (T,) n_pad]
        rows = flat.reshape(lead + (self.num_shards, lay.n_loc))  # [*lead, (T,) N, n_pad/N]
        # [*lead, (T,) N, n_pad/N] --row r (no collective)--> [*lead, (T,) n_pad/N]
        return Shard(jax.lax.dynamic_index_in_dim(rows, self.index, axis=lay.flat_dim, keepdims=False), lay)

    def broadcast(self, x, lay: Layout, dims: tuple) -> Shard:
        """``broadcast_in_dim(x, lay.shape, dims)`` built only on this device's elements."""
        coords = self.coords(lay)
        idx = jnp.zeros(lay.local_shape, jnp.int32)
        for i, d in enumerate(dims):  # operand dim i -> output dim d; size-1 dims broadcast
            if x.shape[i] != 1:
                idx = idx * x.shape[i] + coords[d]
            else:
                idx = idx * 1
        return Shard(jnp.take(x.reshape(-1), idx), lay)

    def gather(self, v: Shard) -> jax.Array:
        """Shard ``[*lead, n_pad/N]`` -> the whole parameter-shaped value (one all-gather)."""
        lay, x = v.layout, v.x
        if self.last is not None and jnp.issubdtype(x.dtype, jnp.inexact):  # [Note: one matrix at a time]
            t = self.last.reshape(-1)[0]
            x = x + (jnp.where(jnp.isfinite(t), t, 0) * 0).astype(x.dtype)  # exact: x + 0
        if self.num_shards > 1:
            self.collectives.append(("all-gather", x.size * x.dtype.itemsize * self.num_shards))
            # [*lead, (T,) n_pad/N] --all_gather(opt axes)--> [*lead, (T,) n_pad]
            x = all_gather_last(x, self.axes, invariant=True)
        return lay.storage(x.dtype).from_storage(x)  # [*lead, (T,) n_pad] -> logical shape

    def reduce(self, kind: str, x):
        """All-reduce of a locally reduced value over the optimizer axes."""
        if self.num_shards == 1:
            return x
        self.collectives.append(("all-reduce", x.size * x.dtype.itemsize))
        if kind == "sum":
            return jax.lax.psum(x, self.axes)
        if kind in ("max", "or"):
            return jax.lax.pmax(x, self.axes)
        return jax.lax.pmin(x, self.axes)

    def whole(self, v):
        """Any held value -> a whole (replicated) array."""
        if isinstance(v, Shard):
            return self.gather(v)
        if isinstance(v, Partial):
            if v.total is None:
                v.total = self.reduce("sum", v.x)
            return v.total
        return v


_IDENTITY = {"sum": 0, "max": -np.inf, "min": np.inf, "and": True, "or": False}


def _identity(kind: str, dtype):
    if kind in ("and", "or"):
        return np.bool_(_IDENTITY[kind])
    if kind in ("max", "min") and not jnp.issubdtype(dtype, jnp.floating):
        info = jnp.iinfo(dtype)
        return info.min if kind == "max" else info.max
    return _IDENTITY[kind]


def reduce_shard(ctx: Ctx, kind: str, v: Shard, axes: tuple, out_aval):
    lay = v.layout
    x = jnp.where(ctx.valid(lay), v.x, jnp.asarray(_identity(kind, v.x.dtype), v.x.dtype))
    local_kind = {"and": "min", "or": "max"}.get(kind, kind)
    as_int = kind in ("and", "or")
    if as_int:
        x = x.astype(jnp.int32)
    if set(axes) == set(range(len(lay.shape))):  # every element -> a scalar
        part = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[local_kind](x)
        if kind == "sum":
            return Partial(part)
        out = ctx.reduce(local_kind, part)
        return out.astype(bool) if as_int else out
    if as_int:
        return None  # reduce_and / reduce_or over some axes: computed whole
    # some axes: segment reduction of the shard by output index, then one all-reduce of [kept]
    kept = [d for d in range(len(lay.shape)) if d not in axes]
    coords = ctx.coords(lay)
    ids = jnp.zeros(lay.local_shape, jnp.int32)
    for d in kept:
        ids = ids * lay.shape[d] + coords[d]
    size = int(np.prod([lay.shape[d] for d in kept], dtype=np.int64))
    ids = jnp.where(ctx.valid(lay), ids, size)  # padding -> a dropped segment
    seg = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max, "min": jax.ops.segment_min}[kind]
    local = seg(x.reshape(-1), ids.reshape(-1), num_segments=size + 1)[:size]  # [prod(kept)]
    if kind != "sum":  # empty segments: identity, as the whole reduction would give
        local = local.astype(x.dtype)
    return ctx.reduce(kind, local).reshape(out_aval.shape).astype(out_aval.dtype)


def random_bits(ctx: Ctx, key, lay: Layout, bit_width: int):
    """This device's elements of ``random_bits(key, shape=lay.shape)``: threefry in partitionable
    mode draws element ``i`` from counter ``i`` alone (``jax.random`` ``_threefry_random_bits_partitionable``)."""
    if bit_width not in (8, 16, 32) or not jax.config.jax_threefry_partitionable:
        return None
    if "threefry" not in str(jax.random.key_impl(key)) or int(np.prod(lay.shape)) >= 2**32:
        return None
    data = jax.random.key_data(key)  # uint32[2]
    f = ctx.logical_index(lay).astype(jnp.uint32)  # the counter of the element's logical index
    if lay.lead:
        f = f + jax.lax.broadcasted_iota(jnp.uint32, lay.local_shape, 0) * jnp.uint32(int(np.prod(lay.inner)))
    b1, b2 = jex.random.threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(f), f)
    bits = b1 ^ b2
    return Shard(bits if bit_width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width]), lay)
