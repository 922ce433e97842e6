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

This module owns the interpreter: the rule of each kind of equation (``_eval_eqn``) and the
shard arithmetic of ``Ctx`` it relies on (element indices, logical coordinates). The stored
form of a parameter comes from :class:`zshard.params.flat.ParamLayout` (:meth:`Layout.storage`), its
all-gather from :func:`zshard.wire.collectives.all_gather_last`.
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

from zshard.inspection.jaxprs import OPTIMIZER_SCOPE, inline_body, sub_jaxprs, varying
from zshard.optim.optim_shards import Ctx, Layout, Partial, Shard, random_bits, reduce_shard

__all__ = ["Layout", "OptView", "Shard", "build_view", "view_init", "view_update"]

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



def _bind(eqn, xs: list):
    """``eqn``'s primitive on ``xs``, operands made varying over the same mesh axes first
    (``bind`` skips the implicit ``pvary`` that ``jax.numpy`` inserts inside ``shard_map``)."""
    if not any(True for _ in sub_jaxprs(eqn)):
        xs = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in xs]
        vmas = [varying(x) if isinstance(x, jax.Array) else frozenset() for x in xs]
        union = frozenset().union(*vmas)
        xs = [
            jax.lax.pcast(x, tuple(sorted(union - v)), to="varying") if isinstance(x, jax.Array) and union - v else x
            for x, v in zip(xs, vmas)
        ]
    out = eqn.primitive.bind(*xs, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_zero_literal(v) -> bool:
    return isinstance(v, jex.core.Literal) and np.ndim(v.val) == 0 and v.val == 0


def _eval_eqn(ctx: Ctx, eqn, ins: list) -> list:
    name = eqn.primitive.name
    held = [isinstance(x, (Shard, Partial)) for x in ins]
    outs_aval = [v.aval for v in eqn.outvars]

    sub = inline_body(eqn)
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
        isinstance(x, Partial) for x in ins
    ) and not any(isinstance(x, Shard) for x in ins):
        xs = [x.x if isinstance(x, Partial) else x for x in ins]
        return [Partial(_bind(eqn, xs)[0])]
    if name == "neg" and isinstance(ins[0], Partial):
        return [Partial(-ins[0].x)]

    if name in _REDUCE and isinstance(ins[0], Shard):
        out = reduce_shard(ctx, _REDUCE[name], ins[0], tuple(eqn.params["axes"]), outs_aval[0])
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
            out = random_bits(ctx, ins[0], lay, eqn.params["bit_width"])
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


def eval_jaxpr(ctx: Ctx, jaxpr, consts: list, args: list) -> list:
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
        for sub in sub_jaxprs(eqn):
            found += _effects(sub)
    return found


@dataclasses.dataclass(frozen=True)
class _Mark:
    """An optimizer-state leaf's parameter path (sharded like it), or ``None`` (held whole)."""

    path: tuple | None


def build_view(tx, template_logical: dict, layers: dict, num_shards: int, view_specs: dict, why: str,
               tp: dict | None = None, padded: dict | None = None) -> OptView:
    """Plan the global-view optimizer (before any compile).

    Args:
      tx: the Optax transformation.
      template_logical: flat dict ``path -> jax.ShapeDtypeStruct`` of the trainable
        parameters, logical shapes (``[L, *shape]`` when stacked).
      layers: ``path -> L`` or ``None``.
      num_shards: devices the optimizer state is split over.
      view_specs: flat dict ``path -> PartitionSpec`` of the stored (sharded) state leaf.
      why: the transformation that needs it (from :func:`zshard.optim.check_elementwise`).
      tp: ``path -> (tp_dim, T)`` of the parameters split over the ``tensor`` axis.
      padded: ``path -> n_pad`` (of one layer's piece) where a parameter is padded beyond
        ``num_shards`` (a quantized format's blocks, :func:`zshard.wire.quant.pad_multiple`); default:
        a multiple of ``num_shards``.

    Raises:
      ValueError: a transformation with side effects (host callbacks), named.
    """
    tp, padded = tp or {}, padded or {}
    layouts = {p: Layout(tuple(v.shape), int(layers[p] is not None), num_shards, *tp.get(p, (None, 1)), padded.get(p))
               for p, v in template_logical.items()}
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


def _store(ctx: Ctx, v, lay: Layout, like_shape, dtype):
    """A held value -> the stored local view, padding zeroed (as the elementwise path keeps it)."""
    if not isinstance(v, Shard) or v.layout != lay:
        v = ctx.to_shard(ctx.whole(v), lay)
    x = jnp.where(ctx.valid(lay), v.x, jnp.zeros((), v.x.dtype))
    return x.astype(dtype).reshape(like_shape)


def _run(ctx: Ctx, fn, args_logical: tuple, args_held: tuple) -> list:
    closed = jax.make_jaxpr(fn)(*args_logical)
    leaves = jax.tree.leaves(args_held, is_leaf=lambda x: isinstance(x, Shard))
    return eval_jaxpr(ctx, closed.jaxpr, list(closed.consts), leaves)


def _finish_state(ctx: Ctx, view: OptView, outs: list, state_aval, flat_like: dict):
    leaves = []
    for v, path, aval in zip(outs, view.state_paths, jax.tree.leaves(state_aval)):
        if path is None:
            x = ctx.whole(v)
            leaves.append(x if x.dtype == aval.dtype else x.astype(aval.dtype))
        else:
            lay = view.layouts[path]
            # stored like the elementwise path keeps it: the parameter's view, or a split parameter's
            # shard [*lead, T, n_pad/N] (ParamLayout.opt_shape)
            like = lay.local_shape if lay.tp_dim is not None else flat_like[path].shape
            leaves.append(_store(ctx, v, lay, like, aval.dtype))
    return jax.tree.unflatten(jax.tree.structure(state_aval), leaves)


def view_init(plan, params_local: dict):
    """Inside ``shard_map``: the optimizer state of this device's shards (global view).

    ``params_local``: nested dict of local views ``[*lead, 1, .., n_pad/N]``. Returns the
    state: parameter-shaped leaves as local views (like ``params_local``), others whole.
    """
    view, tx = plan.opt_view, plan.tx
    ctx = Ctx(plan.opt_axes, plan.opt_shards, view.layouts)
    flat = traverse_util.flatten_dict(params_local)
    with jax.named_scope(OPTIMIZER_SCOPE):
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
    ctx = Ctx(plan.opt_axes, plan.opt_shards, view.layouts, record)
    flat_p, flat_g = traverse_util.flatten_dict(params_local), traverse_util.flatten_dict(grads_local)
    state_aval = jax.eval_shape(tx.init, view.logical)
    held_s = jax.tree.unflatten(
        jax.tree.structure(state_aval),
        [
            x if path is None else Shard(x.reshape(view.layouts[path].local_shape), view.layouts[path])
            for x, path in zip(jax.tree.leaves(opt_state), view.state_paths)
        ],
    )
    with jax.named_scope(OPTIMIZER_SCOPE):
        outs = _run(ctx, tx.update, (view.logical, state_aval, view.logical), (_held(view, flat_g), held_s, _held(view, flat_p)))
        # the updates have the parameters' tree structure: leaves in the logical dict's order
        order = [m.path for m in jax.tree.leaves(traverse_util.unflatten_dict({p: _Mark(p) for p in flat_g}))]
        updates = {p: _store(ctx, v, view.layouts[p], flat_g[p].shape, flat_g[p].dtype) for p, v in zip(order, outs)}
        new_state = _finish_state(ctx, view, outs[len(order) :], state_aval, flat_p)
    return traverse_util.unflatten_dict(updates), new_state
