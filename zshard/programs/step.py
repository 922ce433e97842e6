"""The sharded train step: one ``jax.jit(jax.shard_map(...))`` over the whole mesh.

Per device (docs/design.md section 5):

1. take its slice of the batch (leading dimension split over ``("replica", "shard")``);
2. all-gather the root unit (embeddings, head, ...), rebuild the model with it; every block
   unit is intercepted so that its ``__call__`` all-gathers the block's parameters (each on its
   own) just before it runs and drops them afterwards (:func:`zshard.programs.unit_call.run_unit`);
3. backward: each unit gathers again, recomputes, and reduce-scatters its gradient
   (+ all-reduce of the shard over ``replica`` for HYBRID_SHARD; + reduce-scatter of it over
   ``replica`` into the parameter's optimizer slice for HYBRID_SHARD_OPT: the gradient exit,
   zshard/wire/grad_exit.py); the loss is scaled by
   ``1 / world`` so the summed gradient is that of the global mean loss;
4. Optax updates the local shards; the loss and the gradient norm are ``psum``-ed.

This module owns the per-device body (``_local_step``: differentiation, accumulation, the
loss scale, clipping, the optimizer, the non-parameter variables) and the public
:class:`TrainStep`, which supplies that body to the program shell every zshard program shares
(:class:`zshard.programs.program.ShardedProgram`: the jit, ``lower`` / ``trace`` / ``export``, the
checks); the options are a frozen :class:`~zshard.programs.step_config.StepConfig`, the batch placement
is :mod:`zshard.programs.batch`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P

from zshard.mesh.axes import vary
from zshard.programs.batch import batch_specs, put_batch, sequence_split, trace_key
from zshard.wire.feedback import feedback_exits, new_feedback
from zshard.wire.grad_exit import all_reduce_replicas
from zshard.programs.intercept import materialize, read_variables
from zshard.inspection.jaxprs import LOSS_SCOPE
from zshard.mesh.mesh import context_size
from zshard.optim.offload import check_placement, compute_params, update_offloaded
from zshard.optim.optim import apply_optimizer, global_norm
from zshard.programs.program import ShardedProgram, TraceInfo, body_tracing, run_sharded
from zshard.context.sequence import SequenceSplit, check_split
from zshard.plan.state import Plan, ShardedState
from zshard.programs.step_config import StepConfig, default_prefetch
from zshard.mesh.strategy import ReplicaReduce

__all__ = ["TokenMean", "TrainStep", "default_prefetch", "make_train_step", "trace_key"]


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


def _reduce_aux(plan: Plan, aux):
    """Aux leaves across devices (and micro-batches, summed before): floating leaves are
    averaged, integer and boolean leaves summed (counts), over every data axis."""
    axes = plan.data_axes

    def one(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, axes)
        return jax.lax.psum(x.astype(jnp.int32), axes)

    return jax.tree.map(one, aux)


def _sync_variables(plan: Plan, new: dict, old: dict) -> dict:
    """Non-parameter variables after the step, identical on every device: floating ones
    (BatchNorm statistics) averaged over all devices, integer ones (RNG counts, counters) the
    largest value (they advance the same way on every device)."""
    out, axes = {}, plan.data_axes
    for path, value in new.items():
        value = jnp.asarray(value)
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            out[path] = old[path]
        elif jnp.issubdtype(value.dtype, jnp.inexact):
            out[path] = jax.lax.pmean(vary(value, axes), axes).astype(value.dtype)
        else:
            out[path] = jax.lax.pmax(vary(value, axes), axes).astype(value.dtype)
    return out


def _accumulate(plan: Plan, objective: Callable, params: dict, variables: dict, batch, k: int, reduce, dtypes=None, feedback=None):
    """Gradient accumulation over ``k`` micro-batches (``lax.scan``), on the shards.

    ``params``: what ``objective`` differentiates: the trainable shards, or HYBRID_SHARD_OPT's
    optimizer slices (the gradient exit values). The accumulator is an fp32 copy of their gradients, never a full
    gradient; every micro-batch reduce-scatters over the shard axes, and with
    ``ReplicaReduce.PER_STEP`` (HYBRID_SHARD, HYBRID_SHARD_ZERO2, NO_SHARD, SHARD_OPT) the
    replica axes are all-reduced once per step, on the accumulated shard (FSDP2's
    ``set_requires_all_reduce(False)``). ``TO_SLICES`` (HYBRID_SHARD_OPT) reduce-scatters over
    replica too in every micro-batch's backward, so the accumulator is ``[n_pad/(R*S)]``
    (docs/memory.md, "Gradient accumulation"). Non-parameter
    variables (BatchNorm statistics, RNG counts) are carried from one micro-batch to the next.
    ``dtypes``: a tree like ``params`` whose leaves' dtypes the gradients are returned in
    (default ``params``; the masters' with ``offload="optimizer+master"``, whose ``params`` are
    the ``param_dtype`` copies). ``feedback``: error feedback's residuals (exit values), carried from one
    micro-batch to the next (zshard/wire/feedback.py); ``objective`` then takes ``(params, feedback)``.
    Returns ``((loss total, count total), aux summed, variables, grads, feedback after the last)``.
    """
    replica = plan.replica_axes
    # Differentiating w.r.t. replica-varying parameters lets each micro-batch's gradient
    # stay unsummed over replica.
    params = jax.tree.map(lambda p: vary(p, plan.shard_axes + replica), params)
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)  # [B/W] -> [k, B/(W k), ...]

    def body(carry, mb):
        acc, totals, aux_sum, variables, fb = carry
        wrt = params if feedback is None else (params, fb)
        (_, (step_totals, aux, variables)), grads = jax.value_and_grad(objective, has_aux=True)(wrt, variables, mb)
        grads, fb = (grads, fb) if feedback is None else grads  # error feedback: the exit values' cotangents, the new residuals
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        aux_sum = jax.tree.map(lambda a, x: a + jnp.asarray(x).astype(a.dtype), aux_sum, aux)
        return (acc, jax.tree.map(jnp.add, totals, step_totals), aux_sum, variables, fb), None

    zeros = jax.tree.map(lambda p: vary(jnp.zeros(p.shape, jnp.float32), plan.shard_axes + replica), params)
    axes = plan.data_axes
    zero = vary(jnp.zeros((), jnp.float32), axes)
    wrt0 = params if feedback is None else (params, feedback)
    aux_shape = jax.eval_shape(lambda p, v, b: objective(p, v, b)[1][1], wrt0, variables, jax.tree.map(lambda x: x[0], micro))
    aux_zero = jax.tree.map(
        lambda a: vary(jnp.zeros(a.shape, jnp.float32 if jnp.issubdtype(a.dtype, jnp.inexact) else jnp.int32), axes), aux_shape
    )
    variables = jax.tree.map(lambda v: vary(v, axes), variables)
    (acc, totals, aux_sum, variables, feedback), _ = jax.lax.scan(body, (zeros, (zero, zero), aux_zero, variables, feedback), micro)
    match reduce:
        case ReplicaReduce.PER_STEP:  # [n_pad/N] --all_reduce(replica)--> [n_pad/N], once per step
            acc = all_reduce_replicas(plan, acc)  # one psum (replica_format: quantized per parameter)
        case ReplicaReduce.TO_SLICES | ReplicaReduce.NONE:  # summed over replica already, or no replica axes
            pass
        case _:
            raise ValueError(f"zshard: gradient accumulation under replica reduction {reduce!r}")
    # floating aux: mean over micro-batches; integer aux: summed
    aux = jax.tree.map(lambda a: a / k if jnp.issubdtype(a.dtype, jnp.inexact) else a, aux_sum)
    return totals, aux, variables, jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params if dtypes is None else dtypes), feedback


def optimizer_slices(plan: Plan, train: dict) -> dict:
    """HYBRID_SHARD_OPT's gradient exit values: a zero per trainable parameter shaped like its optimizer slice,
    ``[..., n_pad/S] -> [..., n_pad/(R*S)]`` in the parameter dtype, varying over every mesh
    axis (each device owns its own slice). Their values are never read; the step
    differentiates w.r.t. them and gets the gradient as the units' backward reduce-scattered it
    (:func:`zshard.programs.unit_call.run_unit`). Unread, they are dropped from the compiled loop."""
    parts = plan.opt_shards // plan.num_shards
    return jax.tree.map(lambda p: vary(jnp.zeros(p.shape[:-1] + (p.shape[-1] // parts,), p.dtype), plan.data_axes), train)


def _local_step(plan: Plan, config: StepConfig, state: ShardedState, batch, split: SequenceSplit | None = None):
    """One optimizer step on this device's shards (inside ``shard_map``) -> ``((state, metrics),
    TraceInfo)``; ``split``: how the batch's sequences are split over ``context``
    (:mod:`zshard.context.sequence`), for ``zshard.positions`` and ``zshard.attention`` while the whole body
    (backward and recomputes included) traces; the :class:`~zshard.programs.program.TraceInfo` says what
    that trace found (the attention calls per unit)."""
    with body_tracing(plan, split) as record:  # zshard.moe's calls checked too: expert parameters through it
        out = _step_body(plan, config, state, batch)
    check_split(split, record.sequence, context_size(plan.mesh), config.sequence_axis is not None)  # a context axis nothing reads: refused
    return out, TraceInfo.of(record)


def _step_body(plan: Plan, config: StepConfig, state: ShardedState, batch):
    world, k = plan.world, config.grad_accum
    comm = config.comm(plan)  # the step's one replica-reduction decision (ReplicaReduce)
    prefetch = config.resolved_prefetch(plan.mesh)
    token_weighted = []  # set while tracing: loss_fn returned zshard.TokenMean

    train, frozen = plan.split_trainable(state.params)
    compute = compute_params(plan, state, train)  # what the units gather: train, or the masters' device copies
    variables = traverse_util.flatten_dict(state.variables) if state.variables else {}

    def objective(params, variables, batch, exits=None):
        """What this device differentiates (trainable shards, or their gradient exit values), with
        ``((loss, count), aux, variables)``."""
        shards = traverse_util.flatten_dict(plan.merge_params(params, frozen))
        model = materialize(plan, shards, variables, comm, prefetch, None if exits is None else traverse_util.flatten_dict(exits))
        with jax.named_scope(LOSS_SCOPE):  # where zshard.inspection.checks judges uses of raw shards
            out = config.fn(model, batch)
        loss, aux = _read_loss(out, config.has_aux)
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

    ex = comm.exit  # how the gradients leave the units ([Note: gradient exit], zshard/wire/grad_exit.py)
    if ex.to_slices:
        # HYBRID_SHARD_OPT: differentiate w.r.t. the optimizer slices [n_pad/(R S)]; every unit's
        # backward reduce-scatters its gradient over shard and then replica into them, so no
        # [n_pad/S] gradient outlives its unit (docs/memory.md).
        wrt, residuals = optimizer_slices(plan, train), None

        def differentiated(slices, variables, batch):
            return objective(compute, variables, batch, slices)
    elif ex.residuals:  # the residuals enter as exit values, their cotangents are the new ones (zshard/wire/feedback.py)
        wrt, residuals = compute, feedback_exits(plan, train, state.feedback)
        differentiated = lambda w, v, b: objective(w[0], v, b, w[1])  # noqa: E731
    else:
        wrt, differentiated, residuals = compute, objective, None
    if k == 1:
        (_, (totals, aux, new_variables)), grads = jax.value_and_grad(differentiated, has_aux=True)(wrt if residuals is None else (wrt, residuals), variables, batch)
        grads, residuals = (grads, None) if residuals is None else grads
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, train if wrt is compute else wrt)  # [Note: reduce-dtype cotangents]
    else:
        dtypes = train if compute is not train else None  # offload="optimizer+master": gradients in the masters' dtype
        totals, aux, new_variables, grads, residuals = _accumulate(plan, differentiated, wrt, variables, batch, k, ex.reduce, dtypes, residuals)
    feedback = state.feedback if residuals is None else new_feedback(state.feedback, residuals)
    loss_total, count = (jax.lax.psum(t, plan.data_axes) for t in totals)
    if token_weighted:  # global token mean across devices and micro-batches
        loss = loss_total / count
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
    else:
        loss = loss_total / (world * k)
    grad_norm = global_norm(grads, plan)
    if config.clip_norm is not None:
        # optax.clip_by_global_norm semantics with the norm of the whole (unsharded) gradient
        scale = jnp.where(grad_norm < config.clip_norm, 1.0, config.clip_norm / grad_norm)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    # loss and grad_norm are psum-ed: every device sees the same verdict.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    device_params = state.device_params
    if plan.offload is None:
        train, opt_state = apply_optimizer(plan, train, grads, state.opt_state)
    else:  # host leaves to the device, the same update, back to the host ([Note: offload update]); skips kept there
        keep = finite if config.skip_nonfinite else None
        train, opt_state, device_params = update_offloaded(plan, functools.partial(apply_optimizer, plan), train, grads, state.opt_state, keep)
    params = plan.merge_params(train, frozen)  # frozen shards pass through untouched
    new_variables = _sync_variables(plan, new_variables, variables)
    taken = jnp.ones((), jnp.int32)
    if config.skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        if plan.offload is None:
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        new_variables = keep(new_variables, variables)
        feedback = keep(feedback, state.feedback)
        taken = finite.astype(jnp.int32)  # a skipped step is not an optimizer step
    new_state = dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        step=state.step + taken,
        variables=traverse_util.unflatten_dict(new_variables) if new_variables else state.variables,
        device_params=device_params,
        feedback=feedback,
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": (~finite).astype(jnp.int32)}
    if token_weighted:
        metrics["tokens"] = count
    if config.has_aux:
        metrics["aux"] = _reduce_aux(plan, aux)
    return new_state, metrics


class TrainStep(ShardedProgram):
    """``step(state, batch) -> (state, metrics)``: one optimizer step on the sharded state.

    Built by :func:`make_train_step` from a frozen :class:`~zshard.programs.step_config.StepConfig`
    (``step.config``; ``step.grad_accum``, ``step.remat``, ``step.prefetch`` ... read it); the jit,
    ``lower``, ``trace``, ``export`` and the checks are the shell every program shares
    (:class:`zshard.programs.program.ShardedProgram`).

    ``batch`` is any pytree of numpy or jax arrays whose leading dimension is the global
    batch; it is split over all ``R*S`` devices (``PartitionSpec(("replica", "shard"))``).
    ``metrics["loss"]`` is the global mean loss (float32 scalar), ``metrics["grad_norm"]`` the
    global L2 norm of the gradient before the update. The input state is donated.

    Raises:
      ValueError: a batch leaf is a scalar or its leading dimension does not divide by the
        device count (before any compile); a state donated to an earlier step; a leaf in the
        wrong memory (:func:`zshard.optim.offload.check_placement`).
    """

    factory = "zshard.make_train_step"
    donate = True
    donated_error = ("this state was donated to an earlier step (its buffers are deleted); "
                     "use the state that step returned: state, metrics = step(state, batch)")

    loss_fn = property(lambda self: self.config.fn)
    grad_accum = property(lambda self: self.config.grad_accum)
    clip_norm = property(lambda self: self.config.clip_norm)
    skip_nonfinite = property(lambda self: self.config.skip_nonfinite)
    remat = property(lambda self: self.config.remat)
    has_aux = property(lambda self: self.config.has_aux)
    hpz = property(lambda self: self.config.hpz)

    @property
    def prefetch(self) -> int:
        """Units gathered ahead: the value given, or (``None``) :func:`default_prefetch`, read
        when first used so that building the step does not start a JAX backend."""
        return self.config.resolved_prefetch()

    def _step(self, state: ShardedState, batch):
        """The body: ``(state, batch) -> ((state, metrics), TraceInfo)``, one ``shard_map`` of
        :func:`_local_step` (the jitted program, ``jit__step``, returns ``(state, metrics)``)."""
        plan, config = state.plan, self.config  # the traced body sees the plan and the frozen config only
        split = sequence_split(plan, batch, config.sequence_axis)
        local = functools.partial(_local_step, plan, config, split=split)
        specs = state.specs()
        return run_sharded(plan, local, (state, batch), (specs, batch_specs(plan, batch, config.sequence_axis)), (specs, P()))

    _program = _step

    def _out_shardings(self, state: ShardedState):
        """With a ``tensor`` axis or host offload: the state's own shardings, memory kinds included
        (``ShardedState.shardings``), and the metrics replicated; else ``None``."""
        plan = state.plan
        if plan.tensor == 1 and plan.offload is None:
            return None
        return state.shardings(), jax.sharding.NamedSharding(plan.mesh, P())

    def _check_state(self, state: ShardedState) -> None:
        check_placement(state)  # a leaf in the wrong memory, named before JAX refuses it unnamed

    def _place(self, state: ShardedState, batch):
        return self.put_batch(state, batch)

    def put_batch(self, state: ShardedState, batch):
        """:func:`zshard.programs.batch.put_batch` for this step's micro-batches and sequence axes."""
        return put_batch(state.plan, batch, self.config.grad_accum, self.config.sequence_axis)


def make_train_step(
    loss_fn: Callable[[nnx.Module, Any], Any],
    *,
    grad_accum: int = 1,
    clip_norm: float | None = None,
    skip_nonfinite: bool = False,
    remat="block",
    prefetch: int | None = None,
    has_aux: bool = False,
    sequence_axis=None,
    hpz: bool = False,
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
      sequence_axis: the batch's sequence dimension, for context parallelism
        (docs/long-sequences.md): an int for every leaf (``1``: ``[B, L, ...]``), or a pytree
        like the batch (a prefix of it) with ``None`` for leaves without one. On a mesh with a
        ``context`` axis of ``C`` devices the rows are split over ``(replica, shard)`` and each
        sequence over ``context`` in the head-tail order (device ``i`` holds chunks ``i`` and
        ``2C-1-i`` of ``2C``; the length must divide by ``2C``), so ``loss_fn`` sees ``[B / (R*S),
        L / C, ...]``: the model takes each token's global position from :func:`zshard.positions`
        and attends with :func:`zshard.attention`; leaves without a sequence axis are the same on
        every context device. The loss scale is ``1 / (R*S*C)`` (every device holds as many
        tokens). ``None`` (default): the rows are split over every data axis, ``context`` too.
      hpz: ZeRO++ hierarchical partitioning (arXiv 2306.10209 section 3.2; DeepSpeed's
        ``zero_hpz_partition_size`` = the ``shard`` axis size), FULL_SHARD on a mesh with
        ``replica > 1`` and ``shard > 1`` only: each unit's forward gathers over the world as before and also keeps
        its ``[n_pad/S]`` slice of the gathered weights (in ``param_dtype``, dequantized when a
        ``gather_format`` is set); the backward re-gathers that slice over ``shard`` only (inside
        a node). Cross-node backward gather volume 0 instead of M, memory + M/S per unit
        (:mod:`zshard.wire.hpz`, docs/quantized.md "hpZ").

    Raises:
      ValueError: ``grad_accum`` not a positive integer, ``clip_norm`` not positive,
        ``remat`` not a known policy, ``prefetch`` negative. When the step is traced: ``hpz``
        with another strategy than FULL_SHARD or on ``replica = 1``; a
        non-scalar loss (named with its shape); a tuple returned without ``has_aux``
        (``TypeError``); a unit under device-dependent control flow; a block unit's raw
        shard used as a value in ``loss_fn``, e.g. an L2 penalty over
        ``jax.tree.leaves(nnx.state(model))`` (the parameter named; read it as
        ``variable[...]``, :func:`zshard.inspection.checks.check_shard_reads`). Before compiling, with a
        ``sequence_axis``: a leaf without that axis, a length not divisible by ``2C`` (each
        named); a warning when ``loss_fn`` never asks for :func:`zshard.positions` on a
        ``context`` mesh.
    """
    return TrainStep(
        StepConfig(
            loss_fn, has_aux=has_aux, grad_accum=grad_accum, clip_norm=clip_norm, skip_nonfinite=skip_nonfinite,
            remat=remat, prefetch=prefetch, sequence_axis=sequence_axis, hpz=hpz,
        )
    )
