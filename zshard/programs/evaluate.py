"""The sharded forward pass: evaluation (``make_eval_step``) and any forward-only function.

Forward only, inside the same ``jax.shard_map`` as the train step (docs/design.md section 5,
steps 1-2): each device takes its slice of the batch, the root unit is all-gathered once,
every block unit is all-gathered just before its ``__call__`` and dropped after it. No
gradient, so no backward re-gather and no reduce-scatter: per call, one all-gather per
unit (per layer for stacked units) plus the scalar all-reduces of the result.

The model is built by :func:`zshard.programs.intercept.materialize` (the train step's own machinery), so
units, mixed precision (gather and compute in ``param_dtype``) and strategies are those
of the train step. The forward gathers are tied to the unit's input by a data dependency
(the ``fwd`` rule of :func:`zshard.programs.unit_call.run_unit`, taken through ``jax.vjp`` whose
pullback is never called): without it the XLA CPU scheduler issues every gather at the
start and the temporary memory is twice the model (docs/design.md section 8.1, forced schedule;
docs/eval-and-hf.md, design notes).

Public: :func:`make_eval_step` (a reduced loss) and :func:`make_forward` (any per-row
outputs: logits, generated tokens; the whole model gathered once per call if asked).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import PartitionSpec as P

from zshard.programs.batch import batch_specs, put_args, put_batch, sequence_split
from zshard.wire.collectives import gather_params
from zshard.programs.intercept import materialize
from zshard.inspection.jaxprs import LOSS_SCOPE
from zshard.optim.offload import gather_source
from zshard.programs.program import ShardedProgram, TraceInfo, body_tracing, run_sharded
from zshard.context.sequence import check_split
from zshard.plan.state import ShardedState
from zshard.programs.step import TokenMean
from zshard.programs.step_config import StepConfig

__all__ = ["EvalStep", "Forward", "forward", "make_eval_step", "make_forward"]


def forward(state: ShardedState, params: dict, variables: dict, fn: Callable, *args, prefetch: int | None = None, split=None):
    """Inside ``shard_map``: ``fn(model, *args)`` on the model materialised from the local shards.

    Args:
      state: the :class:`ShardedState` (only its plan is read).
      params: this device's parameter shards, nested like ``state.params`` (``[n_pad / N]`` each).
      variables: the non-parameter variables, nested like ``state.variables`` (replicated);
        read, never written back (evaluation does not change the state).
      fn: ``fn(model, *args) -> pytree of arrays``, written for one device.
      args: pytrees of this device's arrays.
      prefetch: units gathered ahead; ``None``: :func:`zshard.programs.step_config.default_prefetch`
        (0 on CPU, 1 on GPU/TPU).
      split: the :class:`~zshard.context.sequence.SequenceSplit` of the arguments' sequences over
        ``context`` (``zshard.positions``, ``zshard.attention``), or ``None``.

    Returns:
      ``fn``'s value. Each block unit is gathered once, just before it runs (forced by data
      dependency on its input, see the module docstring); nothing is differentiated. ``fn``
      sees the model in evaluation mode (``model.eval()``: ``deterministic=True``,
      ``use_running_average=True``), as ``model.eval()`` before a PyTorch evaluation loop.
    """
    return _forward(state, params, variables, fn, *args, prefetch=prefetch, split=split)[0]


def _forward(state: ShardedState, params: dict, variables: dict, fn: Callable, *args, prefetch: int | None = None, split=None):
    """:func:`forward` -> ``(fn's value, TraceInfo)``: what the program bodies call."""
    plan = state.plan
    flat = traverse_util.flatten_dict(params)
    var_flat = traverse_util.flatten_dict(variables) if variables else {}
    config = StepConfig(fn, prefetch=prefetch)
    comm = config.comm(plan, differentiated=False)  # forward only: ReplicaReduce.NONE
    # Trace through jax.vjp w.r.t. the floating shards: the custom-VJP unit calls then use
    # their fwd rule (each gather issued after the unit's input exists). The pullback is
    # never called, so residuals and backward are dead code that XLA removes.
    floats = {p: x for p, x in flat.items() if jnp.issubdtype(x.dtype, jnp.inexact)}
    others = {p: x for p, x in flat.items() if p not in floats}

    def run(floats):
        model = materialize(plan, {**others, **floats}, var_flat, comm, config.resolved_prefetch(plan.mesh))
        model.eval()  # evaluation mode: nnx.Dropout off, nnx.BatchNorm on its running averages
        with jax.named_scope(LOSS_SCOPE):  # where zshard.inspection.checks judges uses of raw shards
            return fn(model, *args)

    with body_tracing(plan, split) as record:
        out, _ = jax.vjp(run, floats)
    check_split(split, record.sequence)  # split sequences and no zshard.attention: refused
    return out, TraceInfo.of(record)


def _reduce(plan, out) -> dict:
    """``fn``'s value -> the global result over all devices (``psum`` over the mesh)."""
    axes = plan.data_axes
    if isinstance(out, TokenMean):
        # token-weighted: global sum / global count
        total, count = (jax.lax.psum(jnp.asarray(x, jnp.float32), axes) for x in (out.total, out.count))
        return {"loss": total / count, "tokens": count}
    if isinstance(out, dict):
        if "loss" not in out:
            raise ValueError(f"eval fn returned a dict without 'loss' (keys {sorted(out)}); add the loss under 'loss'")
        return {k: jax.lax.psum(jnp.asarray(v, jnp.float32), axes) / plan.world for k, v in out.items()}
    if isinstance(out, (tuple, list)) or jnp.shape(out) != ():
        raise TypeError(
            f"eval fn returned {type(out).__name__} of shape {jnp.shape(out) if not isinstance(out, (tuple, list)) else len(out)}; "
            "return a scalar mean, zshard.TokenMean(sum, count), or a dict of scalars with 'loss'"
        )
    return {"loss": jax.lax.psum(plan.mp.cast_loss(out).astype(jnp.float32), axes) / plan.world}


class EvalStep(ShardedProgram):
    """``eval(state, batch) -> metrics``: ``fn`` on the sharded model, forward only.

    ``batch``: a pytree whose leaves have the global batch as leading dimension, split over
    all ``R*S`` devices (``PartitionSpec(("replica", "shard"))``), as for the train step.
    ``metrics["loss"]``: float32 scalar, replicated: the mean over devices of ``fn``'s
    per-device scalar (each device's batch slice has the same size, so this is the global
    mean of a per-example mean loss); when ``fn`` returns ``zshard.TokenMean(sum, count)``
    it is ``sum(sum) / sum(count)`` over devices (the token-weighted mean) and
    ``metrics["tokens"]`` is the global count; when ``fn`` returns a dict of scalars, each
    is the mean over devices. The state is not donated and not changed. The jit, ``lower``,
    ``trace`` and the checks are the program shell (:class:`zshard.programs.program.ShardedProgram`).

    Raises:
      ValueError: a batch leaf is a scalar or its leading dimension does not divide by the
        device count (before any compile); a dict result without ``"loss"``; ``fn`` using a
        block unit's raw shard as a value, e.g. ``jax.tree.leaves(nnx.state(model))``, or a
        unit under device-dependent control flow (named, before compiling;
        :func:`zshard.inspection.checks.check_traced`).
      TypeError: ``fn`` returned a tuple or a non-scalar.
    """

    factory = "zshard.make_eval_step"
    donated_error = "this state was donated to a train step (its buffers are deleted); evaluate the state that step returned"

    fn = property(lambda self: self.config.fn)
    prefetch = property(lambda self: self.config.prefetch)
    grad_accum = property(lambda self: 1)

    def _eval(self, state: ShardedState, batch):
        """The body: ``(state, batch) -> (metrics, TraceInfo)`` (the jitted program, ``jit__eval``, returns the metrics)."""
        plan, config = state.plan, self.config
        split = sequence_split(plan, batch, config.sequence_axis)

        def local(params, variables, batch):
            out, info = _forward(state, params, variables, config.fn, batch, prefetch=config.prefetch, split=split)
            return _reduce(plan, out), info

        specs = state.specs()
        in_specs = (specs.params, specs.variables, batch_specs(plan, batch, config.sequence_axis))
        return run_sharded(plan, local, (gather_source(state), state.variables, batch), in_specs, P())

    _program = _eval

    def _place(self, state: ShardedState, batch):
        return self.put_batch(state, batch)

    def put_batch(self, state: ShardedState, batch):
        """:func:`zshard.programs.batch.put_batch` (one micro-batch, this step's sequence axes)."""
        return put_batch(state.plan, batch, sequence_axis=self.config.sequence_axis)


def make_eval_step(fn: Callable[[nnx.Module, Any], Any], *, prefetch: int | None = None, sequence_axis=None) -> EvalStep:
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
        :func:`zshard.programs.step_config.default_prefetch` (0 on CPU, 1 on GPU/TPU). Temporary memory: about
        ``2 + prefetch`` gathered units plus activations (the unit in use is held as its
        all-gather outputs, ``[n_pad]`` per parameter, and as its parameters in their shapes; a
        prefetched one only as its all-gather outputs until it is needed): measured 3.39 blocks with ``1``, 2.4 with ``0``
        (8 blocks of 1.05 MB, FULL_SHARD 1x8, tests/test_evaluate.py).
      sequence_axis: as for :func:`zshard.make_train_step`: each sequence split over ``context``
        in the head-tail order (``zshard.positions``, ``zshard.attention``); the loss is the
        single-device loss of the whole batch.

    Returns:
      :class:`EvalStep`; ``eval(state, batch)["loss"]`` is the global loss (float32).
      Per call and device: one all-gather per unit (the root unit's stays for the call),
      no reduce-scatter.

    Raises:
      TypeError: ``fn`` not callable. ValueError: ``prefetch`` negative.
    """
    if not callable(fn):
        raise TypeError(f"make_eval_step: fn must be a callable fn(model, batch), got {type(fn).__name__}")
    return EvalStep(StepConfig(fn, prefetch=prefetch, sequence_axis=sequence_axis))


def _gathered_model(plan, params: dict, variables: dict, comm) -> nnx.Module:
    """Inside ``shard_map``: the plain model with every parameter all-gathered whole (in the
    gather dtype), no unit interception: each parameter ``[n_pad/N] -> [n_pad] -> shape``."""
    flat = traverse_util.flatten_dict(params)
    var_flat = traverse_util.flatten_dict(variables) if variables else {}
    recs = list(plan.layouts.values())
    values = dict(zip(plan.layouts, gather_params(recs, [flat[r.path] for r in recs], comm)))
    values.update(var_flat)
    with nnx.use_eager_sharding(False):
        pairs = [(p, v.replace(values[p])) for p, v in plan.template + plan.var_template]
        return nnx.merge(plan.graphdef, nnx.from_flat_state(pairs))


class Forward(ShardedProgram):
    """``fwd(state, *args) -> outputs``: ``fn(model, *local_args)`` on the sharded model, per device.

    Built by :func:`make_forward`; the jit and ``lower`` are the program shell
    (:class:`zshard.programs.program.ShardedProgram`) with the arguments as one tuple. The state is not
    donated and not changed. Unlike the train and eval steps, the traced ``fn`` is not checked
    for raw shard reads (``gather_once=True`` gives it a plain model).
    """

    factory = "zshard.make_forward"
    check_trace = False

    def __init__(self, config: StepConfig, gather_once: bool):
        self.gather_once = bool(gather_once)
        super().__init__(config)

    def _run(self, state: ShardedState, args):
        """The body: ``(state, args) -> (outputs, TraceInfo)`` (the jitted program, ``jit__run``, returns the outputs)."""
        plan, config, gather_once = state.plan, self.config, self.gather_once
        rows = P(plan.data_axes)  # on a context mesh the rows are split over context too: whole sequences per device
        arg_specs = jax.tree.map(lambda x: rows if np.ndim(x) else P(), args)

        def local(params, variables, args):
            if gather_once:
                with body_tracing(plan, None) as record:
                    model = _gathered_model(plan, params, variables, config.comm(plan, differentiated=False))
                    model.eval()
                    with jax.named_scope(LOSS_SCOPE):
                        out = config.fn(model, *args)
                info = TraceInfo.of(record)
            else:
                out, info = _forward(state, params, variables, config.fn, *args, prefetch=config.prefetch)
            for path, leaf in jax.tree_util.tree_leaves_with_path(out):
                if not np.ndim(leaf):
                    raise TypeError(
                        f"make_forward: fn returned a scalar at {jax.tree_util.keystr(path) or 'its result'}; every output "
                        "leaf needs a leading row dimension (this device's rows); for a loss reduced over devices use "
                        "zshard.make_eval_step"
                    )
            return out, info

        specs = state.specs()
        return run_sharded(plan, local, (gather_source(state), state.variables, args), (specs.params, specs.variables, arg_specs), rows)

    _program = _run

    def _place(self, state: ShardedState, args: tuple):
        return self.put_args(state, args)

    def put_args(self, state: ShardedState, args: tuple):
        """Each rank >= 1 array split along its leading dimension over the data axes
        (:func:`zshard.programs.batch.put_args`: :func:`zshard.programs.batch.put_batch`, every leaf on its own), 0-d
        ones replicated."""
        return put_args(state.plan, args)

    def __call__(self, state: ShardedState, *args):
        return super().__call__(state, args)

    def lower(self, state: ShardedState, *args) -> jax.stages.Lowered:
        """The lowered program (``.compile().memory_analysis()``, ``.compile().as_text()``)."""
        return super().lower(state, args)


def make_forward(fn: Callable, *, gather_once: bool = False, prefetch: int | None = None) -> Forward:
    """Build a sharded forward-only function: ``fwd(state, *args)`` runs ``fn(model, *local_args)``.

    Args:
      fn: ``fn(model, *args) -> pytree of arrays``, written for one device and an ordinary
        model (in evaluation mode, ``model.eval()``). It gets this device's slice of every
        argument: array arguments of rank >= 1 are split along their leading dimension over
        the data axes ``("replica", "shard"[, "context"])`` (``PartitionSpec(("replica",
        "shard"))``; the leading dimension must divide by ``R*S*C``), 0-d arguments are
        replicated. On a ``context`` mesh the rows are split over the context devices too and
        each device runs whole sequences (no sequence split: ``zshard.attention`` is plain
        attention there; docs/long-sequences.md, "Evaluation and generation"). Every output
        leaf must have a leading row dimension: the results come back as global arrays split
        the same way (this device's rows joined over devices).
      gather_once: ``False`` (default): each unit is all-gathered just before it runs and
        dropped after it, as in the eval step (memory of a sharded model: ``Psi/N`` plus about
        ``2 + prefetch`` gathered units). ``True``: every parameter is all-gathered whole once
        per call and ``fn`` runs on the plain model (memory of the whole model per device, no
        communication inside ``fn``): for a decoding loop inside ``fn`` (``lax.fori_loop``
        over tokens), the gathers are paid once per call instead of once per token.
      prefetch: units gathered ahead (``gather_once=False``), as for :func:`make_eval_step`.

    Returns:
      :class:`Forward`.

    Raises:
      TypeError: ``fn`` not callable; (when traced) an output leaf without a row dimension.
      ValueError: ``prefetch`` negative; an argument whose leading dimension does not divide by
        the devices (named, before compiling).
    """
    if not callable(fn):
        raise TypeError(f"make_forward: fn must be a callable fn(model, *args), got {type(fn).__name__}")
    return Forward(StepConfig(fn, prefetch=prefetch), gather_once)
