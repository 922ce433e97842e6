"""Parameters in and out of the shards one tensor at a time: ``init(..., params=weights)``
and :func:`fetch_params`.

``weights`` maps each dotted parameter path (``"blocks.0.attn.qkv.kernel"``, the names of
zshard checkpoints, :func:`zshard.params.units.path_str`) to a zero-argument callable that returns
the parameter in its logical shape (numpy or jax array). Each callable is called once; its
array is put in its stored form (:meth:`zshard.params.flat.ParamLayout.to_storage`: ``[n_pad]``,
``[L, n_pad]`` for stacked layers) and each device's piece is copied straight to it
(``jax.make_array_from_callback``), so host memory holds about one tensor at a time.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.optim.offload import to_device
from zshard.params.flat import ParamLayout
from zshard.params.units import path_str

__all__ = ["auto_axes", "check_weights", "fetch_params", "logical_replicated", "place_weights"]


def _declared_shape(fn) -> tuple | None:
    shape = getattr(fn, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def check_weights(layouts: Sequence[ParamLayout], weights: Mapping[str, Callable]) -> None:
    """Names and (where the callable declares ``.shape``) shapes against the model, before any read.

    Args:
      layouts: the model's parameter records (``Plan.layouts.values()``).
      weights: dotted path -> zero-argument callable.

    Raises:
      TypeError: ``weights`` is not a mapping of callables.
      ValueError: every missing, extra or misshapen tensor, one per line, with both shapes.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"params= must be a mapping from dotted parameter path to a zero-argument callable, got {type(weights).__name__}")
    want = {path_str(rec.path): rec.logical_shape for rec in layouts}
    problems = []
    for name, fn in weights.items():
        if not callable(fn):
            problems.append(f"  {name}: {type(fn).__name__} is not callable (give a zero-argument function returning the array)")
        elif name not in want:
            problems.append(f"  {name}: extra tensor {_declared_shape(fn) or ''}, the model has no such parameter")
        elif _declared_shape(fn) is not None and _declared_shape(fn) != want[name]:
            problems.append(f"  {name}: weights give shape {_declared_shape(fn)}, the model's parameter is {want[name]}")
    problems += [f"  {name}: missing, the model's parameter is {shape}" for name, shape in want.items() if name not in weights]
    if problems:
        raise ValueError(
            f"zshard.init(params=...): the weights do not match the model; {len(problems)} difference(s):\n"
            + "\n".join(problems[:30]) + "\nnothing was placed; fix the mapping (names are dotted paths as in zshard checkpoints)"
        )


def place_weights(layouts: Sequence[ParamLayout], weights: Mapping[str, Callable], shardings) -> list[jax.Array]:
    """Read each tensor once and write it into its shards.

    Args:
      layouts: the parameter records, the order of the returned arrays.
      weights: checked by :func:`check_weights`.
      shardings: one ``NamedSharding`` per record (its ``spec``).

    Returns:
      The stored parameters ``[n_pad]`` / ``[L, n_pad]``, in the parameters' dtypes.

    Raises:
      ValueError: a callable returned an array of another shape than the parameter's (named
        with both shapes; raised before that tensor is placed).
    """
    out = []
    for rec, sharding in zip(layouts, shardings):
        name = path_str(rec.path)
        value = np.asarray(weights[name]())
        if tuple(value.shape) != rec.logical_shape:
            raise ValueError(f"zshard.init(params=...): {name} returned shape {tuple(value.shape)}, the model's parameter is {rec.logical_shape}")
        stored = rec.to_storage(value.astype(rec.dtype, copy=False))  # shape -> [n_pad] / [L, n_pad]
        out.append(jax.make_array_from_callback(stored.shape, sharding, lambda index, a=stored: a[index]))
        del value, stored  # one tensor on the host at a time
    return out


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices with ``Auto`` axes: the unpadding programs slice dimensions that do
    not divide by the axis size, which Explicit axes refuse; the partitioner moves the data."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _logical_replicated(x, layout: ParamLayout, mesh: Mesh):
    # a master in pinned host memory (offload) comes to the device inside the program, as the checkpoint's unpadding
    # does (zshard/checkpoint/layout.py): jax 0.12 refuses to device_put a host array a program wrote ("Unsupported layout")
    x = to_device(x)
    # [.., n_pad/N] --all_gather(shard)--> [.., n_pad] -> [.., n] -> shape (collectives inserted by the partitioner)
    return jax.lax.with_sharding_constraint(layout.from_storage(x.reshape(layout.storage_shape)), NamedSharding(mesh, P()))


def logical_replicated(x: jax.Array, layout: ParamLayout, mesh: Mesh) -> jax.Array:
    """A stored array of ``layout``'s size (``[n_pad]`` / ``[L, n_pad]``, or an optimizer view
    of it) on ``mesh`` (Auto axes, :func:`auto_axes`) -> the logical array, replicated.
    Compiled once per storage format (:meth:`ParamLayout.format_key`), not per parameter."""
    return _logical_replicated(x, layout.format_key(), mesh)


def fetch_params(state) -> Iterator[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]]:
    """``(dotted path, logical shape, dtype, fetch)`` per parameter of a :class:`ShardedState`.

    ``fetch()`` gathers that one parameter (``[n_pad]`` shards --all_gather--> logical shape,
    replicated) and returns it as a numpy array: host memory holds one parameter at a time.
    Every process must call each ``fetch`` (the gather is a collective program).
    """
    plan = state.plan
    flat = traverse_util.flatten_dict(state.params)
    mesh = auto_axes(plan.mesh)  # Auto axes: the unpadding slices sizes that do not divide
    for path, rec in plan.layouts.items():

        def fetch(path=path, rec=rec):
            x = flat[path]
            x = jax.device_put(x, NamedSharding(mesh, x.sharding.spec, memory_kind=x.sharding.memory_kind))  # same pieces, Auto axes
            return np.asarray(logical_replicated(x, rec, mesh).addressable_data(0))

        yield path_str(path), rec.logical_shape, rec.dtype, fetch
