"""The sharded forward pass: evaluation (``make_eval_step``) and any forward-only function.

Forward only, inside the same ``jax.shard_map`` as the train step (docs/design.md section 5,
steps 1-2): each device takes its slice of the batch, the root unit is all-gathered once,
every block unit is all-gathered just before its ``__call__`` and dropped after it. No
gradient, so no backward re-gather and no reduce-scatter: per call, one all-gather per
unit (per layer for stacked units) plus the scalar all-reduces of the result.

The model is built by :func:`zshard.intercept.materialize` (the train step's own machinery), so
units, mixed precision (gather and compute in ``param_dtype``) and strategies are those
of the train step. The forward gathers are tied to the unit's input by a data dependency
(the ``fwd`` rule of :func:`zshard.collectives.run_unit`, taken through ``jax.vjp`` whose
pullback is never called): without it the XLA CPU scheduler issues every gather at the
start and the temporary memory is twice the model (docs/design.md section 8.1, forced schedule;
docs/eval-and-hf.md, design notes).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P

from zshard.mesh import AXES
from zshard.state import ShardedState
from zshard.intercept import StepOptions, materialize
from zshard.shard_reads import LOSS_SCOPE, block_shard_inputs, check_shard_reads
from zshard.step import TokenMean, TrainStep, default_prefetch, trace_key

__all__ = ["EvalStep", "make_eval_step", "forward"]


def forward(state: ShardedState, params: dict, variables: dict, fn: Callable, *args, prefetch: int | None = None):
    """Inside ``shard_map``: ``fn(model, *args)`` on the model materialised from the local shards.

    Args:
      state: the :class:`ShardedState` (only its plan is read).
      params: this device's parameter shards, nested like ``state.params`` (``[n_pad / N]`` each).
      variables: the non-parameter variables, nested like ``state.variables`` (replicated);
        read, never written back (evaluation does not change the state).
      fn: ``fn(model, *args) -> pytree of arrays``, written for one device.
      args: pytrees of this device's arrays.
      prefetch: units gathered ahead (:class:`zshard.intercept.StepOptions`); ``None``:
        :func:`zshard.step.default_prefetch` (0 on CPU, 1 on GPU/TPU).

    Returns:
      ``fn``'s value. Each block unit is gathered once, just before it runs (forced by data
      dependency on its input, see the module docstring); nothing is differentiated. ``fn``
      sees the model in evaluation mode (``model.eval()``: ``deterministic=True``,
      ``use_running_average=True``), as ``model.eval()`` before a PyTorch evaluation loop.
    """
    plan = state.plan
    flat = traverse_util.flatten_dict(params)
    var_flat = traverse_util.flatten_dict(variables) if variables else {}
    opts = StepOptions(prefetch=default_prefetch() if prefetch is None else prefetch)
    # Trace through jax.vjp w.r.t. the floating shards: the custom-VJP unit calls then use
    # their fwd rule (each gather issued after the unit's input exists). The pullback is
    # never called, so residuals and backward are dead code that XLA removes.
    floats = {p: x for p, x in flat.items() if jnp.issubdtype(x.dtype, jnp.inexact)}
    others = {p: x for p, x in flat.items() if p not in floats}

    def run(floats):
        model = materialize(plan, {**others, **floats}, var_flat, opts)
        model.eval()  # evaluation mode: nnx.Dropout off, nnx.BatchNorm on its running averages
        with jax.named_scope(LOSS_SCOPE):  # where zshard.shard_reads judges uses of raw shards
            return fn(model, *args)

    out, _ = jax.vjp(run, floats)
    return out


def _reduce(plan, out) -> dict:
    """``fn``'s value -> the global result over all devices (``psum`` over the mesh)."""
    if isinstance(out, TokenMean):
        # token-weighted: global sum / global count
        total, count = (jax.lax.psum(jnp.asarray(x, jnp.float32), AXES) for x in (out.total, out.count))
        return {"loss": total / count, "tokens": count}
    if isinstance(out, dict):
        if "loss" not in out:
            raise ValueError(f"eval fn returned a dict without 'loss' (keys {sorted(out)}); add the loss under 'loss'")
        return {k: jax.lax.psum(jnp.asarray(v, jnp.float32), AXES) / plan.world for k, v in out.items()}
    if isinstance(out, (tuple, list)) or jnp.shape(out) != ():
        raise TypeError(
            f"eval fn returned {type(out).__name__} of shape {jnp.shape(out) if not isinstance(out, (tuple, list)) else len(out)}; "
            "return a scalar mean, zshard.TokenMean(sum, count), or a dict of scalars with 'loss'"
        )
    return {"loss": jax.lax.psum(plan.mp.cast_loss(out).astype(jnp.float32), AXES) / plan.world}


class EvalStep:
    """``eval(state, batch) -> metrics``: ``fn`` on the sharded model, forward only.

    ``batch``: a pytree whose leaves have the global batch as leading dimension, split over
    all ``R*S`` devices (``PartitionSpec(("replica", "shard"))``), as for the train step.
    ``metrics["loss"]``: float32 scalar, replicated: the mean over devices of ``fn``'s
    per-device scalar (each device's batch slice has the same size, so this is the global
    mean of a per-example mean loss); when ``fn`` returns ``zshard.TokenMean(sum, count)``
    it is ``sum(sum) / sum(count)`` over devices (the token-weighted mean) and
    ``metrics["tokens"]`` is the global count; when ``fn`` returns a dict of scalars, each
    is the mean over devices. The state is not donated and not changed.

    Raises:
      ValueError: a batch leaf is a scalar or its leading dimension does not divide by the
        device count (before any compile); a dict result without ``"loss"``; ``fn`` using a
        block unit's raw shard as a value, e.g. ``jax.tree.leaves(nnx.state(model))``
        (named, before compiling; :func:`zshard.shard_reads.check_shard_reads`).
      TypeError: ``fn`` returned a tuple or a non-scalar.
    """

    grad_accum = 1  # read by the batch placement shared with the train step
    put_batch = TrainStep.put_batch

    def __init__(self, fn: Callable[[nnx.Module, Any], Any], *, prefetch: int | None = None):
        if not callable(fn):
            raise TypeError(f"make_eval_step: fn must be a callable fn(model, batch), got {type(fn).__name__}")
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
            raise ValueError(f"prefetch={prefetch!r}: must be a non-negative integer (units gathered ahead; 0 turns prefetch off)")
        self.fn, self.prefetch = fn, prefetch
        self._jitted = jax.jit(self._eval)
        self._checked: set = set()  # (plan, batch shapes) whose traced step passed the check

    def _eval(self, state: ShardedState, batch):
        plan = state.plan

        def local(params, variables, batch):
            return _reduce(plan, forward(state, params, variables, self.fn, batch, prefetch=self.prefetch))

        specs = state.specs()
        return jax.shard_map(local, mesh=plan.mesh, in_specs=(specs.params, specs.variables, P(AXES)), out_specs=P())(
            state.params, state.variables, batch
        )

    def __call__(self, state: ShardedState, batch) -> dict:
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state.params)):
            raise ValueError("this state was donated to a train step (its buffers are deleted); evaluate the state that step returned")
        batch = self.put_batch(state, batch)
        key = trace_key(state, batch)
        if key not in self._checked:  # trace (no compile) once: a block's raw shard used as a value
            jaxpr = self._jitted.trace(state, batch).jaxpr.jaxpr
            check_shard_reads(jaxpr, state.plan, block_shard_inputs(state.plan, (state, batch)))
            self._checked.add(key)
        return self._jitted(state, batch)

    def lower(self, state: ShardedState, batch) -> jax.stages.Lowered:
        """The lowered eval step (``.compile().memory_analysis()``, ``.compile().as_text()``)."""
        return self._jitted.lower(state, self.put_batch(state, batch))


def make_eval_step(fn: Callable[[nnx.Module, Any], Any], *, prefetch: int | None = None) -> EvalStep:
    """Build the sharded, forward-only evaluation of ``fn(model, batch)``.

    Args:
      fn: written for one device and an ordinary model (as ``loss_fn`` of
        :func:`zshard.make_train_step`): receives the model in evaluation mode
        (``model.eval()``: ``nnx.Dropout`` passes its input through, ``nnx.BatchNorm`` uses its
        running averages; call ``model.train()`` inside ``fn`` for training-mode behaviour)
        and this device's slice of the batch (``[B / (R*S), ...]``), and returns a scalar
        mean, ``zshard.TokenMean(sum, count)`` (token-weighted), or a dict of scalars with
        ``"loss"``.
      prefetch: as for :func:`zshard.make_train_step`: a unit's all-gather may be issued
        this many unit calls early (overlap on GPU); ``None`` (default): the backend's,
        :func:`zshard.step.default_prefetch` (0 on CPU, 1 on GPU/TPU). Temporary memory: about
        ``2 + prefetch`` gathered units plus activations (the unit in use is held as its
        all-gather output ``[N, L/N]`` and as its parameters; a prefetched one only as the
        all-gather output until it is needed): measured 3.39 blocks with ``1``, 2.4 with ``0``
        (8 blocks of 1.05 MB, FULL_SHARD 1x8, tests/test_evaluate.py).

    Returns:
      :class:`EvalStep`; ``eval(state, batch)["loss"]`` is the global loss (float32).
      Per call and device: one all-gather per unit (the root unit's stays for the call),
      no reduce-scatter.

    Raises:
      TypeError: ``fn`` not callable. ValueError: ``prefetch`` negative.
    """
    return EvalStep(fn, prefetch=prefetch)
