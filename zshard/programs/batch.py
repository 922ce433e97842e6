"""Batch placement: the one place a batch is checked and split over the mesh, for every program.

:func:`put_batch` checks a batch before anything compiles (leading dimensions, sequence axes,
each leaf named by its path) and places it: rows (the leading dimension) over the data axes, or
rows over ``(replica, shard)`` and each sequence over ``context`` in the head-tail order
(:mod:`zshard.context.sequence`). :func:`batch_specs` gives the PartitionSpecs a program's ``shard_map``
takes the batch with, :func:`sequence_split` the :class:`~zshard.context.sequence.SequenceSplit` its body
traces under, :func:`put_args` the placement of :func:`zshard.make_forward`'s arguments (each
array on its own), :func:`trace_key` what a traced program depends on. :class:`SequenceAxes` is
``sequence_axis=`` as a hashable value. The axes' sizes come from the plan's
:class:`~zshard.mesh.axes.MeshAxes`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.mesh.axes import AXES, CONTEXT
from zshard.context.sequence import SequenceSplit, head_tail_order

__all__ = ["SequenceAxes", "batch_specs", "put_args", "put_batch", "sequence_axes", "sequence_split", "trace_key"]


@dataclasses.dataclass(frozen=True)
class SequenceAxes:
    """``sequence_axis=`` as given: one axis for every leaf (``tree is None``), or a pytree (a
    prefix of the batch's) of axes with ``None`` for leaves without a sequence dimension, kept
    as its structure and leaves so that the frozen :class:`~zshard.programs.step_config.StepConfig` stays hashable."""

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



def trace_key(state, batch) -> tuple:
    """What a traced program depends on besides its options: the plan and the batch's shapes,
    dtypes and structure (each program checks its traced body once per key)."""
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
                f"the {C} context devices two of 2C equal chunks (zshard.context.sequence); pad the sequences to a multiple of "
                f"{2 * C} or use another context size"
            )
        break
    return out


def sequence_split(plan, batch, sequence_axis) -> SequenceSplit | None:
    """The :class:`~zshard.context.sequence.SequenceSplit` of a step on ``batch`` (global shapes), or
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
    the head-tail order (:func:`zshard.context.sequence.head_tail_order`) and split over ``context``,
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
                else jnp.take(x, order, axis=axis)
        if process_local(x):
            return jax.make_array_from_process_local_data(sharding, np.asarray(x), shape_of(x))
        return jax.device_put(x, sharding)

    out = [place(x, a) for _, x, a in placed]
    return jax.tree.unflatten(jax.tree.structure(batch), out)


def put_args(plan, args: tuple, who: str = "make_forward") -> tuple:
    """:func:`zshard.make_forward`'s arguments placed: each array of rank >= 1 split along its
    leading dimension over every data axis on its own (:func:`put_batch`, one leaf at a time, so
    the arguments may have different leading dimensions), each 0-d one replicated
    (``PartitionSpec()``). ``jax.ShapeDtypeStruct`` leaves get the sharding (for ``lower``).

    Raises:
      ValueError: an argument whose leading dimension does not divide by the devices, named
        ``args[i]...`` (the error of :func:`put_batch`), before any compile.
    """
    replicated = NamedSharding(plan.mesh, P())

    def place(path, x):
        if not np.ndim(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((), x.dtype, sharding=replicated)
            return jax.device_put(jnp.asarray(x), replicated)
        try:
            return put_batch(plan, x)
        except ValueError as e:
            raise ValueError(f"{who}: argument args{jax.tree_util.keystr(path)}: {e}") from None

    return jax.tree_util.tree_map_with_path(place, tuple(args))
