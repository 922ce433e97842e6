"""Any Optax transformation on shards, exactly: the update traced on logical shapes, run on shards.

zshard keeps each parameter as a padded flat shard (``[n_pad / N]`` per device, ``N`` the
devices the optimizer state is split over). An elementwise chain (Adam, SGD, Lion, masks,
schedules) runs on that slice unchanged (:mod:`zshard.optim`). A transformation that looks
at a whole parameter or at the whole tree (``clip_by_global_norm``, ``apply_if_finite``,
LAMB / LARS trust ratios, Adafactor's factored moments, Muon) goes through this module:

1. ``tx.update`` (and ``tx.init``) is traced with the parameters' *logical* shapes
   (``[L, *shape]`` for a stacked parameter), so every shape-dependent decision in Optax
   (``ndim`` masks, Adafactor's factored dimensions, Muon's matrix test) is the one the
   single-device optimizer makes;
2. the traced program (a jaxpr) is evaluated equation by equation on this device's shards.
   A value shaped like a parameter is held as its shard (:class:`Shard`, local
   ``[*lead, n_pad/N]``); everything else (scalars, Adafactor's row and column factors) is
   held whole and is the same on every device.

Each equation costs exactly what it needs:

- elementwise equations (``add``, ``sqrt``, ``select_n``, ...) run on the shards: no
  collective, no extra memory (the ZeRO partitioned update, arXiv 1910.02054 section 5.1);
- a reduction over all elements of a parameter (a norm, ``jnp.all(isfinite)``) reduces the
  shard locally, padding masked by the reduction's identity, and then one scalar all-reduce;
  partial sums that are only added together (a global norm over all parameters) are
  all-reduced once, as one scalar;
- a reduction over some axes (Adafactor's row / column means) is a segment sum of the
  shard by output index, then one all-reduce of the (small) result;
- a broadcast of a small value to a parameter's shape (``zeros_like``, Adafactor's
  ``v_row[:, None]``) builds only the shard, by index arithmetic;
- ``random_bits`` of a parameter's shape (``optax.add_noise``) draws only the shard's
  elements with the counter of each element's logical index (threefry, partitionable
  mode): the noise is element for element the noise of the single-device run;
- anything else (``dot_general``, ``reshape``, ``transpose``, loops: Muon's Newton-Schulz
  iteration) all-gathers the parameter-shaped operands it needs, one parameter at a time,
  computes on the whole parameter, and keeps only the shard of a parameter-shaped result.

Optimizer-state leaves shaped like their parameter stay sharded exactly like the
elementwise path's; other leaves (counts, Adafactor's factors, Muon's coefficients) are
replicated. Side-effecting transformations (host callbacks) are refused before compiling.

Over 400 lines on purpose: it is one interpreter. The rule of each kind of equation
(``_eval_eqn`` and the helpers it dispatches to) uses the shard arithmetic of ``_Ctx``
(element indices, logical coordinates, gathers); split apart, a rule and the arithmetic it
relies on would live in different files. The stored form of a parameter comes from
:class:`zshard.flat.ParamLayout` (:meth:`Layout.storage`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from zshard.flat import ParamLayout, padded_size

__all__ = ["Layout", "OptView", "Shard", "build_view", "view_init", "view_update"]

SCOPE = "zshard.optimizer"  # named scope of the optimizer's collectives in the HLO (zshard.report)

_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type cbrt ceil clamp conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
    imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical
    sign sin sinh sqrt square sub tan tanh xor population_count clz""".split()
)
# Sharding annotations and copies: no change of value inside shard_map.
_IDENTITY_PRIMS = frozenset({"reshard", "sharding_constraint", "mesh_cast", "copy", "copy_p", "optimization_barrier"})
_REDUCE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_and": "and", "reduce_or": "or"}
_INLINE_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"})


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one logical parameter shape lies in its shards.

    Attributes:
      shape: logical shape; ``[L, *inner]`` for a stacked parameter (``lead=1``).
      lead: leading (layer) dimensions kept whole on every device: 0 or 1.
      num_shards: ``N``.
    """

    shape: tuple
    lead: int
    num_shards: int

    @property
    def n(self) -> int:  # elements of one layer
        return int(np.prod(self.shape[self.lead :], dtype=np.int64))

    @property
    def n_loc(self) -> int:  # n_pad / N
        return padded_size(self.n, self.num_shards) // self.num_shards

    def storage(self, dtype) -> ParamLayout:
        """The stored form of a ``dtype`` value of this shape (``[*lead, n_pad]``)."""
        return ParamLayout.build((), self.shape[self.lead :], dtype, self.num_shards, self.shape[0] if self.lead else None)

    @property
    def local_shape(self) -> tuple:  # [*lead, n_pad/N]
        return tuple(self.shape[: self.lead]) + (self.n_loc,)


@dataclasses.dataclass(frozen=True)
class Shard:
    """A parameter-shaped value held as this device's shard ``[*lead, n_pad/N]`` (padding arbitrary)."""

    x: jax.Array
    layout: Layout


@dataclasses.dataclass
class _Partial:
    """A scalar partial sum: the whole value is its ``psum`` over the optimizer axes
    (computed once, on first use, and kept in ``total``)."""

    x: jax.Array
    total: Any = None


@dataclasses.dataclass(eq=False, frozen=True)
class OptView:
    """Static description of the global-view optimizer of a plan.

    Attributes:
      layouts: trainable parameter path -> :class:`Layout`.
      logical: nested dict of ``jax.ShapeDtypeStruct``: the trainable parameters, logical shapes.
      state_paths: one entry per optimizer-state leaf (``jax.tree.leaves`` order): the
        parameter path of a leaf shaped like its parameter (stored sharded), else ``None``
        (stored whole, replicated).
      specs: PartitionSpec tree of the optimizer state.
      why: the transformation that needs the global view (for messages and the report).
    """

    layouts: dict
    logical: Any
    state_paths: tuple
    specs: Any
    why: str


class _Ctx:
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
        """Index of each local element inside its layer: ``r * n_loc + j``, int32 ``[*lead, n_loc]``."""
        j = jax.lax.broadcasted_iota(jnp.int32, lay.local_shape, lay.lead)
        return j + jnp.int32(lay.n_loc) * self.index

    def valid(self, lay: Layout) -> jax.Array:
        """bool ``[*lead, n_loc]``: the element is a real one, not padding."""
        return self.flat_index(lay) < lay.n

    def coords(self, lay: Layout) -> list:
        """Logical coordinates of each local element, one int32 ``[*lead, n_loc]`` per dimension
        (padding clipped to the last element)."""
        out = [jax.lax.broadcasted_iota(jnp.int32, lay.local_shape, d) for d in range(lay.lead)]
        f = jnp.minimum(self.flat_index(lay), lay.n - 1)
        inner = lay.shape[lay.lead :]
        for d in range(len(inner)):
            stride = int(np.prod(inner[d + 1 :], dtype=np.int64))
            out.append((f // stride) % inner[d])
        return out

    def to_shard(self, x, lay: Layout) -> Shard:
        """A whole value of ``lay.shape`` (or broadcastable to it) -> this device's shard."""
        x = jnp.asarray(x)
        if x.size == 1:
            return Shard(jnp.broadcast_to(x.reshape(()), lay.local_shape), lay)
        if tuple(x.shape) != tuple(lay.shape):  # [.., 1, ..] -> index arithmetic, no full-size copy
            return self.broadcast(x, lay, tuple(range(len(lay.shape))))
        lead = tuple(lay.shape[: lay.lead])
        flat = lay.storage(x.dtype).to_storage(x)  # [*lead, *inner] -> [*lead, n_pad]
        rows = flat.reshape(lead + (self.num_shards, lay.n_loc))  # [*lead, N, n_pad/N]
        # [*lead, N, n_pad/N] --row r (no collective)--> [*lead, n_pad/N]
        return Shard(jax.lax.dynamic_index_in_dim(rows, self.index, axis=lay.lead, keepdims=False), lay)

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
            # [*lead, n_pad/N] --all_gather(opt axes)--> [*lead, n_pad]
            x = jax.lax.all_gather(x, self.axes, axis=lay.lead, tiled=True, to="invarying")
        return lay.storage(x.dtype).from_storage(x)  # [*lead, n_pad] -> [*lead, n] -> logical shape

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
        if isinstance(v, _Partial):
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


def _reduce_shard(ctx: _Ctx, kind: str, v: Shard, axes: tuple, out_aval):
    lay = v.layout
    x = jnp.where(ctx.valid(lay), v.x, jnp.asarray(_identity(kind, v.x.dtype), v.x.dtype))
    local_kind = {"and": "min", "or": "max"}.get(kind, kind)
    as_int = kind in ("and", "or")
    if as_int:
        x = x.astype(jnp.int32)
    if set(axes) == set(range(len(lay.shape))):  # every element -> a scalar
        part = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[local_kind](x)
        if kind == "sum":
            return _Partial(part)
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


def _random_bits(ctx: _Ctx, key, lay: Layout, bit_width: int):
    """This device's elements of ``random_bits(key, shape=lay.shape)``: threefry in partitionable
    mode draws element ``i`` from counter ``i`` alone (``jax.random`` ``_threefry_random_bits_partitionable``)."""
    if bit_width not in (8, 16, 32) or not jax.config.jax_threefry_partitionable:
        return None
    if "threefry" not in str(jax.random.key_impl(key)) or int(np.prod(lay.shape)) >= 2**32:
        return None
    data = jax.random.key_data(key)  # uint32[2]
    f = jnp.minimum(ctx.flat_index(lay), lay.n - 1).astype(jnp.uint32)
    if lay.lead:
        f = f + jax.lax.broadcasted_iota(jnp.uint32, lay.local_shape, 0) * jnp.uint32(lay.n)
    b1, b2 = jex.random.threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(f), f)
    bits = b1 ^ b2
    return Shard(bits if bit_width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width]), lay)


def _varying(x) -> frozenset:
    """Mesh axes a value inside ``shard_map`` varies over."""
    if not isinstance(x, jax.Array):
        return frozenset()
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(t, "vma", ()))


def _bind(eqn, xs: list):
    """``eqn``'s primitive on ``xs``, operands made varying over the same mesh axes first
    (``bind`` skips the implicit ``pvary`` that ``jax.numpy`` inserts inside ``shard_map``)."""
    if not any(jex.core.jaxprs_in_params(eqn.params)):
        xs = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in xs]
        vmas = [_varying(x) for x in xs]
        union = frozenset().union(*vmas)
        xs = [
            jax.lax.pcast(x, tuple(sorted(union - v)), to="varying") if isinstance(x, jax.Array) and union - v else x
            for x, v in zip(xs, vmas)
        ]
    out = eqn.primitive.bind(*xs, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _sub_jaxpr(eqn):
    """The body of a call-like equation (``jit``, ``custom_jvp_call``, ...), evaluated inline."""
    if eqn.primitive.name not in _CALLS:
        return None
    for k in _INLINE_PARAMS:
        j = eqn.params.get(k)
        inner = getattr(j, "jaxpr", j)
        if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            return inner, list(getattr(j, "consts", ()))
    return None


def _is_zero_literal(v) -> bool:
    return isinstance(v, jex.core.Literal) and np.ndim(v.val) == 0 and v.val == 0


def _eval_eqn(ctx: _Ctx, eqn, ins: list) -> list:
    name = eqn.primitive.name
    held = [isinstance(x, (Shard, _Partial)) for x in ins]
    outs_aval = [v.aval for v in eqn.outvars]

    sub = _sub_jaxpr(eqn)
    if sub is not None:  # jit / custom_jvp / custom_vjp: inline
        return eval_jaxpr(ctx, sub[0], sub[1], ins)

    if name == "cond" and any(held[1:]):
        # Both branches evaluated on the shards, then selected: collectives inside a branch run
        # unconditionally (the predicate is replicated, so every device agrees anyway).
        branches = [eval_jaxpr(ctx, b.jaxpr, list(b.consts), ins[1:]) for b in eqn.params["branches"]]
        index = ctx.whole(ins[0])
        out = []
        for k, aval in enumerate(outs_aval):
            vals = [br[k] for br in branches]
            lay = next((v.layout for v in vals if isinstance(v, Shard)), None)
            if lay is not None and all(not isinstance(v, Shard) or v.layout == lay for v in vals):
                xs = [v.x if isinstance(v, Shard) else ctx.to_shard(ctx.whole(v), lay).x for v in vals]
                out.append(Shard(jax.lax.select_n(index, *xs), lay))
            else:
                out.append(jax.lax.select_n(index, *[ctx.whole(v) for v in vals]))
        return out

    if name in ("add", "sub") and all(h or _is_zero_literal(v) for h, v in zip(held, eqn.invars)) and any(
        isinstance(x, _Partial) for x in ins
    ) and not any(isinstance(x, Shard) for x in ins):
        xs = [x.x if isinstance(x, _Partial) else x for x in ins]
        return [_Partial(_bind(eqn, xs)[0])]
    if name == "neg" and isinstance(ins[0], _Partial):
        return [_Partial(-ins[0].x)]

    if name in _REDUCE and isinstance(ins[0], Shard):
        out = _reduce_shard(ctx, _REDUCE[name], ins[0], tuple(eqn.params["axes"]), outs_aval[0])
        if out is not None:
            return [out]

    if name == "broadcast_in_dim" and not held[0]:
        lay = ctx.by_shape.get(tuple(eqn.params["shape"]))
        x = jnp.asarray(ins[0])
        if lay is not None and x.dtype == outs_aval[0].dtype:
            if x.size == 1:
                return [Shard(jnp.broadcast_to(x.reshape(()), lay.local_shape), lay)]
            return [ctx.broadcast(x, lay, tuple(eqn.params["broadcast_dimensions"]))]

    if name in _IDENTITY_PRIMS and len(ins) == 1:  # sharding annotations: the value itself
        return [ins[0]]

    if name in ("reshape", "broadcast_in_dim") and isinstance(ins[0], Shard) and tuple(outs_aval[0].shape) == ins[0].layout.shape:
        return [ins[0]]

    if name == "random_bits":
        lay = ctx.by_shape.get(tuple(eqn.params["shape"]))
        if lay is not None and not held[0]:
            out = _random_bits(ctx, ins[0], lay, eqn.params["bit_width"])
            if out is not None:
                return [out]

    if name in _ELEMENTWISE and any(isinstance(x, Shard) for x in ins):
        lays = {x.layout for x in ins if isinstance(x, Shard)}
        lay = next(iter(lays))
        if len(lays) == 1 and tuple(outs_aval[0].shape) == lay.shape:
            xs = []
            for x in ins:
                if isinstance(x, Shard):
                    xs.append(x.x)
                else:
                    xs.append(ctx.to_shard(ctx.whole(x), lay).x)
            return [Shard(_bind(eqn, xs)[0], lay)]

    # Anything else: computed on whole values (parameter-shaped operands all-gathered), and a
    # parameter-shaped result is cut back to its shard at once ([Note: one matrix at a time]).
    outs = _bind(eqn, [ctx.whole(x) for x in ins])
    for k, (o, aval) in enumerate(zip(outs, outs_aval)):
        lay = ctx.by_shape.get(tuple(aval.shape))
        if lay is not None and isinstance(o, jax.Array) and not jax.dtypes.issubdtype(o.dtype, jax.dtypes.prng_key):
            outs[k] = ctx.to_shard(o, lay)
            ctx.last = outs[k].x
    return outs


def eval_jaxpr(ctx: _Ctx, jaxpr, consts: list, args: list) -> list:
    """Evaluate ``jaxpr`` with held values (:class:`Shard`, partial sums or whole arrays)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex.core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        outs = _eval_eqn(ctx, eqn, [read(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jex.core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _effects(jaxpr) -> list:
    """Equations with side effects (host callbacks, prints), nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.effects:
            found.append(eqn)
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found += _effects(sub)
    return found


@dataclasses.dataclass(frozen=True)
class _Mark:
    """An optimizer-state leaf's parameter path (sharded like it), or ``None`` (held whole)."""

    path: tuple | None


def build_view(tx, template_logical: dict, layers: dict, num_shards: int, view_specs: dict, why: str) -> OptView:
    """Plan the global-view optimizer (before any compile).

    Args:
      tx: the Optax transformation.
      template_logical: flat dict ``path -> jax.ShapeDtypeStruct`` of the trainable
        parameters, logical shapes (``[L, *shape]`` when stacked).
      layers: ``path -> L`` or ``None``.
      num_shards: devices the optimizer state is split over.
      view_specs: flat dict ``path -> PartitionSpec`` of the stored (sharded) state leaf.
      why: the transformation that needs it (from :func:`zshard.optim.check_elementwise`).

    Raises:
      ValueError: a transformation with side effects (host callbacks), named.
    """
    layouts = {p: Layout(tuple(v.shape), int(layers[p] is not None), num_shards) for p, v in template_logical.items()}
    logical = traverse_util.unflatten_dict(template_logical)
    state = jax.eval_shape(tx.init, logical)
    closed = jax.make_jaxpr(tx.update)(logical, state, logical)
    bad = _effects(closed.jaxpr)
    if bad:
        raise ValueError(
            f"optax transformation {why!r} has side effects ({bad[0].primitive.name}): zshard evaluates the update "
            "on every device's shards, so a host callback would run once per device with partial data; remove it "
            "from the chain (log from the step's metrics instead)"
        )
    refs = traverse_util.unflatten_dict({p: _Mark(p) for p in template_logical})
    masked = optax.MaskedNode
    marked = optax.tree_map_params(
        tx,
        lambda leaf, ref: leaf if isinstance(leaf, masked) else _Mark(ref.path if tuple(leaf.shape) == layouts[ref.path].shape else None),
        state,
        refs,
        transform_non_params=lambda _: _Mark(None),
        is_leaf=lambda x: isinstance(x, (_Mark, masked)),
    )
    state_paths = tuple(m.path for m in jax.tree.leaves(marked))
    specs = jax.tree.unflatten(jax.tree.structure(state), [view_specs[p] if p is not None else P() for p in state_paths])
    return OptView(layouts, logical, state_paths, specs, why)


def _held(view: OptView, flat_local: dict) -> dict:
    """Local views ``[*lead, 1, .., n_pad/N]`` -> nested dict of Shards ``[*lead, n_pad/N]``."""
    return traverse_util.unflatten_dict(
        {p: Shard(x.reshape(view.layouts[p].local_shape), view.layouts[p]) for p, x in flat_local.items()}
    )


def _store(ctx: _Ctx, v, lay: Layout, like_shape, dtype):
    """A held value -> the stored local view, padding zeroed (as the elementwise path keeps it)."""
    if not isinstance(v, Shard) or v.layout != lay:
        v = ctx.to_shard(ctx.whole(v), lay)
    x = jnp.where(ctx.valid(lay), v.x, jnp.zeros((), v.x.dtype))
    return x.astype(dtype).reshape(like_shape)


def _run(ctx: _Ctx, fn, args_logical: tuple, args_held: tuple) -> list:
    closed = jax.make_jaxpr(fn)(*args_logical)
    leaves = jax.tree.leaves(args_held, is_leaf=lambda x: isinstance(x, Shard))
    return eval_jaxpr(ctx, closed.jaxpr, list(closed.consts), leaves)


def _finish_state(ctx: _Ctx, view: OptView, outs: list, state_aval, flat_like: dict):
    leaves = []
    for v, path, aval in zip(outs, view.state_paths, jax.tree.leaves(state_aval)):
        if path is None:
            x = ctx.whole(v)
            leaves.append(x if x.dtype == aval.dtype else x.astype(aval.dtype))
        else:
            leaves.append(_store(ctx, v, view.layouts[path], flat_like[path].shape, aval.dtype))
    return jax.tree.unflatten(jax.tree.structure(state_aval), leaves)


def view_init(plan, params_local: dict):
    """Inside ``shard_map``: the optimizer state of this device's shards (global view).

    ``params_local``: nested dict of local views ``[*lead, 1, .., n_pad/N]``. Returns the
    state: parameter-shaped leaves as local views (like ``params_local``), others whole.
    """
    view, tx = plan.opt_view, plan.tx
    ctx = _Ctx(plan.strategy.opt_axes, plan.opt_shards, view.layouts)
    flat = traverse_util.flatten_dict(params_local)
    with jax.named_scope(SCOPE):
        outs = _run(ctx, tx.init, (view.logical,), (_held(view, flat),))
        return _finish_state(ctx, view, outs, jax.eval_shape(tx.init, view.logical), flat)


def view_update(plan, grads_local: dict, opt_state, params_local: dict, record: list | None = None):
    """Inside ``shard_map``: ``tx.update`` with the single-device result, on this device's shards.

    Args:
      plan: the plan (``plan.opt_view`` set).
      grads_local / params_local: nested dicts of local views ``[*lead, 1, .., n_pad/N]``.
      opt_state: the local optimizer state (sharded leaves as local views, others whole).
      record: if given, each collective issued is appended as ``(kind, X bytes)``.

    Returns:
      ``(updates, opt_state)``: updates as local views (padding zero), the new state.
    """
    view, tx = plan.opt_view, plan.tx
    ctx = _Ctx(plan.strategy.opt_axes, plan.opt_shards, view.layouts, record)
    flat_p, flat_g = traverse_util.flatten_dict(params_local), traverse_util.flatten_dict(grads_local)
    state_aval = jax.eval_shape(tx.init, view.logical)
    held_s = jax.tree.unflatten(
        jax.tree.structure(state_aval),
        [
            x if path is None else Shard(x.reshape(view.layouts[path].local_shape), view.layouts[path])
            for x, path in zip(jax.tree.leaves(opt_state), view.state_paths)
        ],
    )
    with jax.named_scope(SCOPE):
        outs = _run(ctx, tx.update, (view.logical, state_aval, view.logical), (_held(view, flat_g), held_s, _held(view, flat_p)))
        # the updates have the parameters' tree structure: leaves in the logical dict's order
        order = [m.path for m in jax.tree.leaves(traverse_util.unflatten_dict({p: _Mark(p) for p in flat_g}))]
        updates = {p: _store(ctx, v, view.layouts[p], flat_g[p].shape, flat_g[p].dtype) for p, v in zip(order, outs)}
        new_state = _finish_state(ctx, view, outs[len(order) :], state_aval, flat_p)
    return traverse_util.unflatten_dict(updates), new_state
