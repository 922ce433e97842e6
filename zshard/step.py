"""The sharded train step: one ``jax.jit(jax.shard_map(...))`` over the whole mesh.

Per device (docs/design.md section 5):

1. take its slice of the batch (leading dimension split over ``("replica", "shard")``);
2. all-gather the root unit (embeddings, head, ...), rebuild the model with it; every block
   unit is intercepted so that its ``__call__`` all-gathers the block's FlatParameter just
   before it runs and drops it afterwards (:func:`zshard.collectives.run_unit`);
3. backward: each unit gathers again, recomputes, and reduce-scatters its gradient
   (+ all-reduce of the shard over ``replica`` for HYBRID_SHARD); the loss is scaled by
   ``1 / world`` so the summed gradient is that of the global mean loss;
4. Optax updates the local shards; the loss and the gradient norm are ``psum``-ed.
"""

from __future__ import annotations

import contextvars
import dataclasses
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.collectives import _vary, gather, remat_policy, run_unit
from zshard.mesh import AXES
from zshard.optim import apply_optimizer, global_norm
from zshard.state import Plan, ShardedState, Unit, _fill

__all__ = ["TrainStep", "make_train_step"]

_INTERCEPTORS: dict[type, type] = {}

# While tracing a step with gradient accumulation, units reduce-scatter over the shard axes
# only; the cross-replica all-reduce of the accumulated shard happens once per step.
_DEFER_REPLICA_REDUCE = contextvars.ContextVar("zshard_defer_replica_reduce", default=False)
# The step's activation-checkpointing policy, read by every unit call while tracing.
_REMAT = contextvars.ContextVar("zshard_remat", default="block")
# Prefetch depth: a unit's forward gather may be issued this many unit calls early.
_PREFETCH = contextvars.ContextVar("zshard_prefetch", default=1)


def _replica_axes(plan: Plan) -> tuple[str, ...]:
    return () if _DEFER_REPLICA_REDUCE.get() else plan.replica_axes


def _intercepting_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` runs the zshard unit call stored on the instance."""
    if cls not in _INTERCEPTORS:

        def __call__(self, *args, **kwargs):
            return vars(self)["_zshard_unit_call"](*args, **kwargs)

        _INTERCEPTORS[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _INTERCEPTORS[cls]


_STACKED: dict = {}


def _stacked_class(cls: type, plan: Plan, unit: Unit) -> type:
    """A subclass of ``cls`` for a stacked unit: under ``nnx.scan`` each iteration's module
    holds its own layer's local shards ``[n_pad / N]`` and gathers only that layer."""
    key = (cls, unit)
    if key not in _STACKED:

        def __call__(self, *args, **kwargs):
            own = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(self, nnx.Param))}
            shards = {s.path: own[s.path[len(unit.path) :]] for s in unit.slots}
            return _unit_call(plan, unit, _unit_bufs(unit, shards), cls.__call__)(*args, **kwargs)

        _STACKED[key] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _STACKED[key]


def _unit_bufs(unit: Unit, shards: dict) -> list[jax.Array]:
    # per-parameter local shards [n_pad/N] -> this device's FlatParameter shard [L/N], per dtype
    return [f.concat_shards([shards[s.path] for s in f.slots]) for f in unit.flats]


def _unit_call(plan: Plan, unit: Unit, bufs: list, call: Callable, tied: list = (), chain: list | None = None) -> Callable:
    """``module(*args, **kwargs)`` for a block unit, with its parameters gathered just in time.

    ``tied``: the root unit's gathered values of ``unit.shared`` (weights the unit reads but
    the root owns); they enter the unit call as inputs, so their gradient flows to the root.
    ``chain``: the unit calls of this forward pass so far, in call order (prefetch: this
    call's gather may be issued as soon as the input of the call ``prefetch`` places
    earlier exists, and in backward as soon as this call's backward begins, the gather of
    that earlier call may be issued). ``None``: no prefetch (stacked units).
    """
    rel = [s.path[len(unit.path) :] for s in unit.slots] + [r for r, _ in unit.shared]

    def unit_call(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
        static = [None if i in dynamic else x for i, x in enumerate(leaves)]

        def apply(params, inputs):
            inputs, tied_values = inputs[: len(dynamic)], inputs[len(dynamic) :]
            params = list(params) + list(tied_values)
            inputs = plan.mp.cast_inputs(inputs)  # compute in param_dtype (FSDP cast_forward_inputs)
            full = list(static)
            for i, x in zip(dynamic, inputs):
                full[i] = x
            a, kw = jax.tree.unflatten(treedef, full)
            module = nnx.merge(unit.graphdef, _fill(unit.template, dict(zip(rel, params))))
            out = call(module, *a, **kw)
            # Floating outputs leave the unit in the dtype its floating inputs came in (the
            # residual stream stays fp32 under bf16 compute; an nnx.scan carry keeps its type).
            if plan.mp.param_dtype is not None and in_dtypes:
                out = jax.tree.map(lambda y: y.astype(in_dtypes[0]) if jnp.issubdtype(y.dtype, jnp.floating) else y, out)
            return out

        inputs = [leaves[i] for i in dynamic]
        in_dtypes = [x.dtype for x in inputs if jnp.issubdtype(x.dtype, jnp.floating)]
        inputs += list(tied)
        # FULL_SHARD / HYBRID_SHARD gather again in backward; SHARD_GRAD_OP and friends keep
        # the gathered copy from forward to backward.
        reshard = plan.strategy.reshard_after_forward
        depth, after, record = _PREFETCH.get(), None, {"consumed": False}
        if chain is not None and depth and len(chain) >= depth:
            earlier = chain[-depth]
            after, earlier["consumed"] = earlier["token"], True
        out, record["token"] = run_unit(
            apply, unit.flats, bufs, inputs, plan.shard_axes, _replica_axes(plan), plan.mp, _REMAT.get(), reshard,
            prefetch_after=after, consumed=lambda: record["consumed"],
        )
        if chain is not None:
            chain.append(record)
        return out

    return unit_call


def materialize(plan: Plan, shards: dict) -> nnx.Module:
    """Inside ``shard_map``: the model with the root unit gathered and every block unit intercepted.

    Args:
      plan: the sharding plan.
      shards: flat dict ``path -> local shard [n_pad / N]``.

    Returns:
      An ``nnx.Module`` to hand to the user's loss. Block-unit parameters are placeholders
      outside the block's own ``__call__``.
    """
    root, blocks = (plan.units[0], plan.units[1:]) if plan.units[0].path == () else (None, plan.units)
    values = {}
    if root is not None:
        gathered = gather(root.flats, _unit_bufs(root, shards), plan.shard_axes, _replica_axes(plan), plan.mp)
        values = {s.path: v for s, v in zip(root.slots, gathered)}
    for unit in blocks:
        if unit.layers is not None:  # stacked: the module holds its local shards [L, n_pad/N]
            values.update({s.path: shards[s.path] for s in unit.slots})
    model = nnx.merge(plan.graphdef, _fill(plan.template, values))
    chain: list = []  # the block-unit calls of this forward pass, in call order (prefetch)
    for unit in blocks:
        sub = model
        for key in unit.path:
            sub = sub[key] if isinstance(key, int) else getattr(sub, key)
        cls = type(sub)
        if unit.layers is not None:
            object.__setattr__(sub, "__class__", _stacked_class(cls, plan, unit))
            continue
        tied = [values[c] for _, c in unit.shared]  # gathered with the root unit
        call = _unit_call(plan, unit, _unit_bufs(unit, shards), cls.__call__, tied, chain)
        object.__setattr__(sub, "_zshard_unit_call", call)
        object.__setattr__(sub, "__class__", _intercepting_class(cls))
    return model


def _accumulate(plan: Plan, objective: Callable, params: dict, batch, k: int):
    """Gradient accumulation over ``k`` micro-batches (``lax.scan``), on the shards.

    The accumulator is an fp32 copy of the gradient shards, never a full gradient; every
    micro-batch reduce-scatters over the shard axes, and the replica axes are all-reduced
    once per step, on the accumulated shard (FSDP2's ``set_requires_all_reduce(False)``).
    Returns ``((loss total, count total), grads)`` summed over the micro-batches.
    """
    replica = plan.replica_axes
    # Differentiating w.r.t. replica-varying parameters lets each micro-batch's gradient
    # stay unsummed over replica.
    params = jax.tree.map(lambda p: _vary(p, plan.shard_axes + replica), params)
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)  # [B/W] -> [k, B/(W k), ...]
    token = _DEFER_REPLICA_REDUCE.set(True)
    try:

        def body(carry, mb):
            acc, totals = carry
            (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, mb)
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
            return (acc, jax.tree.map(jnp.add, totals, aux)), None

        zeros = jax.tree.map(lambda p: _vary(jnp.zeros(p.shape, jnp.float32), plan.shard_axes + replica), params)
        zero = _vary(jnp.zeros((), jnp.float32), AXES)
        (acc, totals), _ = jax.lax.scan(body, (zeros, (zero, zero)), micro)
    finally:
        _DEFER_REPLICA_REDUCE.reset(token)
    if replica:
        # [n_pad/N] --all_reduce(replica)--> [n_pad/N], once per step
        acc = jax.lax.psum(acc, replica)
    return totals, jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)


def _local_step(plan: Plan, opts: TrainStep, loss_fn: Callable, state: ShardedState, batch):
    tokens = _REMAT.set(opts.remat), _PREFETCH.set(opts.prefetch)
    try:
        return _local_step_body(plan, opts, loss_fn, state, batch)
    finally:
        _REMAT.reset(tokens[0])
        _PREFETCH.reset(tokens[1])


def _local_step_body(plan: Plan, opts: TrainStep, loss_fn: Callable, state: ShardedState, batch):
    world, k = plan.world, opts.grad_accum
    token_weighted = []  # set while tracing: loss_fn returned (sum, count)

    train, frozen = plan.split_trainable(state.params)

    def objective(params, batch):
        """What this device differentiates (trainable shards), and its ``(loss, count)``."""
        model = materialize(plan, traverse_util.flatten_dict(plan.merge_params(params, frozen)))
        out = loss_fn(model, batch)
        if isinstance(out, (tuple, list)) and len(out) == 2:
            # (sum, count): differentiate the sum; divide by the global count afterwards.
            total, count = plan.mp.cast_loss(out[0]), jnp.asarray(out[1], jnp.float32)
            token_weighted.append(True)
            return total, (total, count)
        loss = plan.mp.cast_loss(out)
        # (local mean / (world * micro-batches)): the reduce-scatters and the accumulation
        # sum these into the gradient of the global mean.
        return loss / (world * k), (loss, jnp.ones((), jnp.float32))

    if k == 1:
        (_, totals), grads = jax.value_and_grad(objective, has_aux=True)(train, batch)
    else:
        totals, grads = _accumulate(plan, objective, train, batch, k)
    loss_total, count = (jax.lax.psum(t, AXES) for t in totals)
    if token_weighted:  # global token mean across devices and micro-batches
        loss = loss_total / count
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
    else:
        loss = loss_total / (world * k)
    grad_norm = global_norm(grads, plan.shard_axes)
    if opts.clip_norm is not None:
        # optax.clip_by_global_norm semantics with the norm of the whole (unsharded) gradient
        scale = jnp.where(grad_norm < opts.clip_norm, 1.0, opts.clip_norm / grad_norm)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    train, opt_state = apply_optimizer(plan, train, grads, state.opt_state)
    params = plan.merge_params(train, frozen)  # frozen shards pass through untouched
    # loss and grad_norm are psum-ed: every device sees the same verdict.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if opts.skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
    new_state = dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1)
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if token_weighted:
        metrics["tokens"] = count
    return new_state, metrics


class TrainStep:
    """``step(state, batch) -> (state, metrics)``: one optimizer step on the sharded state.

    ``batch`` is any pytree of numpy or jax arrays whose leading dimension is the global
    batch; it is split over all ``R*S`` devices (``PartitionSpec(("replica", "shard"))``).
    ``metrics["loss"]`` is the global mean loss (float32 scalar), ``metrics["grad_norm"]`` the
    global L2 norm of the gradient before the update. The input state is donated.

    Raises:
      ValueError: a batch leaf is a scalar or its leading dimension does not divide by the
        device count (before any compile).
    """

    def __init__(
        self,
        loss_fn: Callable[[nnx.Module, Any], Any],
        *,
        grad_accum: int = 1,
        clip_norm: float | None = None,
        skip_nonfinite: bool = False,
        remat="block",
        prefetch: int = 1,
    ):
        self.remat = remat_policy(remat)
        if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r}: must be a non-negative integer (units gathered ahead; 0 turns prefetch off)")
        self.prefetch = int(prefetch)
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, numbers.Integral) or grad_accum < 1:
            raise ValueError(f"grad_accum={grad_accum!r}: must be a positive integer (micro-batches per step)")
        if clip_norm is not None and (
            isinstance(clip_norm, bool) or not isinstance(clip_norm, numbers.Real) or not clip_norm > 0 or not np.isfinite(clip_norm)
        ):
            raise ValueError(f"clip_norm={clip_norm!r}: must be a positive finite number (or None for no clipping)")
        grad_accum = int(grad_accum)
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.clip_norm = clip_norm
        self.skip_nonfinite = bool(skip_nonfinite)
        self._jitted = jax.jit(self._step, donate_argnums=0)

    def _step(self, state: ShardedState, batch):
        fn = jax.shard_map(
            lambda s, b: _local_step(state.plan, self, self.loss_fn, s, b),
            mesh=state.plan.mesh,
            in_specs=(state.specs(), P(AXES)),
            out_specs=(state.specs(), P()),
        )
        return fn(state, batch)

    def put_batch(self, state: ShardedState, batch):
        """Validate ``batch`` and place it with its leading dimension split over all devices.

        With several processes (``jax.process_count() > 1``) each process passes only its own
        rows: its contiguous slice ``[i*B/P, (i+1)*B/P)`` of the global batch of ``B`` rows
        (``jax.make_array_from_process_local_data``); a global ``jax.Array`` passes as is.
        """
        world = state.plan.world * self.grad_accum  # the batch splits into devices x micro-batches
        sharding = NamedSharding(state.plan.mesh, P(AXES))
        procs = jax.process_count()

        def process_local(x) -> bool:
            return procs > 1 and not isinstance(x, jax.ShapeDtypeStruct) and getattr(x, "is_fully_addressable", True)

        def shape_of(x) -> tuple:  # global shape: local rows x processes
            shape = np.shape(x)
            return (shape[0] * procs,) + tuple(shape[1:]) if shape and process_local(x) else shape

        where = f" (global: the rows of process {jax.process_index()} x {procs} processes)" if procs > 1 else ""
        leaves = jax.tree_util.tree_leaves_with_path(batch)
        if not leaves:
            raise ValueError("batch is empty: give a pytree of arrays with a leading batch dimension")
        sizes = {f"batch{jax.tree_util.keystr(p)}": shape_of(x)[0] if np.shape(x) else None for p, x in leaves}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"batch leaves have different leading (batch) dimensions: {sizes}{where}; every leaf must have "
                f"the same global batch size, a multiple of the {world} devices of the mesh"
            )
        for path, x in leaves:
            shape = shape_of(x)
            if not shape or shape[0] == 0 or shape[0] % world:
                micro = f" x grad_accum={self.grad_accum} micro-batches" if self.grad_accum > 1 else ""
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)} has shape {shape}{where}: its leading (batch) dimension "
                    f"must divide by the {state.plan.world} devices of the mesh {dict(state.plan.mesh.shape)}{micro}; "
                    f"use a global batch that is a multiple of {world}"
                )
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            if isinstance(x, jax.ShapeDtypeStruct)
            else jax.make_array_from_process_local_data(sharding, np.asarray(x), shape_of(x))
            if process_local(x)
            else jax.device_put(x, sharding),
            batch,
        )

    def __call__(self, state: ShardedState, batch):
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
            raise ValueError(
                "this state was donated to an earlier step (its buffers are deleted); "
                "use the state that step returned: state, metrics = step(state, batch)"
            )
        return self._jitted(state, self.put_batch(state, batch))

    def lower(self, state: ShardedState, batch) -> jax.stages.Lowered:
        """The lowered step (``.compile().memory_analysis()``, ``.compile().as_text()``)."""
        return self._jitted.lower(state, self.put_batch(state, batch))


def make_train_step(
    loss_fn: Callable[[nnx.Module, Any], Any],
    *,
    grad_accum: int = 1,
    clip_norm: float | None = None,
    skip_nonfinite: bool = False,
    remat="block",
    prefetch: int = 1,
) -> TrainStep:
    """Build the sharded step for ``loss_fn(model, batch) -> scalar mean loss``.

    Args:
      loss_fn: written for one device and an ordinary model: it receives this device's
        slice of the batch (``[B / (R*S*grad_accum), ...]``) and returns the mean loss over
        it, or ``(sum, count)`` for token-weighted losses with masking: then the loss and the
        gradient are the global token mean over all devices and micro-batches, however
        unevenly the valid tokens fall (``metrics["tokens"]`` is the global count).
      grad_accum: micro-batches per step (gradient accumulation); the global batch must
        divide by ``R*S*grad_accum``. The optimizer (and its schedules) advance once per step.
      clip_norm: clip the gradient to this global L2 norm before the optimizer
        (``optax.clip_by_global_norm`` semantics over the whole, unsharded gradient).
        ``metrics["grad_norm"]`` is the norm before clipping.
      skip_nonfinite: if the loss or the gradient norm is NaN or inf (on any device: both
        are reduced over the mesh, so every device agrees), keep the parameters and the
        optimizer state of the previous step. ``metrics["nonfinite"]`` is 1 for such a step
        either way; without skipping, the caller decides (``python -m train`` stops).
      remat: activation checkpointing inside each block unit (gathered weights are never
        saved for backward under FULL_SHARD / HYBRID_SHARD, whatever the policy):
        ``"block"`` (default; save the block's inputs, recompute the block in backward),
        ``"none"`` (save every activation), ``"dots"`` (save matmul outputs only,
        ``jax.checkpoint_policies.dots_saveable``), or any ``jax.checkpoint`` policy callable.
        The root unit (embeddings, head) is never recomputed. ``zshard.report`` shows the
        temp bytes each policy costs.
      prefetch: how many unit calls ahead a block unit's all-gather may be issued (FSDP's
        ``forward_prefetch`` / ``BackwardPrefetch.BACKWARD_PRE``): with ``1`` (default) the
        gather of unit ``i+1`` depends only on unit ``i``'s input, so XLA's latency-hiding
        scheduler can run it during unit ``i``'s compute; in backward, unit ``i-1``'s
        re-gather may start when unit ``i``'s backward starts. Costs up to ``prefetch``
        more gathered units in temp memory. ``0``: each unit gathers only once its own input
        (forward) or output cotangent (backward) exists. Units stacked under ``nnx.scan``
        gather inside the loop and are not prefetched.

    Raises:
      ValueError: ``grad_accum`` not a positive integer, ``clip_norm`` not positive,
        ``remat`` not a known policy, ``prefetch`` negative.
    """
    return TrainStep(
        loss_fn, grad_accum=grad_accum, clip_norm=clip_norm, skip_nonfinite=skip_nonfinite, remat=remat, prefetch=prefetch
    )
