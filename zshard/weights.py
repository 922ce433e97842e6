"""Parameters in and out of the shards one tensor at a time: ``init(..., params=weights)``
and :func:`fetch_params`.

``weights`` maps each dotted parameter path (``"blocks.0.attn.qkv.kernel"``, the names of
zshard checkpoints, :func:`zshard.units.path_str`) to a zero-argument callable that returns
the parameter in its logical shape (numpy or jax array). Each callable is called once; its
array is padded and flattened (``[n]`` -> ``[n_pad]``, ``[L, n_pad]`` for stacked layers,
see ``zshard.flat``) and each device's piece is copied straight to it
(``jax.make_array_from_callback``), so host memory holds about one tensor at a time.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.flat import pad_flat
from zshard.units import path_str

__all__ = ["check_weights", "place_weights", "fetch_params"]


def _declared_shape(fn) -> tuple | None:
    shape = getattr(fn, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def check_weights(template, weights: Mapping[str, Callable]) -> None:
    """Names and (where the callable declares ``.shape``) shapes against the model, before any read.

    Args:
      template: ``(path, abstract Variable)`` pairs of the model (``Plan.template``).
      weights: dotted path -> zero-argument callable.

    Raises:
      TypeError: ``weights`` is not a mapping of callables.
      ValueError: every missing, extra or misshapen tensor, one per line, with both shapes.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"params= must be a mapping from dotted parameter path to a zero-argument callable, got {type(weights).__name__}")
    want = {path_str(p): tuple(v.get_value().shape) for p, v in template}
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


def place_weights(template, weights: Mapping[str, Callable], shardings, layers: dict, pad_multiple: int) -> list[jax.Array]:
    """Read each tensor once and write it into its shards.

    Args:
      template: ``(path, abstract Variable)`` pairs, the order of the returned arrays.
      weights: checked by :func:`check_weights`.
      shardings: one ``NamedSharding`` per template entry (``PartitionSpec(shard_axes)``,
        ``PartitionSpec(None, shard_axes)`` for stacked layers).
      layers: path -> ``L`` of a stacked parameter, else ``None``.
      pad_multiple: what each (layer of a) parameter is padded to (``opt_shards``).

    Returns:
      The padded flat parameters ``[n_pad]`` / ``[L, n_pad]``, in the parameters' dtypes.

    Raises:
      ValueError: a callable returned an array of another shape than the parameter's (named
        with both shapes; raised before that tensor is placed).
    """
    out = []
    for (path, var), sharding in zip(template, shardings):
        name, want = path_str(path), var.get_value()
        value = np.asarray(weights[name]())
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(f"zshard.init(params=...): {name} returned shape {tuple(value.shape)}, the model's parameter is {tuple(want.shape)}")
        padded = pad_flat(value.astype(want.dtype, copy=False), pad_multiple, layers[path])  # shape -> [n_pad] / [L, n_pad]
        out.append(jax.make_array_from_callback(padded.shape, sharding, lambda index, a=padded: a[index]))
        del value, padded  # one tensor on the host at a time
    return out


def _auto(mesh: Mesh) -> Mesh:
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _logical_replicated(x, shape: tuple, layers: int | None, mesh: Mesh):
    """``[n_pad]`` / ``[L, n_pad]`` sharded -> the logical array, replicated (compiled once per shape)."""
    lead = () if layers is None else (layers,)
    n = int(np.prod(shape[len(lead):], dtype=np.int64))
    # [.., n_pad/N] --all_gather(shard)--> [.., n_pad] -> [.., n] -> shape (collectives inserted by the partitioner)
    return jax.lax.with_sharding_constraint(x.reshape(lead + (-1,))[..., :n].reshape(shape), NamedSharding(mesh, P()))


def fetch_params(state) -> Iterator[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]]:
    """``(dotted path, logical shape, dtype, fetch)`` per parameter of a :class:`ShardedState`.

    ``fetch()`` gathers that one parameter (``[n_pad]`` shards --all_gather--> logical shape,
    replicated) and returns it as a numpy array: host memory holds one parameter at a time.
    Every process must call each ``fetch`` (the gather is a collective program).
    """
    from flax import traverse_util  # noqa: PLC0415

    plan = state.plan
    flat = traverse_util.flatten_dict(state.params)
    layers = plan.layers_of()
    mesh = _auto(plan.mesh)  # Auto axes: the unpadding slices sizes that do not divide
    for path, var in plan.template:
        shape, dtype = tuple(var.get_value().shape), np.dtype(var.get_value().dtype)

        def fetch(path=path, shape=shape):
            x = jax.device_put(flat[path], NamedSharding(mesh, flat[path].sharding.spec))  # same pieces, Auto axes
            return np.asarray(_logical_replicated(x, shape, layers[path], mesh).addressable_data(0))

        yield path_str(path), shape, dtype, fetch
