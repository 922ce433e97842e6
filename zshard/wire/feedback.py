"""Error feedback for the quantized gradient reduction: the residuals' state and their way through the step.

With ``reduce_format=zshard.Quant(..., error_feedback=True)`` every device keeps, per trainable
parameter the format quantizes, a residual ``e`` of what quantizing its gradient dropped, adds it
to its next gradient before quantizing, and keeps the new one
(:func:`zshard.wire.quant.reduce_scatter_feedback`: 1-bit SGD, Seide et al. 2014, section 3; EF-SGD,
Karimireddy et al. 2019, arXiv 1901.09847, algorithm 2; LoCo, arXiv 2407.04480, section 3).

[Note: error feedback] The residuals live in ``ShardedState.feedback`` (float32, global
``[..., W * n_pad]``, ``PartitionSpec(..., data_axes)``, local ``[..., n_pad]``:
:func:`zshard.wire.quant.feedback_layout`; which parameters: ``ParamWire.residual``, zshard/wire/wire.py).
Inside the step they are the gradient exit values ([Note: gradient exit], zshard/wire/grad_exit.py;
HYBRID_SHARD_OPT's optimizer slices use the same way out, and error feedback refuses that
strategy): :func:`feedback_exits` gives every trainable parameter an exit value (its residual, or
an ``f32[..., 0]`` placeholder where its wire keeps none); a unit call
(:func:`zshard.programs.unit_call.run_unit`, the root's :func:`zshard.wire.collectives.gather`,
:func:`zshard.wire.collectives.gather_param`) takes them as its ``exits``, keeps them for its backward,
and returns each new residual as the exit value's cotangent, so the step differentiates w.r.t.
them and :func:`new_feedback` keeps the new residuals. Under gradient accumulation the exit
values are carried from one micro-batch to the next (each micro-batch's
reduction adds the residual the previous one left). A parameter whose gradient is reduced twice
in one micro-batch (a unit called twice per forward) would sum two residuals: not supported
(docs/quantized.md). A forward-only pass (evaluation) passes no residuals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import NamedSharding

from zshard.mesh.axes import vary
from zshard.wire.quant import feedback_layout

__all__ = ["feedback_exits", "init_feedback", "new_feedback"]


def init_feedback(plan, abstract: bool = False) -> dict:
    """The error-feedback residuals of ``plan`` (``ShardedState.feedback``): float32 zeros
    ``[..., W * n_pad]`` split over the data axes (abstract: ``jax.ShapeDtypeStruct``); ``{}``
    without ``error_feedback``."""
    layout = feedback_layout(plan)  # path -> (shape [..., W * n_pad], PartitionSpec over the data axes)
    if not layout:
        return {}
    paths = list(layout)
    shardings = [NamedSharding(plan.mesh, layout[p][1]) for p in paths]
    if abstract:
        values = [jax.ShapeDtypeStruct(layout[p][0], jnp.float32, sharding=sh) for p, sh in zip(paths, shardings)]
    else:  # one program for every residual, each device writing only its own zeros
        values = jax.jit(lambda: [jnp.zeros(layout[p][0], jnp.float32) for p in paths], out_shardings=shardings)()
    return traverse_util.unflatten_dict(dict(zip(paths, values)))


def feedback_exits(plan, train: dict, feedback: dict) -> dict:
    """Inside the step: the gradient exit values the units read their residuals from, nested like ``train``:
    each quantized parameter's residual ``f32[..., n_pad]`` (``feedback``, local), an
    ``f32[..., 0]`` placeholder for the others, varying over every data axis."""
    fb = traverse_util.flatten_dict(feedback)
    flat = traverse_util.flatten_dict(train)  # path -> [..., n_pad/N]
    out = {p: fb[p] if p in fb else vary(jnp.zeros(x.shape[:-1] + (0,), jnp.float32), plan.data_axes) for p, x in flat.items()}
    return traverse_util.unflatten_dict(out)


def new_feedback(feedback: dict, exits: dict) -> dict:
    """The exit values' cotangents (the new residuals) of the paths ``feedback`` has; placeholders dropped."""
    flat = traverse_util.flatten_dict(exits)
    return traverse_util.unflatten_dict({p: flat[p] for p in traverse_util.flatten_dict(feedback)})
