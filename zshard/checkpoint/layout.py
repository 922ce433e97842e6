"""The logical layout of a sharded state: what a zshard checkpoint stores, and the programs
that go between the state's padded shards and the logical arrays.

One :class:`Entry` per leaf of ``{"params", "opt_state", "step", "variables", "feedback"}``: a parameter
(and each optimizer-state leaf of a parameter) is stored under its path in its logical
shape, unpadded; scalar leaves (step counts) and the model's non-parameter variables
(replicated: BatchNorm statistics, RNG keys as their data and counts) as they are, and the
error-feedback residuals (``ShardedState.feedback``, one per device) as they are, ``[..., W n_pad]``. ``to_logical_fn`` turns the state's
``[n_pad]`` / ``[L, n_pad]`` shards into logical arrays, split over the same mesh axes along
a dimension that divides evenly; :func:`pad_to_state` is its inverse at restore. The
checksums stored beside catch a flipped byte that Orbax restores silently.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.params.flat import ParamLayout
from zshard.optim.offload import memory_kind, to_device
from zshard.plan.state import ShardedState
from zshard.params.units import path_str
from zshard.plan.weights import auto_axes

__all__ = [
    "FORMAT", "Entry", "auto_axes", "checksums", "differences", "logical_layout", "logical_spec", "nested",
    "pad_to_state", "relabel", "short_error", "state_tree", "to_logical_fn", "variables_from_tree",
]  # fmt: skip

FORMAT = 1
"""Version of the logical layout, stored in every checkpoint's ``meta``."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored array and how it maps to a leaf of the :class:`ShardedState`.

    Attributes:
      key: storage path, strings: ``("params", "blocks", "0", "lin", "kernel")``.
      shape: logical shape (what is stored).
      dtype: numpy dtype (the state leaf's).
      layout: the parameter's record (:class:`~zshard.params.flat.ParamLayout`) for a parameter or a
        parameter-like optimizer leaf (stored in its logical shape), else ``None`` (a scalar
        count, stored as is).
      axes: mesh axes the logical array is split over (``()``: replicated).
    """

    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: ParamLayout | None
    axes: tuple[str, ...]

    @property
    def param(self) -> tuple | None:
        """The parameter path of a parameter-like leaf, else ``None``."""
        return None if self.layout is None else self.layout.path


class _Ref:
    """A parameter path as an opaque pytree leaf."""

    def __init__(self, path):
        self.path = path


_NONPARAM = object()


def _key_str(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(x):
    """A typed PRNG key array -> its ``uint32`` data (``[..., 2]`` for threefry), what Orbax
    stores; an abstract one -> the abstract data, with the key's sharding."""
    if not _is_key(x):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
    return jax.random.key_data(x)


def state_tree(state) -> dict:
    """What a checkpoint stores of ``state``: parameters, optimizer state, step and the
    non-parameter variables (RNG keys as their ``uint32`` data)."""
    tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    if state.variables:
        tree["variables"] = jax.tree.map(_key_data, state.variables)
    if state.feedback:  # error feedback: every device's residual, stored as it is ([..., W n_pad])
        tree["feedback"] = state.feedback
    return tree


def variables_from_tree(values: dict, target) -> dict:
    """The ``variables`` of a restored :func:`state_tree`, RNG keys wrapped back like ``target``'s."""
    if not target.variables:
        return {}
    return jax.tree.map(lambda v, t: jax.random.wrap_key_data(v) if _is_key(t) else v, values["variables"], target.variables)


_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def logical_layout(state: ShardedState) -> tuple[list[Entry], Any]:
    """Entries aligned with the leaves of ``state_tree(state)``, and that tree's treedef.

    ``state`` may be concrete or abstract (``init(..., abstract=True)``): only shapes,
    dtypes and the plan are read. Cached per plan.
    """
    plan = state.plan
    cached = _LAYOUTS.setdefault(plan, {})  # keyed by whether the state carries error-feedback residuals
    if bool(state.feedback) in cached:
        return cached[bool(state.feedback)]
    records = plan.layouts
    # Which optimizer leaves belong to which parameter: Optax's own map over params-like
    # subtrees (the same one zshard.init uses for the PartitionSpecs).
    refs = traverse_util.unflatten_dict({p: _Ref(p) for p in records if p in plan.trainable})
    masked = optax.MaskedNode
    opt_refs = optax.tree_map_params(
        plan.tx,
        lambda leaf, ref: leaf if isinstance(leaf, masked) else ref,
        state.opt_state,
        refs,
        transform_non_params=lambda _: _NONPARAM,
        is_leaf=lambda x: isinstance(x, (_Ref, masked)),
    )
    ref_leaves = jax.tree.leaves(opt_refs, is_leaf=lambda x: isinstance(x, _Ref) or x is _NONPARAM)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state_tree(state))
    ref_iter = iter(ref_leaves)  # the opt_state leaves, in order (dict keys sort: opt_state, params, step)
    opt_axes = plan.opt_axes
    entries, seen = [], {}
    for kpath, leaf in leaves:
        key = tuple(_key_str(k) for k in kpath)
        shape, dtype = tuple(np.shape(leaf)), np.dtype(leaf.dtype)
        if key[0] == "params":
            path = tuple(getattr(k, "key", None) for k in kpath[1:])
            entry = Entry(key, records[path].logical_shape, dtype, records[path], plan.shard_axes)
        elif key[0] == "opt_state":
            ref = next(ref_iter)
            if isinstance(ref, _Ref):
                rec = records[ref.path]
                if int(np.prod(shape, dtype=np.int64)) != int(np.prod(rec.storage_shape, dtype=np.int64)):
                    raise ValueError(
                        f"optimizer state leaf {'.'.join(key)} has shape {shape}, not that of parameter "
                        f"{path_str(ref.path)} {rec.logical_shape} (stored {rec.storage_shape}); zshard checkpoints "
                        f"elementwise optimizer states (adam, adamw, sgd, lion, ...) only"
                    )
                entry = Entry(key, rec.logical_shape, dtype, rec, opt_axes)
            else:
                entry = Entry(key, shape, dtype, None, ())
        elif key[0] == "feedback":  # [..., W n_pad], split over the data axes along its last dimension
            entry = Entry(key, shape, dtype, None, plan.data_axes)
        else:
            entry = Entry(key, shape, dtype, None, ())
        if key in seen:  # pragma: no cover - two pytree keys with the same string form
            raise ValueError(f"two state leaves share the checkpoint name {'.'.join(key)}: {seen[key]} and {kpath}")
        seen[key] = kpath
        entries.append(entry)
    cached[bool(state.feedback)] = (entries, treedef)
    return entries, treedef


def logical_spec(mesh, shape: tuple[int, ...], axes: tuple[str, ...]) -> P:
    """Split a logical array over ``axes`` along its largest evenly divisible dimension."""
    n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if n == 1:
        return P()
    dims = [d for d in np.argsort(shape)[::-1] if shape[d] % n == 0 and shape[d] >= n]
    if not dims:
        return P()  # small or indivisible (biases): replicated
    spec = [None] * len(shape)
    spec[int(dims[0])] = axes
    return P(*spec)


def _unpad(x, e: Entry):
    """State leaf -> logical array: ``[n_pad]`` / ``[L, n_pad]`` / ``[.., 1, n_pad]`` -> ``shape``."""
    return x if e.layout is None else e.layout.from_storage(x.reshape(e.layout.storage_shape))


def pad_to_state(x, e: Entry, stored_shape):
    """Logical array -> state leaf of ``stored_shape``, zero padding (the inverse of ``_unpad``)."""
    return x if e.layout is None else e.layout.to_storage(x).reshape(stored_shape)


def relabel(mesh: Mesh, x):
    """``x`` re-labelled onto ``mesh`` (same devices, spec and memory kind: no data moves)."""
    return jax.device_put(x, NamedSharding(mesh, x.sharding.spec, memory_kind=x.sharding.memory_kind))


def _checksum(x) -> jax.Array:
    """uint32 ``[2]``: the sum of ``x``'s bit patterns and their position-weighted sum, mod 2**32.

    Integer sums wrap the same in any reduction order, so the value does not depend on the
    mesh. Orbax's compressed chunks carry no checksum (a flipped byte in a data file
    restores silently as other numbers); this one is stored in the checkpoint's JSON and
    compared on every restore.
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8-byte: [..., 2]
    flat = bits.reshape(-1)
    weights = jnp.arange(1, flat.size + 1, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(flat, dtype=jnp.uint32), jnp.sum(flat * weights, dtype=jnp.uint32)])


def checksums(values: list) -> list[list[int]]:
    return np.asarray(jax.device_get(_checksums_jit(values))).tolist()


# (a host-offloaded leaf is summed on the device: zshard.offload.to_device)
_checksums_jit = jax.jit(lambda xs: jnp.stack([_checksum(to_device(x)) for x in xs]) if xs else jnp.zeros((0, 2), jnp.uint32))


def short_error(e: Exception) -> str:
    """An exception in one line of at most 240 characters (TensorStore prints whole specs)."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text if len(text) <= 240 else text[:237] + "..."


_TO_LOGICAL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _unpad_program(state: ShardedState):
    """``(jitted unpad, logical shardings)`` of ``state``'s plan (built once per plan)."""
    plan = state.plan
    if plan not in _TO_LOGICAL:
        entries, _ = logical_layout(state)
        auto = auto_axes(plan.mesh)
        kinds = [memory_kind(x) for x in jax.tree.leaves(state_tree(state))]  # offloaded leaves stay on the host
        shardings = [NamedSharding(auto, logical_spec(auto, e.shape, e.axes), memory_kind=k) for e, k in zip(entries, kinds)]
        # [n_pad] (host: --copy--> device) -> logical (--copy--> host)
        unpad = jax.jit(lambda leaves: [_unpad(to_device(x), e) for x, e in zip(leaves, entries)], out_shardings=shardings)
        _TO_LOGICAL[plan] = (unpad, shardings)
    return _TO_LOGICAL[plan]


def to_logical_fn(state: ShardedState):
    unpad, _ = _unpad_program(state)
    auto = auto_axes(state.plan.mesh)
    return lambda leaves: unpad([relabel(auto, x) for x in leaves])


def compile_save(state: ShardedState) -> None:
    """Compile what a save runs on the devices (the unpadding into the logical layout, the
    checksums) for ``state``'s plan, ahead and without running it: JAX keeps the executables,
    so the first save costs what the later ones do."""
    unpad, shardings = _unpad_program(state)
    auto = auto_axes(state.plan.mesh)
    leaves = jax.tree.leaves(state_tree(state))
    ins = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(auto, x.sharding.spec)) for x in leaves]
    outs = [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s) for o, s in zip(jax.eval_shape(unpad, ins), shardings)]
    unpad.lower(ins).compile()
    _checksums_jit.lower(outs).compile()


def nested(entries: list[Entry], values: list) -> dict:
    return traverse_util.unflatten_dict({e.key: v for e, v in zip(entries, values)})


# ----------------------------------------------------------------------------------------


def _fmt(shape, dtype) -> str:
    return f"{list(shape)} {np.dtype(dtype).name}"


def differences(want: dict, have: dict, stored: str, target: str) -> list[str]:
    """One line per name whose ``(shape, dtype)`` differs between ``have`` (the ``stored``
    side) and ``want`` (the ``target``), or that only one side has; parameters first."""
    problems = []
    for name in sorted(set(want) | set(have), key=lambda n: (not n.startswith("params."), n)):
        if name not in have:
            problems.append(f"  {name}: missing in the {stored}; the {target} has {_fmt(*want[name])}")
        elif name not in want:
            problems.append(f"  {name}: in the {stored} {_fmt(*have[name])}, not in the {target}")
        elif want[name] != have[name]:
            problems.append(f"  {name}: {stored} {_fmt(*have[name])}, {target} {_fmt(*want[name])}")
    return problems
