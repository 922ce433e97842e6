"""The static configuration of a train or eval step, validated once, and the batch placement
both steps share.

:class:`StepConfig` is frozen and hashable by value: the traced step body receives it (and the
plan), never the mutable step object, so two steps with equal options trace the same program.
:func:`put_batch` is the one place a batch is checked and split over the mesh.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.collectives import UnitComm
from zshard.mesh import AXES
from zshard.strategy import ReplicaReduce
from zshard.unit_call import remat_policy

__all__ = ["StepConfig", "default_prefetch", "put_batch", "trace_key"]


def default_prefetch(backend: str | None = None) -> int:
    """The ``prefetch`` of a step built without one: ``0`` on CPU, ``1`` elsewhere.

    XLA:CPU runs collectives synchronously, so a prefetched gather overlaps nothing and only
    holds one more gathered unit (``python -m train.bench``, config S on 8 emulated CPU
    devices: temp 16.9 MiB without, 19.9 MiB with; step time 2073 vs 2082 ms, median of 10
    rounds; config P: 2.35 vs 3.22 gathered units; docs/benchmarks.md). On GPU / TPU the
    latency-hiding scheduler overlaps the early gather with the previous unit's compute (FSDP's
    default ``BACKWARD_PRE`` / ``forward_prefetch``). ``backend``: default ``jax.default_backend()``.
    """
    return 0 if (backend or jax.default_backend()) == "cpu" else 1


def _positive_int(name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer ({what})")
    return int(value)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything a step's traced body needs besides the plan (see ``make_train_step``).

    Attributes:
      fn: ``loss_fn(model, batch)`` (train step) or the eval ``fn(model, batch)``.
      has_aux: ``fn`` returns ``(loss, aux)``.
      grad_accum: micro-batches per step (gradient accumulation).
      clip_norm: global-norm clipping threshold, or ``None``.
      skip_nonfinite: keep the previous state on a NaN / inf step.
      remat: activation checkpointing inside block units (``"block"``, ``"none"``, ``"dots"`` or
        a ``jax.checkpoint`` policy).
      prefetch: units gathered ahead, or ``None`` for the backend's :func:`default_prefetch`
        (resolved when the step is traced, so that building a step starts no JAX backend).

    Raises:
      ValueError: ``grad_accum`` not a positive integer, ``clip_norm`` not positive and finite,
        ``remat`` not a known policy, ``prefetch`` negative or not an integer.
      TypeError: ``fn`` not callable.
    """

    fn: Callable
    has_aux: bool = False
    grad_accum: int = 1
    clip_norm: float | None = None
    skip_nonfinite: bool = False
    remat: Any = "block"
    prefetch: int | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"the step's function must be a callable fn(model, batch), got {type(self.fn).__name__}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen: validated values only)
        set_("remat", remat_policy(self.remat))
        set_("has_aux", bool(self.has_aux))
        set_("skip_nonfinite", bool(self.skip_nonfinite))
        set_("grad_accum", _positive_int("grad_accum", self.grad_accum, "micro-batches per step"))
        p = self.prefetch
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 0):
            raise ValueError(f"prefetch={p!r}: must be a non-negative integer (units gathered ahead; 0 turns prefetch off), "
                             "or None for the backend's default")
        set_("prefetch", None if p is None else int(p))
        c = self.clip_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not c > 0 or not np.isfinite(c)):
            raise ValueError(f"clip_norm={c!r}: must be a positive finite number (or None for no clipping)")

    def resolved_prefetch(self) -> int:
        """``prefetch``, or the backend's default when it is ``None``."""
        return default_prefetch() if self.prefetch is None else self.prefetch

    def comm(self, plan, *, differentiated: bool = True) -> UnitComm:
        """The units' :class:`~zshard.collectives.UnitComm` for this step on ``plan``: the one
        :class:`~zshard.strategy.ReplicaReduce` decision of the step, resolved here."""
        reduce = ReplicaReduce.resolve(plan.strategy, self.grad_accum, differentiated=differentiated)
        return UnitComm.of(plan, reduce, self.remat)


def trace_key(state, batch) -> tuple:
    """What a traced step depends on: the plan and the batch's shapes, dtypes and structure
    (the train and eval steps check each traced program once per key)."""
    return state.plan, tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(batch)), jax.tree.structure(batch)


def put_batch(plan, batch, grad_accum: int = 1):
    """Validate ``batch`` and place it with its leading dimension split over all devices.

    The leading dimension of every leaf is the global batch; it must divide by
    ``R*S*grad_accum`` (devices x micro-batches). With several processes
    (``jax.process_count() > 1``) each process passes only its own rows: its contiguous slice
    ``[i*B/P, (i+1)*B/P)`` of the global batch of ``B`` rows
    (``jax.make_array_from_process_local_data``); a global ``jax.Array`` passes as is.
    ``jax.ShapeDtypeStruct`` leaves get the sharding (for ``lower``).

    Returns:
      The batch, every leaf with ``NamedSharding(mesh, PartitionSpec(("replica", "shard")))``.

    Raises:
      ValueError: an empty batch, a scalar leaf, leaves of different leading dimensions, or a
        leading dimension that does not divide by the devices (x micro-batches), each named by
        its path (``batch[...]``) with the sizes, before any compile.
    """
    world = plan.world * grad_accum  # the batch splits into devices x micro-batches
    sharding = NamedSharding(plan.mesh, P(AXES))
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
            micro = f" x grad_accum={grad_accum} micro-batches" if grad_accum > 1 else ""
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has shape {shape}{where}: its leading (batch) dimension "
                f"must divide by the {plan.world} devices of the mesh {dict(plan.mesh.shape)}{micro}; "
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
