"""The sharded train step: one ``jax.jit(jax.shard_map(...))`` over the whole mesh.

Per device (docs/design.md section 5):

1. take its slice of the batch (leading dimension split over ``("replica", "shard")``);
2. all-gather the root unit (embeddings, head, ...), rebuild the model with it; every block
   unit is intercepted so that its ``__call__`` all-gathers the block's FlatParameter just
   before it runs and drops it afterwards (:func:`zshard.collectives.run_unit`);
3. backward: each unit gathers again, recomputes, and reduce-scatters its gradient
   (+ all-reduce of the shard over ``replica`` for HYBRID_SHARD; + reduce-scatter of it over
   ``replica`` into the parameter's gradient sink for HYBRID_SHARD_OPT); the loss is scaled by
   ``1 / world`` so the summed gradient is that of the global mean loss;
4. Optax updates the local shards; the loss and the gradient norm are ``psum``-ed.

Over 400 lines because the public ``TrainStep`` / ``make_train_step`` carry the argument
checks and docstrings of every step option; the per-device body is ``_local_step``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.collectives import remat_policy, vary
from zshard.divergence import check_uniform_collectives
from zshard.shard_reads import LOSS_SCOPE, block_shard_inputs, check_shard_reads
from zshard.intercept import StepOptions, materialize, read_variables
from zshard.mesh import AXES
from zshard.optim import apply_optimizer, global_norm
from zshard.state import Plan, ShardedState

__all__ = ["TokenMean", "TrainStep", "default_prefetch", "make_train_step"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenMean:
    """A token-weighted loss: what ``loss_fn`` returns for a masked mean over tokens.

    ``loss_fn`` returns ``zshard.TokenMean(total, count)``: ``total`` the sum of the
    per-token losses on this device's slice (float scalar), ``count`` the number of tokens
    counted (scalar). The step's loss and gradient are then the global token mean
    ``sum(total) / sum(count)`` over all devices and micro-batches, however unevenly the
    valid tokens fall; ``metrics["tokens"]`` is the global count.
    """

    total: Any
    count: Any


def _read_loss(out, has_aux: bool):
    """``loss_fn``'s return value -> ``(loss or TokenMean, aux)``; refuses ambiguous forms.

    Raises:
      TypeError / ValueError: a tuple without ``has_aux``, a non-scalar loss (named with its shape).
    """
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            what = f"an array of shape {np.shape(out)}" if hasattr(out, "shape") else type(out).__name__
            raise TypeError(
                f"loss_fn returned {what}; with has_aux=True it must return (loss, aux), "
                "loss a scalar (or zshard.TokenMean(sum, count)) and aux any pytree of arrays"
            )
        loss, aux = out
    else:
        if isinstance(out, (tuple, list)):
            raise TypeError(
                f"loss_fn returned a {type(out).__name__} of {len(out)}; zshard never guesses what a tuple means. "
                "For (loss, aux) pass make_train_step(loss_fn, has_aux=True); for a token-weighted mean return "
                "zshard.TokenMean(sum_of_losses, token_count)"
            )
        loss, aux = out, None
    parts = (loss.total, loss.count) if isinstance(loss, TokenMean) else (loss,)
    for what, x in zip(("loss", "count"), parts):
        shape = np.shape(x)
        if shape != ():
            raise ValueError(
                f"loss_fn returned a {what} of shape {shape}; it must be a scalar: the mean over this device's "
                "slice of the batch (e.g. jnp.mean(per_example)), or zshard.TokenMean(jnp.sum(per_token * mask), "
                "jnp.sum(mask))"
            )
    if not jnp.issubdtype(jnp.result_type(parts[0]), jnp.floating):
        raise TypeError(
            f"loss_fn returned a loss of dtype {jnp.result_type(parts[0])}; it must be floating to have a gradient "
            "(an integer or boolean loss would train nothing): e.g. jnp.mean(errors.astype(jnp.float32))"
        )
    return loss, aux


def _reduce_aux(aux):
    """Aux leaves across devices (and micro-batches, summed before): floating leaves are
    averaged, integer and boolean leaves summed (counts)."""

    def one(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, AXES)
        return jax.lax.psum(x.astype(jnp.int32), AXES)

    return jax.tree.map(one, aux)


def _sync_variables(plan: Plan, new: dict, old: dict) -> dict:
    """Non-parameter variables after the step, identical on every device: floating ones
    (BatchNorm statistics) averaged over all devices, integer ones (RNG counts, counters) the
    largest value (they advance the same way on every device)."""
    out = {}
    for path, value in new.items():
        value = jnp.asarray(value)
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            out[path] = old[path]
        elif jnp.issubdtype(value.dtype, jnp.inexact):
            out[path] = jax.lax.pmean(vary(value, AXES), AXES).astype(value.dtype)
        else:
            out[path] = jax.lax.pmax(vary(value, AXES), AXES).astype(value.dtype)
    return out


def _accumulate(plan: Plan, objective: Callable, params: dict, variables: dict, batch, k: int):
    """Gradient accumulation over ``k`` micro-batches (``lax.scan``), on the shards.

    ``params``: what ``objective`` differentiates: the trainable shards, or HYBRID_SHARD_OPT's
    gradient sinks. The accumulator is an fp32 copy of their gradients, never a full
    gradient; every micro-batch reduce-scatters over the shard axes (the units run with
    ``defer_replica_reduce``), and HYBRID_SHARD / HYBRID_SHARD_ZERO2 all-reduce the replica
    axes once per step, on the accumulated shard (FSDP2's ``set_requires_all_reduce(False)``).
    HYBRID_SHARD_OPT reduce-scatters over replica too in every micro-batch's backward, so the
    accumulator is ``[n_pad/(R*S)]`` (docs/memory.md, "Gradient accumulation"). Non-parameter
    variables (BatchNorm statistics, RNG counts) are carried from one micro-batch to the next.
    Returns ``((loss total, count total), aux summed, variables, grads)``.
    """
    replica = plan.replica_axes
    # Differentiating w.r.t. replica-varying parameters lets each micro-batch's gradient
    # stay unsummed over replica.
    params = jax.tree.map(lambda p: vary(p, plan.shard_axes + replica), params)
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)  # [B/W] -> [k, B/(W k), ...]

    def body(carry, mb):
        acc, totals, aux_sum, variables = carry
        (_, (step_totals, aux, variables)), grads = jax.value_and_grad(objective, has_aux=True)(params, variables, mb)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        aux_sum = jax.tree.map(lambda a, x: a + jnp.asarray(x).astype(a.dtype), aux_sum, aux)
        return (acc, jax.tree.map(jnp.add, totals, step_totals), aux_sum, variables), None

    zeros = jax.tree.map(lambda p: vary(jnp.zeros(p.shape, jnp.float32), plan.shard_axes + replica), params)
    zero = vary(jnp.zeros((), jnp.float32), AXES)
    aux_shape = jax.eval_shape(lambda p, v, b: objective(p, v, b)[1][1], params, variables, jax.tree.map(lambda x: x[0], micro))
    aux_zero = jax.tree.map(
        lambda a: vary(jnp.zeros(a.shape, jnp.float32 if jnp.issubdtype(a.dtype, jnp.inexact) else jnp.int32), AXES), aux_shape
    )
    variables = jax.tree.map(lambda v: vary(v, AXES), variables)
    (acc, totals, aux_sum, variables), _ = jax.lax.scan(body, (zeros, (zero, zero), aux_zero, variables), micro)
    if replica and not plan.strategy.scatters_replica:  # HYBRID_SHARD_OPT: summed over replica already
        # [n_pad/N] --all_reduce(replica)--> [n_pad/N], once per step
        acc = jax.lax.psum(acc, replica)
    # floating aux: mean over micro-batches; integer aux: summed
    aux = jax.tree.map(lambda a: a / k if jnp.issubdtype(a.dtype, jnp.inexact) else a, aux_sum)
    return totals, aux, variables, jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)


def gradient_sinks(plan: Plan, train: dict) -> dict:
    """HYBRID_SHARD_OPT: a zero per trainable parameter shaped like its optimizer slice,
    ``[..., n_pad/S] -> [..., n_pad/(R*S)]`` in the parameter dtype, varying over every mesh
    axis (each device owns its own slice). Their values are never read; the step
    differentiates w.r.t. them and gets the gradient as the units' backward reduce-scattered it
    (:func:`zshard.collectives.run_unit`). Unread, they are dropped from the compiled loop."""
    parts = plan.opt_shards // plan.num_shards
    return jax.tree.map(lambda p: vary(jnp.zeros(p.shape[:-1] + (p.shape[-1] // parts,), p.dtype), AXES), train)


def _local_step(plan: Plan, step: "TrainStep", state: ShardedState, batch):
    """One optimizer step on this device's shards (inside ``shard_map``)."""
    world, k = plan.world, step.grad_accum
    # Units all-reduce over replica themselves only under HYBRID_SHARD without accumulation;
    # HYBRID_SHARD_OPT reduce-scatters over replica in each unit's backward (UnitComm.scatter_axes).
    opts = StepOptions(step.remat, step.prefetch, defer_replica_reduce=k > 1 or plan.strategy.scatters_replica)
    token_weighted = []  # set while tracing: loss_fn returned zshard.TokenMean

    train, frozen = plan.split_trainable(state.params)
    variables = traverse_util.flatten_dict(state.variables) if state.variables else {}

    def objective(params, variables, batch, sinks=None):
        """What this device differentiates (trainable shards, or their gradient sinks), with
        ``((loss, count), aux, variables)``."""
        shards = traverse_util.flatten_dict(plan.merge_params(params, frozen))
        model = materialize(plan, shards, variables, opts, None if sinks is None else traverse_util.flatten_dict(sinks))
        with jax.named_scope(LOSS_SCOPE):  # where zshard.shard_reads judges uses of raw shards
            out = step.loss_fn(model, batch)
        loss, aux = _read_loss(out, step.has_aux)
        new_variables = read_variables(plan, model, variables)
        if isinstance(loss, TokenMean):
            # differentiate the sum; divide by the global count afterwards
            total, count = plan.mp.cast_loss(loss.total), jnp.asarray(loss.count, jnp.float32)
            token_weighted.append(True)
            return total, ((total, count), aux, new_variables)
        loss = plan.mp.cast_loss(loss)
        # (local mean / (world * micro-batches)): the reduce-scatters and the accumulation
        # sum these into the gradient of the global mean.
        return loss / (world * k), ((loss, jnp.ones((), jnp.float32)), aux, new_variables)

    if plan.strategy.scatters_replica:
        # HYBRID_SHARD_OPT: differentiate w.r.t. gradient sinks [n_pad/(R S)]; every unit's
        # backward reduce-scatters its gradient over shard and then replica into them, so no
        # [n_pad/S] gradient outlives its unit (docs/memory.md, "Gradient sinks").
        wrt = gradient_sinks(plan, train)

        def differentiated(sinks, variables, batch):
            return objective(train, variables, batch, sinks)
    else:
        wrt, differentiated = train, objective
    if k == 1:
        (_, (totals, aux, new_variables)), grads = jax.value_and_grad(differentiated, has_aux=True)(wrt, variables, batch)
    else:
        totals, aux, new_variables, grads = _accumulate(plan, differentiated, wrt, variables, batch, k)
    loss_total, count = (jax.lax.psum(t, AXES) for t in totals)
    if token_weighted:  # global token mean across devices and micro-batches
        loss = loss_total / count
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
    else:
        loss = loss_total / (world * k)
    grad_norm = global_norm(grads, plan.grad_axes)
    if step.clip_norm is not None:
        # optax.clip_by_global_norm semantics with the norm of the whole (unsharded) gradient
        scale = jnp.where(grad_norm < step.clip_norm, 1.0, step.clip_norm / grad_norm)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    train, opt_state = apply_optimizer(plan, train, grads, state.opt_state)
    params = plan.merge_params(train, frozen)  # frozen shards pass through untouched
    new_variables = _sync_variables(plan, new_variables, variables)
    # loss and grad_norm are psum-ed: every device sees the same verdict.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    taken = jnp.ones((), jnp.int32)
    if step.skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        new_variables = keep(new_variables, variables)
        taken = finite.astype(jnp.int32)  # a skipped step is not an optimizer step
    new_state = dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        step=state.step + taken,
        variables=traverse_util.unflatten_dict(new_variables) if new_variables else state.variables,
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if token_weighted:
        metrics["tokens"] = count
    if step.has_aux:
        metrics["aux"] = _reduce_aux(aux)
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
        prefetch: int | None = None,
        has_aux: bool = False,
    ):
        self.remat = remat_policy(remat)
        self.has_aux = bool(has_aux)
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 0):
            raise ValueError(f"prefetch={prefetch!r}: must be a non-negative integer (units gathered ahead; 0 turns prefetch off), "
                             "or None for the backend's default")
        self._prefetch = None if prefetch is None else int(prefetch)
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
        self._checked: set = set()  # (plan, batch shapes) whose traced step passed the checks

    @property
    def prefetch(self) -> int:
        """Units gathered ahead: the value given, or (``None``) :func:`default_prefetch`, read
        when first used so that building the step does not start a JAX backend."""
        return default_prefetch() if self._prefetch is None else self._prefetch

    def _step(self, state: ShardedState, batch):
        fn = jax.shard_map(
            lambda s, b: _local_step(state.plan, self, s, b),
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
        for p, x in leaves:
            if not np.shape(x):
                raise ValueError(
                    f"batch{jax.tree_util.keystr(p)} is a scalar ({type(x).__name__}): every batch leaf needs a leading "
                    "batch dimension to be split over the devices; pass a constant through loss_fn's closure "
                    "(functools.partial) or repeat it per example (np.full((B,), value))"
                )
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
        batch = self.put_batch(state, batch)
        self._check(state, batch)
        return self._jitted(state, batch)

    def _check(self, state: ShardedState, batch) -> None:
        """Trace (no compile) once per plan and batch shape and refuse a unit under
        device-dependent control flow (:func:`zshard.divergence.check_uniform_collectives`)
        and a block unit's raw shard used as a value in ``loss_fn``
        (:func:`zshard.shard_reads.check_shard_reads`)."""
        key = trace_key(state, batch)
        if key not in self._checked:
            _check_traced(self._jitted.trace(state, batch).jaxpr.jaxpr, state, batch)
            self._checked.add(key)

    def lower(self, state: ShardedState, batch) -> jax.stages.Lowered:
        """The lowered step (``.compile().memory_analysis()``, ``.compile().as_text()``)."""
        batch = self.put_batch(state, batch)
        traced = self._jitted.trace(state, batch)
        _check_traced(traced.jaxpr.jaxpr, state, batch)
        return traced.lower()


def trace_key(state: ShardedState, batch) -> tuple:
    """What a traced step depends on: the plan and the batch's shapes, dtypes and structure
    (the train and eval steps check each traced program once per key)."""
    return state.plan, tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(batch)), jax.tree.structure(batch)


def _check_traced(jaxpr, state: ShardedState, batch) -> None:
    """The checks of a traced step (``jaxpr``: its inputs are ``(state, batch)`` flattened)."""
    check_uniform_collectives(jaxpr)
    check_shard_reads(jaxpr, state.plan, block_shard_inputs(state.plan, (state, batch)))


def default_prefetch(backend: str | None = None) -> int:
    """``make_train_step``'s ``prefetch`` when none is given: ``0`` on CPU, ``1`` elsewhere.

    XLA:CPU runs collectives synchronously, so a prefetched gather overlaps nothing and only
    holds one more gathered unit (``python -m train.bench``, config S on 8 emulated CPU
    devices: temp 16.9 MiB without, 19.9 MiB with; step time 2073 vs 2082 ms, median of 10
    rounds; config P: 2.35 vs 3.22 gathered units; docs/benchmarks.md). On GPU / TPU the latency-hiding
    scheduler overlaps the early gather with the previous unit's compute (FSDP's default
    ``BACKWARD_PRE`` / ``forward_prefetch``). ``backend``: default ``jax.default_backend()``.
    """
    return 0 if (backend or jax.default_backend()) == "cpu" else 1


def make_train_step(
    loss_fn: Callable[[nnx.Module, Any], Any],
    *,
    grad_accum: int = 1,
    clip_norm: float | None = None,
    skip_nonfinite: bool = False,
    remat="block",
    prefetch: int | None = None,
    has_aux: bool = False,
) -> TrainStep:
    """Build the sharded step for ``loss_fn(model, batch) -> scalar mean loss``.

    Args:
      loss_fn: written for one device and an ordinary model: it receives this device's
        slice of the batch (``[B / (R*S*grad_accum), ...]``) and returns the mean loss over
        it (a scalar), or :class:`TokenMean` ``(sum, count)`` for token-weighted losses with
        masking: then the loss and the gradient are the global token mean over all devices
        and micro-batches, however unevenly the valid tokens fall (``metrics["tokens"]`` is
        the global count). A tuple is never guessed: see ``has_aux``.
      has_aux: ``loss_fn`` returns ``(loss, aux)`` (``jax.value_and_grad``'s convention);
        ``aux`` is any pytree of arrays, returned in ``metrics["aux"]`` reduced over
        devices (and micro-batches): floating leaves averaged, integer and boolean leaves
        summed.
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
        ``forward_prefetch`` / ``BackwardPrefetch.BACKWARD_PRE``): with ``1`` the
        gather of unit ``i+1`` depends only on unit ``i``'s input, so XLA's latency-hiding
        scheduler can run it during unit ``i``'s compute; in backward, unit ``i-1``'s
        re-gather may start when unit ``i``'s backward starts. Costs up to ``prefetch``
        more gathered units in temp memory. ``0``: each unit gathers only once its own input
        (forward) or output cotangent (backward) exists. ``None`` (default): the backend's
        default, :func:`default_prefetch` (``0`` on CPU, where nothing overlaps; ``1`` on
        GPU / TPU). Units stacked under ``nnx.scan``
        gather inside the loop and are not prefetched.

    Raises:
      ValueError: ``grad_accum`` not a positive integer, ``clip_norm`` not positive,
        ``remat`` not a known policy, ``prefetch`` negative. When the step is traced: a
        non-scalar loss (named with its shape); a tuple returned without ``has_aux``
        (``TypeError``); a unit under device-dependent control flow; a block unit's raw
        shard used as a value in ``loss_fn``, e.g. an L2 penalty over
        ``jax.tree.leaves(nnx.state(model))`` (the parameter named; read it as
        ``variable[...]``, :func:`zshard.shard_reads.check_shard_reads`).
    """
    return TrainStep(
        loss_fn,
        grad_accum=grad_accum,
        clip_norm=clip_norm,
        skip_nonfinite=skip_nonfinite,
        remat=remat,
        prefetch=prefetch,
        has_aux=has_aux,
    )
