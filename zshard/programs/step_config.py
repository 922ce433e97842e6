"""The static configuration of a program (train step, eval step, forward), validated once.

:class:`StepConfig` is frozen and hashable by value: the traced body receives it (and the plan),
never the mutable program object, so two programs with equal options trace the same program.
The batch placement that used to live here is :mod:`zshard.programs.batch` (``put_batch``,
``batch_specs``, ``sequence_axes``, ``sequence_split``, ``SequenceAxes``, ``trace_key``); their
names here are aliases of those, kept for one release.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import numpy as np

from zshard.programs.batch import (  # noqa: F401  (the old names of the batch placement: aliases, kept for one release)
    SequenceAxes, batch_specs, put_batch, sequence_axes, sequence_split, trace_key,
)
from zshard.gpu import platform
from zshard.wire.hpz import check_hpz
from zshard.mesh.strategy import ReplicaReduce
from zshard.programs.unit_call import remat_policy
from zshard.wire.wire import UnitComm

__all__ = ["StepConfig", "default_prefetch"]


def default_prefetch(backend: str | None = None, *, mesh=None) -> int:
    """The ``prefetch`` of a step built without one: ``0`` on CPU, ``1`` elsewhere.

    XLA:CPU runs collectives synchronously, so a prefetched gather overlaps nothing and only
    holds one more gathered unit (``python -m train.bench``, config S on 8 emulated CPU
    devices: temp 16.9 MiB without, 19.9 MiB with; step time 2073 vs 2082 ms, median of 10
    rounds; config P: 2.35 vs 3.22 gathered units; docs/benchmarks.md). On GPU / TPU the
    latency-hiding scheduler overlaps the early gather with the previous unit's compute (FSDP's
    default ``BACKWARD_PRE`` / ``forward_prefetch``). The platform is ``backend``, else that of
    ``mesh``'s devices (a step's plan: a mesh of GPUs compiled on a CPU host gets 1), else the
    process's default backend (:func:`zshard.gpu.platform`).
    """
    return 0 if (backend or platform(mesh)) == "cpu" else 1


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
      sequence_axis: the batch's sequence dimension (:class:`SequenceAxes`), or ``None``: no
        leaf is split along its sequence (on a ``context`` mesh the rows are then split over the
        context devices too).
      hpz: ZeRO++ hierarchical partitioning (zshard/wire/hpz.py): each unit's forward keeps its
        ``[n_pad/S]`` slice of the gathered weights and backward re-gathers it over ``shard`` only.
        Checked against the plan when the step is traced (:func:`zshard.wire.hpz.check_hpz`).

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
    sequence_axis: Any = None
    hpz: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"the step's function must be a callable fn(model, batch), got {type(self.fn).__name__}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen: validated values only)
        set_("remat", remat_policy(self.remat))
        set_("has_aux", bool(self.has_aux))
        if not isinstance(self.hpz, bool):
            raise TypeError(f"hpz={self.hpz!r}: must be True or False (ZeRO++ hierarchical partitioning of the backward gather)")
        set_("skip_nonfinite", bool(self.skip_nonfinite))
        set_("grad_accum", _positive_int("grad_accum", self.grad_accum, "micro-batches per step"))
        p = self.prefetch
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 0):
            raise ValueError(f"prefetch={p!r}: must be a non-negative integer (units gathered ahead; 0 turns prefetch off), "
                             "or None for the backend's default")
        set_("prefetch", None if p is None else int(p))
        set_("sequence_axis", SequenceAxes.of(self.sequence_axis))
        c = self.clip_norm
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not c > 0 or not np.isfinite(c)):
            raise ValueError(f"clip_norm={c!r}: must be a positive finite number (or None for no clipping)")

    def resolved_prefetch(self, mesh=None) -> int:
        """``prefetch``, or :func:`default_prefetch` of ``mesh``'s platform when it is ``None``."""
        return default_prefetch(mesh=mesh) if self.prefetch is None else self.prefetch

    def comm(self, plan, *, differentiated: bool = True) -> UnitComm:
        """The units' :class:`~zshard.wire.UnitComm` for this step on ``plan``: the one
        :class:`~zshard.mesh.strategy.ReplicaReduce` decision of the step, resolved here."""
        reduce = ReplicaReduce.resolve(plan.strategy, self.grad_accum, differentiated=differentiated)
        comm = UnitComm.of(plan, reduce, self.remat)
        if not (self.hpz and differentiated):  # a forward-only step has no backward re-gather
            return comm
        check_hpz(plan)  # before compiling: named, with the fix
        return dataclasses.replace(comm, hpz=True)

