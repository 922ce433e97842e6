"""The static configuration of a train or eval step, validated once, and the batch placement
both steps share.

:class:`StepConfig` is frozen and hashable by value: the traced step body receives it (and the
plan), never the mutable step object, so two steps with equal options trace the same program.
:func:`put_batch` is the one place a batch is checked and split over the mesh (rows over the
batch axes, sequences over ``context`` in the head-tail order: :mod:`zshard.sequence`), and
:func:`batch_specs` the PartitionSpecs the step's ``shard_map`` takes it with.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.gpu import platform
from zshard.wire.hpz import check_hpz
from zshard.mesh.axes import AXES, CONTEXT
from zshard.context.sequence import SequenceSplit, head_tail_order
from zshard.mesh.strategy import ReplicaReduce
from zshard.programs.unit_call import remat_policy
from zshard.wire.wire import UnitComm

__all__ = ["SequenceAxes", "StepConfig", "batch_specs", "default_prefetch", "put_batch", "sequence_axes", "sequence_split",
           "trace_key"]


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


@dataclasses.dataclass(frozen=True)
class SequenceAxes:
    """``sequence_axis=`` as given: one axis for every leaf (``tree is None``), or a pytree (a
    prefix of the batch's) of axes with ``None`` for leaves without a sequence dimension, kept
    as its structure and leaves so that the frozen :class:`StepConfig` stays hashable."""

    axis: int | None = None
    tree: Any = None  # treedef of the pytree form
    leaves: tuple = ()

    @classmethod
    def of(cls, value) -> "SequenceAxes | None":
        if value is None or isinstance(value, SequenceAxes):
            return value
        def check(a):
            if a is not None and (isinstance(a, bool) or not isinstance(a, numbers.Integral) or a == 0):
                raise ValueError(f"sequence_axis={value!r}: each entry must be a non-zero int (dimension 0 is the batch; "
                                 "negative counts from the end) or None (the leaf has no sequence dimension)")
            return None if a is None else int(a)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return cls(axis=check(value))
        leaves, tree = jax.tree.flatten(value, is_leaf=lambda x: x is None)
        return cls(tree=tree, leaves=tuple(check(a) for a in leaves))

    def per_leaf(self, batch) -> list:
        """The axis of each leaf of ``batch`` (``jax.tree.leaves`` order), ``None`` where it has none."""
        n = len(jax.tree.leaves(batch))
        if self.tree is None:
            return [self.axis] * n
        prefix = jax.tree.unflatten(self.tree, self.leaves)
        try:
            return [a for a, sub in zip(self.leaves, self.tree.flatten_up_to(batch)) for _ in jax.tree.leaves(sub)]
        except (ValueError, TypeError) as e:
            raise ValueError(f"sequence_axis={prefix!r} is not a prefix of the batch's structure "
                             f"{jax.tree.structure(batch)}: give one axis per leaf (None: no sequence dimension) ({e})") from None


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
      hpz: ZeRO++ hierarchical partitioning (zshard/hpz.py): each unit's forward keeps its
        ``[n_pad/S]`` slice of the gathered weights and backward re-gathers it over ``shard`` only.
        Checked against the plan when the step is traced (:func:`zshard.hpz.check_hpz`).

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
        :class:`~zshard.strategy.ReplicaReduce` decision of the step, resolved here."""
        reduce = ReplicaReduce.resolve(plan.strategy, self.grad_accum, differentiated=differentiated)
        comm = UnitComm.of(plan, reduce, self.remat)
        if not (self.hpz and differentiated):  # a forward-only step has no backward re-gather
            return comm
        check_hpz(plan)  # before compiling: named, with the fix
        return dataclasses.replace(comm, hpz=True)


def trace_key(state, batch) -> tuple:
    """What a traced step depends on: the plan and the batch's shapes, dtypes and structure
    (the train and eval steps check each traced program once per key)."""
    return state.plan, tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(batch)), jax.tree.structure(batch)


def sequence_axes(plan, batch, sequence_axis) -> list:
    """``[(path, leaf, axis or None)]`` of ``batch`` (axes non-negative), checked.

    Raises:
      ValueError: a leaf that lacks the ``sequence_axis`` it is given (named, with its shape and
        the fix), sequence leaves of different lengths, or a length that does not divide by
        ``2 * C`` on a mesh with a ``context`` axis of ``C`` devices (the head-tail order cuts each
        sequence into ``2C`` chunks).
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    axes = SequenceAxes.of(sequence_axis)
    per = [None] * len(leaves) if axes is None else axes.per_leaf(batch)
    out, lengths = [], {}
    C = plan.axes.context
    for (path, x), axis in zip(leaves, per):
        name, shape = f"batch{jax.tree_util.keystr(path)}", np.shape(x)
        if axis is not None:
            if not -len(shape) <= axis < len(shape) or axis % len(shape) == 0:
                raise ValueError(
                    f"{name} has shape {shape} and no sequence axis {axis} (sequence_axis={axis}; dimension 0 is the batch): "
                    "give sequence_axis as a pytree with None for the leaves without a sequence dimension, e.g. "
                    "sequence_axis={'tokens': 1, 'weights': None}"
                )
            axis %= len(shape)
            lengths[name] = shape[axis]
        out.append((path, x, axis))
    if len(set(lengths.values())) > 1:
        raise ValueError(f"the sequence leaves have different lengths {lengths}: every leaf with a sequence axis must hold "
                         "the same sequences (tokens, targets, segment ids, positions)")
    for name, L in lengths.items():
        if C > 1 and L % (2 * C):
            raise ValueError(
                f"{name}: sequence length {L} does not divide by 2 x context = {2 * C}: the head-tail order gives each of "
                f"the {C} context devices two of 2C equal chunks (zshard.sequence); pad the sequences to a multiple of "
                f"{2 * C} or use another context size"
            )
        break
    return out


def sequence_split(plan, batch, sequence_axis) -> SequenceSplit | None:
    """The :class:`~zshard.sequence.SequenceSplit` of a step on ``batch`` (global shapes), or
    ``None`` when no leaf has a sequence axis."""
    lengths = [np.shape(x)[a] for _, x, a in sequence_axes(plan, batch, sequence_axis) if a is not None]
    return SequenceSplit(plan.axes.context, lengths[0]) if lengths else None


def _leaf_spec(plan, ndim: int, axis, split: bool) -> P:
    if not split:  # no sequence axis in this step: rows over every data axis
        return P(plan.data_axes)
    if axis is None or not plan.axes.context_enabled:
        return P(AXES)  # rows over (replica, shard); the same on every context device
    return P(AXES, *([None] * (axis - 1)), CONTEXT)  # [B, ..., L, ...]: rows over (replica, shard), L over context


def batch_specs(plan, batch, sequence_axis=None):
    """The PartitionSpec of every leaf of ``batch`` (a pytree like it): without a sequence axis
    ``PartitionSpec(("replica", "shard"[, "context"]))`` (rows over every data axis); with one,
    ``PartitionSpec(("replica", "shard"), None.., "context")`` for a leaf whose sequence is at that
    axis and ``PartitionSpec(("replica", "shard"))`` for a leaf without one."""
    placed = sequence_axes(plan, batch, sequence_axis)
    split = any(a is not None for _, _, a in placed)
    specs = [_leaf_spec(plan, np.ndim(x), a, split) for _, x, a in placed]
    return jax.tree.unflatten(jax.tree.structure(batch), specs)


def put_batch(plan, batch, grad_accum: int = 1, sequence_axis=None):
    """Validate ``batch`` and place it: rows (leading dimension) over the data axes, sequences over
    ``context``.

    The leading dimension of every leaf is the global batch. Without ``sequence_axis`` it must
    divide by ``R*S*C*grad_accum`` (devices x micro-batches; ``C = 1`` without a ``context`` axis):
    the rows are split over every data axis. With ``sequence_axis`` (an int for every leaf, or a
    pytree with ``None`` for the leaves without a sequence dimension) the rows divide by
    ``R*S*grad_accum`` and are split over ``(replica, shard)``; each sequence leaf is permuted into
    the head-tail order (:func:`zshard.sequence.head_tail_order`) and split over ``context``,
    each leaf without one is the same on every context device. With several processes
    (``jax.process_count() > 1``) each process passes only its own rows: its contiguous slice
    ``[i*B/P, (i+1)*B/P)`` of the global batch of ``B`` rows, whole sequences
    (``jax.make_array_from_process_local_data``); a global ``jax.Array`` passes as is.
    ``jax.ShapeDtypeStruct`` leaves get the sharding (for ``lower``).

    Returns:
      The batch, every leaf with ``NamedSharding(mesh, spec)`` (:func:`batch_specs`).

    Raises:
      ValueError: an empty batch, a scalar leaf, leaves of different leading dimensions, or a
        leading dimension that does not divide by the devices (x micro-batches), each named by
        its path (``batch[...]``) with the sizes, before any compile; the sequence errors of
        :func:`sequence_axes`.
    """
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
    placed = sequence_axes(plan, batch, sequence_axis)
    split = any(a is not None for _, _, a in placed)
    rows = plan.axes.rows if split else plan.world
    world = rows * grad_accum  # the rows split into devices x micro-batches
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
            over = " (replica x shard: the sequences are split over context)" if split and rows != plan.world else ""
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} has shape {shape}{where}: its leading (batch) dimension "
                f"must divide by the {rows} devices{over} of the mesh {dict(plan.mesh.shape)}{micro}; "
                f"use a global batch that is a multiple of {world}"
            )
    C = plan.axes.context

    def place(x, axis):
        sharding = NamedSharding(plan.mesh, _leaf_spec(plan, np.ndim(x), axis, split))
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if axis is not None and C > 1:  # [.., L, ..] -> the head-tail order, device i's chunks (i, 2C-1-i) adjacent
            order = head_tail_order(np.shape(x)[axis], C)
            x = np.take(np.asarray(x), order, axis=axis) if isinstance(x, np.ndarray) or not hasattr(x, "sharding") \
                else jax.numpy.take(x, order, axis=axis)
        if process_local(x):
            return jax.make_array_from_process_local_data(sharding, np.asarray(x), shape_of(x))
        return jax.device_put(x, sharding)

    out = [place(x, a) for _, x, a in placed]
    return jax.tree.unflatten(jax.tree.structure(batch), out)
