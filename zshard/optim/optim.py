"""Optax on shards: the update of each device's slice, and norms over all shards.

Inside ``shard_map``. Gradients arrive partitioned like the parameters (``[n_pad / N]`` per
parameter, zero in the padding). Elementwise Optax transformations run on the local slice
unchanged (ZeRO paper, arXiv 1910.02054, section 5.1: each data-parallel process updates
only its partition of the optimizer state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from zshard.inspection.jaxprs import sub_jaxprs
from zshard.mesh.mesh import sharded_map
from zshard.optim.offload import update_offloaded
from zshard.optim.optim_global import view_init, view_update

__all__ = [
    "apply_optimizer", "check_elementwise", "global_norm", "init_optimizer", "needs_global_view", "optimizer_grad_specs",
    "optimizer_program",
]  # fmt: skip


def _opt_slice(plan, tree):
    """This device's optimizer slice of each parameter shard: SHARD_OPT's whole ``[n_pad]``
    leaves -> row ``r*S+s`` of ``[W, n_pad/W]``; HYBRID_SHARD_OPT's ``[n_pad/S]`` shards -> row
    ``r`` of ``[R, n_pad/(R*S)]`` (global chunk ``s*R + r``: ``opt_axes = (shard, replica)``)."""
    extra = tuple(a for a in plan.opt_axes if a not in plan.shard_axes)
    parts, index = plan.opt_shards // plan.num_shards, jax.lax.axis_index(extra)

    def mine(x):  # [..., n] -> [..., parts, n/parts] -> row `index`: [..., n/parts]
        return jax.lax.dynamic_index_in_dim(x.reshape(x.shape[:-1] + (parts, -1)), index, axis=x.ndim - 1, keepdims=False)

    return jax.tree.map(mine, tree)


def _view(rec, x):
    """One parameter's local slice ``[..., n]`` (``[..., T, n]`` split over ``tensor``) -> the
    optimizer's view with the logical rank: ``[..., 1, ..., 1, n]`` (``[..., T, 1, .., n]``;
    a split vector ``[..., T*n]``)."""
    if not rec.split:
        return x.reshape(x.shape[:-1] + (1,) * (rec.view_ndim - 1) + x.shape[-1:])
    if rec.view_ndim == 1:
        return x.reshape(x.shape[:-2] + (-1,))  # [..., T, n] -> [..., T*n]
    return x.reshape(x.shape[:-1] + (1,) * (rec.view_ndim - 2) + x.shape[-1:])


def _to_view(plan, tree: dict) -> dict:
    """Flat shards -> views with the parameter's logical rank
    (:attr:`ParamLayout.view_ndim <zshard.params.flat.ParamLayout.view_ndim>`, :meth:`ParamLayout.view_shape
    <zshard.params.flat.ParamLayout.view_shape>`).

    Optax masks and ``multi_transform`` labels see the logical tree (paths) and the logical
    rank (``p.ndim > 1`` tells weights from biases and norm scales); the values are this
    device's padded slice, so elementwise transformations are unchanged.
    """
    records = plan.layouts
    flat = traverse_util.flatten_dict(tree)
    return traverse_util.unflatten_dict({p: _view(records[p], x) for p, x in flat.items()})


class _Ref:
    """A parameter path as an opaque pytree leaf (for ``optax.tree_map_params``)."""

    def __init__(self, path):
        self.path = path


def _state_views(plan, opt_state, to_view: bool):
    """The optimizer-state leaves of parameters split over ``tensor`` between their stored form
    ``[..., T, n]`` (:meth:`ParamLayout.opt_shape <zshard.params.flat.ParamLayout.opt_shape>`) and the
    view Optax sees (``to_view``), or back. Other leaves are stored as views already."""
    if not plan.tensor_split:
        return opt_state
    refs = traverse_util.unflatten_dict({p: _Ref(p) for p in plan.layouts if p in plan.trainable})

    def convert(leaf, ref):
        if isinstance(leaf, optax.MaskedNode) or ref.path not in plan.tensor_split:
            return leaf
        rec = plan.layouts[ref.path]
        if to_view:
            return _view(rec, leaf)
        return leaf.reshape(leaf.shape[: len(rec.lead)] + (rec.tp, -1))  # view -> [..., T, n]

    return optax.tree_map_params(
        plan.tx, convert, opt_state, refs, transform_non_params=lambda x: x, is_leaf=lambda x: isinstance(x, (_Ref, optax.MaskedNode))
    )


def _from_view(tree: dict, like: dict) -> dict:
    return jax.tree.map(lambda x, ref: x.reshape(ref.shape), tree, like)


# Primitives that combine many elements of one array: on a 1/N shard they see only a slice.
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
     "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "dot_general", "reduce_precision_sum"}
)


# Random draws: on a slice, every device would draw the same numbers for different elements.
_RANDOM = frozenset({"random_bits"})


def _transformation(eqns) -> str:
    """The Optax transformation a nest of equations (innermost first) was traced in:
    ``clip_by_global_norm`` for a frame ``clip_by_global_norm.<locals>.update_fn``; else the
    innermost frame outside JAX."""
    frames = [
        f for e in eqns for f in e.source_info.traceback.frames if "/jax/" not in f.file_name and "/jaxlib/" not in f.file_name
    ]
    for f in frames:
        outer, sep, inner = f.function_name.partition(".<locals>.")
        if sep and inner.startswith("update") and outer not in ("with_extra_args_support", "chain", "named_chain"):
            return outer
    return f"{frames[0].function_name} ({frames[0].file_name}:{frames[0].line_num})" if frames else "?"


def _reduction_in(jaxpr, tensor_in: list[bool]):
    """The first equation reducing over an array derived from a non-scalar input, with the
    equations enclosing it (innermost first), or ``None``."""
    tensor = {v: t for v, t in zip(jaxpr.invars, tensor_in)}
    derived = lambda x: tensor.get(x, False) if not hasattr(x, "val") else False  # noqa: E731 (literals: no)
    for eqn in jaxpr.eqns:
        ins = [derived(x) for x in eqn.invars]
        if eqn.primitive.name in _REDUCTIONS and any(ins) or eqn.primitive.name in _RANDOM:
            return [eqn]
        for inner in sub_jaxprs(eqn):
            # operands -> invars one to one where they line up, else conservatively all
            sub_in = ins if len(inner.invars) == len(ins) else [any(ins)] * len(inner.invars)
            found = _reduction_in(inner, sub_in)
            if found is not None:
                return found + [eqn]
        for v in eqn.outvars:
            tensor[v] = any(ins)
    return None


class _NotElementwise(ValueError):
    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def check_elementwise(tx: optax.GradientTransformation, views) -> None:
    """Refuse an Optax transformation that needs a global view of a parameter or of the tree.

    zshard runs ``tx.update`` on each device's ``1/N`` slice of every parameter (ZeRO,
    arXiv 1910.02054, section 5.1), which is exact for elementwise transformations (SGD,
    momentum, Adam, AdamW, Lion, schedules, masks). A transformation that reduces over
    parameter elements (``clip_by_global_norm``, ``apply_if_finite``, LAMB/LARS trust ratios,
    Adafactor's factored moments, normalised updates) would see a slice only. The update is
    traced abstractly (no compile) and any reduction over an array derived from a
    non-scalar gradient, parameter or state leaf is refused.

    Args:
      tx: the Optax transformation.
      views: pytree of ``jax.ShapeDtypeStruct``, one device's view of the trainable params.

    Raises:
      ValueError: naming the transformation and the reducing primitive, and the fix.
    """
    state = jax.eval_shape(tx.init, views)
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(views, state, views)
    tensor_in = [int(np.prod(v.aval.shape)) > 1 for v in closed.jaxpr.invars]
    nest = _reduction_in(closed.jaxpr, tensor_in)
    if nest is not None:
        name, eqn = _transformation(nest), nest[0]
        raise _NotElementwise(name,
            f"optax transformation {name!r} needs a global view: its update reduces over parameter "
            f"elements ({eqn.primitive.name}), but each device holds only its 1/N shard of every parameter, "
            "so the result would differ from the unsharded optimizer. For global-norm clipping use "
            "zshard.make_train_step(loss_fn, clip_norm=...) and drop it from the chain; otherwise use an "
            "elementwise transformation or strategy='NO_SHARD'"
        )


def needs_global_view(tx: optax.GradientTransformation, views) -> str | None:
    """The name of the first transformation of ``tx`` that is not elementwise, or ``None``.

    ``None``: ``tx.update`` runs on each device's slice as it is, today's path (no
    collective, no extra memory). A name: the update reduces over parameter elements
    (a norm, ``jnp.all``, a matmul) or draws random numbers, and runs through
    :mod:`zshard.optim.optim_global` instead. Traced abstractly, no compile.

    Args:
      tx: the Optax transformation.
      views: pytree of ``jax.ShapeDtypeStruct``, one device's view of the trainable params.
    """
    try:
        check_elementwise(tx, views)
    except _NotElementwise as e:
        return e.name
    return None


def _update(plan, grads, opt_state, params, record=None):
    """``tx.update`` on local views: as it is (elementwise) or through the global view."""
    if plan.opt_view is None:
        updates, new_state = plan.tx.update(grads, _state_views(plan, opt_state, True), params)
        return updates, _state_views(plan, new_state, False)
    return view_update(plan, grads, opt_state, params, record)


def init_optimizer(plan, params: dict):
    """Inside ``shard_map``: the Optax state of this device's slice of ``params``."""
    if plan.opt_axes != plan.shard_axes:
        params = _opt_slice(plan, params)
    if plan.opt_view is not None:
        return view_init(plan, _to_view(plan, params))
    return _state_views(plan, plan.tx.init(_to_view(plan, params)), False)


def global_norm(grads, plan) -> jax.Array:
    """L2 norm of the whole gradient, float32 scalar, invariant over the mesh.

    Shards are disjoint over ``plan.grad_axes`` (and identical over the replica axes), and the
    padding holds zeros, so the sum of squares ``psum``-ed over those axes is the norm of the
    unsharded gradient. With a ``tensor`` axis the model's global view over it holds each
    split parameter's pieces once and a parameter not split once (not ``T`` times: the
    pytorch issue 180346 class), so the compiler's sum over ``tensor`` is the norm's.

    Without a tensor axis each gradient passes an ``optimization_barrier`` first: without it
    XLA's common subexpression elimination merges this ``square(g)`` with the optimizer's
    (Adam's second moment, ``nu = b2 nu + (1 - b2) g^2``), and a square with two consumers is
    materialised whole instead of fused into each: on Llama-70B HYBRID_SHARD 8x8 two such
    ``[80, n_pad/8]`` buffers (28.19 GB) set the step's peak (docs/memory.md, "The scale table").

    [Note: no barrier under tensor] With a tensor axis the barrier is left out: on jax 0.10.2
    XLA:CPU, the barrier's operand for the fused ``qkv`` kernel's gradient (reduce-scattered per
    piece, zshard/wire/collectives.py) read other memory when the norm was the barrier's only reader
    (the reference GPT on 1x4x2, prefetch 0, no clipping: ``grad_norm`` 4.89 against one
    device's 2.05; each block's qkv term +8.0 or -1.5e32), while the update read the right
    values. tests/test_tensor_parallel.py checks the norm against one device with and without
    clipping, at prefetch 0 and 1.
    """
    leaves = jax.tree.leaves(grads)
    if plan.tensor == 1:  # [n_pad/N] each --barrier--> the same values, not CSE-able with the optimizer's g^2
        leaves = jax.lax.optimization_barrier(leaves)
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)
    axes = plan.grad_axes
    return jnp.sqrt(jax.lax.psum(sq, axes) if axes else sq)


def apply_optimizer(plan, params: dict, grads: dict, opt_state, record: list | None = None):
    """One Optax update of this device's shards; returns ``(params, opt_state)``.

    Args:
      plan: the :class:`~zshard.Plan`.
      params / grads: nested dicts of local ``[n_pad / N]`` slices (``N = plan.num_shards``).
      opt_state: local Optax state, sliced over ``plan.opt_axes``.

    ``record``: a list that receives ``(kind, X bytes)`` of each collective the global-view
    optimizer issues (:mod:`zshard.optim.optim_global`; nothing for elementwise chains).

    SHARD_OPT (ZeRO-1) holds whole parameters and gradients (``N = 1``) but a ``1/W`` slice
    of the optimizer state: each device updates its slice, then each unit's updated slices
    are all-gathered over the world, one collective per unit and dtype. HYBRID_SHARD_OPT
    gets ``grads`` already as its ``[n_pad/(R*S)]`` slices (reduce-scattered over
    ``replica`` in each unit's backward, :func:`zshard.wire.collectives.replica_slices`),
    updates the matching slice of its parameter shard and all-gathers the updated slices
    over ``replica``: ``[R, L/(R*S)] -> [n_pad/S]`` per parameter.
    """
    axes = plan.opt_axes
    if axes == plan.shard_axes:
        updates, opt_state = _update(plan, _to_view(plan, grads), opt_state, _to_view(plan, params), record)
        return optax.apply_updates(params, _from_view(updates, params)), opt_state

    local_params = _opt_slice(plan, params)
    if not plan.strategy.scatters_replica:  # SHARD_OPT: whole gradients, slice them here
        grads = _opt_slice(plan, grads)
    updates, opt_state = _update(plan, _to_view(plan, grads), opt_state, _to_view(plan, local_params), record)
    local = traverse_util.flatten_dict(optax.apply_updates(local_params, _from_view(updates, local_params)))
    # SHARD_OPT gathers over the world; HYBRID_SHARD_OPT over replica only (the parameters
    # stay split over shard).
    gather_axes = tuple(a for a in axes if a not in plan.shard_axes)
    new, old = {}, traverse_util.flatten_dict(params)
    for unit in plan.units:
        for flat in unit.opt_flats:
            if unit.layers is not None and plan.strategy.scatters_replica:
                for s in flat.slots:  # stacked: per parameter and layer, into the parameter's own buffer
                    new[s.path] = _gather_layers(local[s.path], old[s.path], gather_axes)
                continue
            shard = flat.concat_shards([local[s.path] for s in flat.slots])
            # [..., L/W] --all_gather(gather_axes)--> [W', ..., L/W], the same on every device of the group
            full = jax.lax.all_gather(shard, gather_axes, axis=0, tiled=False, to="invarying")
            new.update({s.path: v for s, v in zip(flat.slots, flat.split_padded(full))})  # [..., n_pad/N] each
    return traverse_util.unflatten_dict(new), opt_state


def _gather_layers(local: jax.Array, old: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """A stacked parameter's updated slices ``[L, n_pad/(R*S)]`` -> its shard ``[L, n_pad/S]``,
    one layer per loop iteration, written into ``old`` (the donated ``[L, n_pad/S]``).

    One all-gather of the whole ``[L, n_pad/(R*S)]`` would come out ``[L, R, n_pad/(R*S)]``
    with the gathered axis major in memory (XLA:CPU), a temp as large as the parameter shard
    (18.8 GB for Llama-70B's gate|up on 8x8) copied into the output; per layer, the gather of
    ``[R, n_pad/(R*S)]`` is already row ``l`` of the output and the loop updates it in place.
    """

    def one(layer, out):
        row = jax.lax.dynamic_index_in_dim(local, layer, axis=0, keepdims=False)  # [(T,) n_pad/(R S)]
        # [(T,) n_pad/(R S)] --all_gather(replica, tiled, last dim)--> [(T,) R * n_pad/(R S)] = [(T,) n_pad/S]
        full = jax.lax.all_gather(row, axes, axis=row.ndim - 1, tiled=True, to="invarying")
        return jax.lax.dynamic_update_index_in_dim(out, full.astype(out.dtype), layer, axis=0)  # row l of [L, n_pad/S]

    return jax.lax.fori_loop(0, local.shape[0], one, old)


def optimizer_program(plan, record: list | None = None):
    """The optimizer step alone, ``jit(shard_map(...))``: ``(params, grads, opt_state) ->
    (params, opt_state)`` on trainable parameters (``zshard.report`` compiles it to measure
    the optimizer's temporary memory and collectives apart from the train step).

    ``params``: nested dicts like ``state.params`` restricted to the trainable parameters
    (``[n_pad]`` each, ``PartitionSpec(shard_axes)``); ``grads``: the same shapes with
    :func:`optimizer_grad_specs` (HYBRID_SHARD_OPT's gradients arrive already reduce-scattered
    over ``replica`` by the step, so the program takes them as its optimizer slices).
    """
    train_specs, _ = plan.split_trainable(plan.param_specs)

    def local(params, grads, opt_state):
        if plan.offload is not None:  # the offloaded leaves to the device and back, as the step does
            update = lambda p, g, s: apply_optimizer(plan, p, g, s, record)  # noqa: E731
            return update_offloaded(plan, update, params, grads, opt_state)[:2]
        return apply_optimizer(plan, params, grads, opt_state, record)

    in_specs = (train_specs, optimizer_grad_specs(plan), plan.opt_specs)
    return jax.jit(sharded_map(local, plan.mesh, in_specs=in_specs, out_specs=(train_specs, plan.opt_specs)))


def optimizer_grad_specs(plan):
    """PartitionSpecs of the gradients :func:`apply_optimizer` takes: those of the trainable
    parameters, or over the optimizer axes where the step reduce-scatters over ``replica``
    (:func:`zshard.wire.collectives.replica_slices`, in each unit's backward)."""
    train_specs, _ = plan.split_trainable(plan.param_specs)
    if not plan.strategy.scatters_replica:
        return train_specs
    axes = plan.opt_axes
    return jax.tree.map(lambda s: P(*tuple(s)[:-1], axes), train_specs, is_leaf=lambda x: isinstance(x, P))
