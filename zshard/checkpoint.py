"""Checkpoints on Orbax: sharded save, restore onto any mesh and strategy, safetensors export.

What is stored is *logical*, independent of the mesh and the strategy that wrote it: each
parameter under its path in its own shape and dtype (no padding, no flattening), each
optimizer-state leaf of a parameter under the optimizer-state path with the parameter's
shape, the scalar leaves (step counts) as they are, the step, and a JSON record (the
caller's ``extra``: data position, RNG state, run config). A checkpoint written by 1x8
FULL_SHARD restores on 2x4 HYBRID_SHARD, 1x1 or NO_SHARD bit for bit.

Layout of one checkpoint directory (Orbax ``CheckpointManager``, one folder per step)::

    DIR/<step>/state/   arrays (Orbax StandardCheckpointHandler, OCDBT + zarr):
        params.<parameter path>                       e.g. params.blocks.0.lin.kernel [19, 19]
        opt_state.<optimizer path>.<parameter path>   e.g. opt_state.0.mu.blocks.0.lin.kernel [19, 19]
        opt_state.<optimizer path>                    e.g. opt_state.0.count [] int32
        step                                          int32 []
    DIR/<step>/meta/    JSON: {"zshard": {...what wrote it...}, "extra": <caller's extra>}

How arrays move (never whole on one device): at save, one jitted program turns every
``[n_pad]`` shard (``[L, n_pad]`` for stacked layers) into its logical array, itself split
over the same mesh axes along a dimension that divides evenly (replicated when none does),
and Orbax writes each device's piece. At restore, Orbax reads each logical array straight
into the *new* mesh's pieces and one jitted program pads and lays them out with the new
plan's ``PartitionSpec``. The new layout comes from :func:`zshard.init` with
``abstract=True`` on the new mesh and strategy, never from the saved sharding.

Writing is asynchronous (Orbax): :meth:`Checkpointer.save` returns once the arrays are
copied to host memory; the files are written in a background thread into
``DIR/<step>.orbax-checkpoint-tmp`` and renamed to ``DIR/<step>`` when complete, so a
process killed while saving leaves only a temporary folder that is never restored from.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx, traverse_util
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard.flat import padded_size
from zshard.state import ShardedState, init
from zshard.units import path_str

__all__ = ["Checkpointer", "export", "load_params", "restore", "save"]

FORMAT = 1
"""Version of the logical layout above, stored in every checkpoint's ``meta``."""

_TMP_MARK = ".orbax-checkpoint-tmp"


# ----------------------------------------------------------------------------------------
# The logical layout of a plan
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One stored array and how it maps to a leaf of the :class:`ShardedState`.

    Attributes:
      key: storage path, strings: ``("params", "blocks", "0", "lin", "kernel")``.
      shape: logical shape (what is stored).
      dtype: numpy dtype (the state leaf's).
      param: the parameter path for a parameter or a parameter-like optimizer leaf, else
        ``None`` (a scalar count, stored as is).
      layers: ``L`` of a stacked parameter (each layer padded on its own), else ``None``.
      axes: mesh axes the logical array is split over (``()``: replicated).
    """

    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    param: tuple | None
    layers: int | None
    axes: tuple[str, ...]


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


def _tree(state) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _layout(state: ShardedState) -> tuple[list[_Entry], Any]:
    """Entries aligned with the leaves of ``_tree(state)``, and that tree's treedef.

    ``state`` may be concrete or abstract (``init(..., abstract=True)``): only shapes,
    dtypes and the plan are read. Cached per plan.
    """
    plan = state.plan
    if plan in _LAYOUTS:
        return _LAYOUTS[plan]
    template = {p: v.get_value() for p, v in plan.template}
    layers = plan.layers_of()
    # Which optimizer leaves belong to which parameter: Optax's own map over params-like
    # subtrees (the same one zshard.init uses for the PartitionSpecs).
    refs = traverse_util.unflatten_dict({p: _Ref(p) for p in template if p in plan.trainable})
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
    leaves, treedef = jax.tree_util.tree_flatten_with_path(_tree(state))
    ref_iter = iter(ref_leaves)  # the opt_state leaves, in order (dict keys sort: opt_state, params, step)
    opt_axes = plan.strategy.opt_axes
    entries, seen = [], {}
    for kpath, leaf in leaves:
        key = tuple(_key_str(k) for k in kpath)
        shape, dtype = tuple(np.shape(leaf)), np.dtype(leaf.dtype)
        if key[0] == "params":
            path = tuple(getattr(k, "key", None) for k in kpath[1:])
            entry = _Entry(key, tuple(template[path].shape), dtype, path, layers[path], plan.shard_axes)
        elif key[0] == "opt_state":
            ref = next(ref_iter)
            if isinstance(ref, _Ref):
                logical = tuple(template[ref.path].shape)
                lead = 1 if layers[ref.path] is None else layers[ref.path]
                n_pad = padded_size(int(np.prod(logical[(layers[ref.path] is not None) :], dtype=np.int64)), plan.opt_shards)
                if int(np.prod(shape, dtype=np.int64)) != lead * n_pad:
                    raise ValueError(
                        f"optimizer state leaf {'.'.join(key)} has shape {shape}, not that of parameter "
                        f"{path_str(ref.path)} {logical} (padded {lead} x {n_pad}); zshard checkpoints "
                        f"elementwise optimizer states (adam, adamw, sgd, lion, ...) only"
                    )
                entry = _Entry(key, logical, dtype, ref.path, layers[ref.path], opt_axes)
            else:
                entry = _Entry(key, shape, dtype, None, None, ())
        else:
            entry = _Entry(key, shape, dtype, None, None, ())
        if key in seen:  # pragma: no cover - two pytree keys with the same string form
            raise ValueError(f"two state leaves share the checkpoint name {'.'.join(key)}: {seen[key]} and {kpath}")
        seen[key] = kpath
        entries.append(entry)
    _LAYOUTS[plan] = (entries, treedef)
    return entries, treedef


def _logical_spec(mesh, shape: tuple[int, ...], axes: tuple[str, ...]) -> P:
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


def _unpad(x, e: _Entry):
    """State leaf -> logical array: ``[n_pad]`` / ``[L, n_pad]`` / ``[.., 1, n_pad]`` -> ``shape``."""
    return x if e.param is None else _unpad_to(x, e.shape, e.layers)


def _unpad_to(x, shape: tuple, layers: int | None):
    lead = () if layers is None else (layers,)
    n = int(np.prod(shape[len(lead) :], dtype=np.int64))
    return x.reshape(lead + (-1,))[..., :n].reshape(shape)  # [.., n_pad] -> [.., n] -> shape


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _unpad_replicated(x, shape: tuple, layers: int | None, mesh: Mesh):
    """One parameter's logical array, replicated on ``mesh`` (compiled once per shape)."""
    return jax.lax.with_sharding_constraint(_unpad_to(x, shape, layers), NamedSharding(mesh, P()))


def _pad(x, e: _Entry, stored_shape):
    """Logical array -> state leaf of ``stored_shape``, zero padding (the inverse of ``_unpad``)."""
    if e.param is None:
        return x
    lead = () if e.layers is None else (e.layers,)
    flat = x.reshape(lead + (-1,))  # shape -> [.., n]
    pad = int(np.prod(stored_shape, dtype=np.int64)) // int(np.prod(lead, dtype=np.int64)) - flat.shape[-1]
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)]) if pad else flat  # [.., n_pad]
    return flat.reshape(stored_shape)


def _auto(mesh: Mesh) -> Mesh:
    """The same devices with ``Auto`` axes: the un/padding programs slice dimensions that do
    not divide by the axis size, which Explicit axes refuse; the partitioner moves the data."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _on(mesh: Mesh, x):
    """``x`` re-labelled onto ``mesh`` (same devices and spec: no data moves)."""
    return jax.device_put(x, NamedSharding(mesh, x.sharding.spec))


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


def _checksums(values: list) -> list[list[int]]:
    return np.asarray(jax.device_get(_checksums_jit(values))).tolist()


_checksums_jit = jax.jit(lambda xs: jnp.stack([_checksum(x) for x in xs]) if xs else jnp.zeros((0, 2), jnp.uint32))


def _short(e: Exception) -> str:
    """An exception in one line of at most 240 characters (TensorStore prints whole specs)."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return text if len(text) <= 240 else text[:237] + "..."


_TO_LOGICAL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _to_logical_fn(state: ShardedState):
    plan = state.plan
    if plan not in _TO_LOGICAL:
        entries, _ = _layout(state)
        auto = _auto(plan.mesh)
        shardings = [NamedSharding(auto, _logical_spec(auto, e.shape, e.axes)) for e in entries]
        unpad = jax.jit(lambda leaves: [_unpad(x, e) for x, e in zip(leaves, entries)], out_shardings=shardings)
        _TO_LOGICAL[plan] = lambda leaves: unpad([_on(auto, x) for x in leaves])
    return _TO_LOGICAL[plan]


def _nested(entries: list[_Entry], values: list) -> dict:
    return traverse_util.unflatten_dict({e.key: v for e, v in zip(entries, values)})


# ----------------------------------------------------------------------------------------
# Checkpointer
# ----------------------------------------------------------------------------------------


def _steps_on_disk(directory: Path) -> tuple[list[int], list[str]]:
    """Finished step folders and half-written (temporary) ones."""
    done, tmp = [], []
    for child in directory.iterdir() if directory.is_dir() else []:
        if _TMP_MARK in child.name:
            tmp.append(child.name)
        elif child.is_dir() and child.name.isdigit():
            done.append(int(child.name))
    return sorted(done), sorted(tmp)


class Checkpointer:
    """Periodic, asynchronous checkpoints of a :class:`~zshard.ShardedState` in one directory.

    A thin layer over ``orbax.checkpoint.CheckpointManager`` (one folder per step,
    ``DIR/<step>``, written under a temporary name and renamed when complete).

    Example::

        with zshard.checkpoint.Checkpointer("runs/a/checkpoints", keep=3) as ckpt:
            for i in range(1, steps + 1):
                state, metrics = step(state, next(batches))
                if i % 100 == 0:
                    ckpt.save(state, extra={"data": stream.position()})   # returns at once
        # __exit__ waits for the last write

        state, extra = zshard.checkpoint.Checkpointer(DIR).restore(mesh2, model=make_model, tx=tx,
                                                                   strategy="HYBRID_SHARD")

    Args:
      directory: the checkpoint folder (created on the first save, not before).
      keep: keep the ``keep`` most recent checkpoints, deleting older ones after a newer
        one is complete (``None``: keep all).
      async_save: write in a background thread (default); ``False`` blocks in ``save``.

    Raises:
      ValueError: ``keep`` is not a positive integer, or ``directory`` is an existing file.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = None, async_save: bool = True):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive integer (checkpoints kept) or None (all), got {keep!r}")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} is a file; give a directory path")
        self._keep, self._async = keep, async_save
        self._manager: ocp.CheckpointManager | None = None

    def _mngr(self, create: bool) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self._keep, create=create, enable_async_checkpointing=self._async
            )
            handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager

    # -- queries --------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending (half-written ones are not listed)."""
        if self._manager is not None:
            return sorted(self._manager.all_steps())
        return _steps_on_disk(self.directory)[0]

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save -----------------------------------------------------------------------------

    def save(self, state: ShardedState, *, step: int | None = None, extra: Any = None) -> int:
        """Start writing ``state`` as checkpoint ``step``; returns the step.

        Args:
          state: the sharded train state (any mesh, any strategy).
          step: the checkpoint's number (default ``state.step``, optimizer steps taken).
          extra: anything JSON can hold (data position, RNG state, run config), returned
            by :meth:`restore`.

        Returns once the arrays are copied off the devices; the state may be donated to
        the next train step at once. Call :meth:`wait_until_finished` (or use the
        ``with`` block) before the process exits.

        Raises:
          ValueError: ``step`` exists already in the directory (nothing is overwritten), or
            is negative; ``extra`` is not JSON (naming the offending value's type).
        """
        if not isinstance(state, ShardedState):
            raise TypeError(f"save: state must be a zshard.ShardedState, got {type(state).__name__}")
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
            raise ValueError(
                "save: this state was donated to a train step (its buffers are deleted); save the state "
                "the step returned: state, metrics = step(state, batch)"
            )
        step = int(jax.device_get(state.step)) if step is None else step
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"save: step must be an integer >= 0, got {step!r}")
        step = int(step)
        try:
            extra = json.loads(json.dumps(extra))  # a copy: the caller may change it while Orbax writes
        except (TypeError, ValueError) as e:
            raise ValueError(f"save: extra must hold only JSON values (dict, list, str, number, bool, None): {e}") from e
        mngr = self._mngr(create=True)
        if step in mngr.all_steps():
            raise ValueError(
                f"save: checkpoint step {step} exists already in {str(self.directory)!r}; nothing was written. "
                f"Save under a new step, or use a new directory"
            )
        entries, _ = _layout(state)
        logical = _to_logical_fn(state)(jax.tree.leaves(_tree(state)))
        sums = _checksums(logical)
        plan = state.plan
        meta = {
            "zshard": {
                "format": FORMAT,
                "step": step,
                "strategy": plan.strategy.value,
                "mesh": dict(plan.mesh.shape),
                "params": {path_str(p): list(v.get_value().shape) for p, v in plan.template},
                "checksums": {".".join(e.key): c for e, c in zip(entries, sums)},
            },
            "extra": extra,
        }
        args = ocp.args.Composite(state=ocp.args.StandardSave(_nested(entries, logical)), meta=ocp.args.JsonSave(meta))
        if not mngr.save(step, args=args, force=True):  # pragma: no cover - force=True always saves
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")
        return step

    def wait_until_finished(self) -> None:
        """Block until every started save is complete on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending writes and release Orbax's threads."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore --------------------------------------------------------------------------

    def _check_step(self, step: int | None) -> int:
        if not self.directory.exists():
            raise FileNotFoundError(f"no checkpoint directory {str(self.directory)!r}; check the path (nothing was created)")
        if not self.directory.is_dir():
            raise FileNotFoundError(f"{str(self.directory)!r} is not a directory; give the checkpoint directory")
        steps, tmp = _steps_on_disk(self.directory)
        if not steps:
            half = f" (only half-written: {', '.join(tmp)})" if tmp else ""
            raise FileNotFoundError(f"no complete checkpoint in {str(self.directory)!r}{half}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {str(self.directory)!r}; complete steps: {steps}")
        return step

    def read_extra(self, step: int | None = None) -> Any:
        """The ``extra`` stored with checkpoint ``step`` (default: the latest)."""
        return self._read_meta(self._check_step(step))["extra"]

    def _read_meta(self, step: int) -> dict:
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint {str(path)!r} cannot be read ({e}); the file is missing, truncated or corrupt") from e
        if not isinstance(meta, dict) or meta.get("zshard", {}).get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a zshard checkpoint of format {FORMAT}")
        return meta

    def restore(
        self, mesh, *, model, tx: optax.GradientTransformation, step: int | None = None, **init_kw
    ) -> tuple[ShardedState, Any]:
        """Restore checkpoint ``step`` (default: the latest complete one) onto ``mesh``.

        Args:
          mesh: the new ``(replica, shard)`` mesh (any shape; fewer devices than at save
            time is fine).
          model: the model, as for :func:`zshard.init`: an ``nnx.Module`` or a callable
            building one (only traced, never run: nothing is initialised).
          tx: the Optax transformation (its state structure must match the checkpoint's).
          step: which checkpoint.
          **init_kw: ``strategy``, ``zero_stage``, ``unit``, ``mixed_precision``,
            ``trainable``, as for :func:`zshard.init`: the new layout.

        Returns:
          ``(state, extra)``: a :class:`~zshard.ShardedState` laid out for ``mesh`` and the
          strategy, and the ``extra`` given to :meth:`save`.

        Raises:
          FileNotFoundError: no directory, no complete checkpoint, or no such step.
          ValueError: a file is missing, truncated or corrupt; or the checkpoint does not
            match the model or the optimizer (each differing path with both shapes).
        """
        step = self._check_step(step)
        target = init(model, tx, mesh, abstract=True, **init_kw)
        return self._restore_into(target, step)

    def _restore_into(self, target: ShardedState, step: int) -> tuple[ShardedState, Any]:
        meta = self._read_meta(step)
        mngr = self._mngr(create=False)
        where = str(self.directory / str(step))
        try:
            stored = mngr.item_metadata(step)["state"]
            stored = traverse_util.flatten_dict(dict(stored.tree))
        except Exception as e:  # orbax/tensorstore raise many types for a damaged file
            raise ValueError(f"checkpoint {where!r} cannot be read ({_short(e)}); its files are truncated or corrupt") from e
        entries, treedef = _layout(target)
        self._check_match(entries, stored, where)
        auto = _auto(target.plan.mesh)
        abstract = _nested(
            entries,
            [jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=NamedSharding(auto, _logical_spec(auto, e.shape, e.axes))) for e in entries],
        )
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise ValueError(f"checkpoint {where!r} cannot be read ({_short(e)}); its files are truncated or corrupt") from e
        logical = [traverse_util.flatten_dict(restored)[e.key] for e in entries]
        want = meta["zshard"].get("checksums", {})
        bad = [".".join(e.key) for e, c in zip(entries, _checksums(logical)) if want.get(".".join(e.key)) != c]
        if bad:
            raise ValueError(
                f"checkpoint {where!r} is corrupt: {len(bad)} array(s) read back with other contents than were saved "
                f"(checksum mismatch): {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}; restore an earlier step"
            )
        leaves = jax.tree.leaves(_tree(target))
        to_state = jax.jit(
            lambda xs: [_pad(x, e, leaf.shape) for x, e, leaf in zip(xs, entries, leaves)],
            out_shardings=[NamedSharding(auto, leaf.sharding.spec) for leaf in leaves],
        )
        values = jax.tree.unflatten(treedef, [jax.device_put(x, leaf.sharding) for x, leaf in zip(to_state(logical), leaves)])
        state = ShardedState(values["params"], values["opt_state"], values["step"], target.plan)
        return state, meta["extra"]

    @staticmethod
    def _check_match(entries: list[_Entry], stored: dict, where: str) -> None:
        want = {".".join(e.key): (tuple(e.shape), np.dtype(e.dtype)) for e in entries}
        have = {".".join(k): (tuple(m.shape), np.dtype(m.dtype)) for k, m in stored.items()}
        problems = _differences(want, have, "checkpoint", "model/optimizer")
        if problems:
            opt_only = all(p.strip().startswith("opt_state.") for p in problems)
            what = "a different optimizer (its state differs)" if opt_only else "a different model"
            shown = problems[:20] + ([f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise ValueError(
                f"checkpoint {where!r} does not match: it was saved from {what}; {len(problems)} difference(s):\n"
                + "\n".join(shown)
                + "\nRestore with the model and optimizer that wrote it (nothing was changed on disk)."
            )


def _fmt(shape, dtype) -> str:
    return f"{list(shape)} {np.dtype(dtype).name}"


def _differences(want: dict, have: dict, stored: str, target: str) -> list[str]:
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


# ----------------------------------------------------------------------------------------
# One-call API
# ----------------------------------------------------------------------------------------


def save(state: ShardedState, directory: str | os.PathLike, *, step: int | None = None, extra: Any = None) -> int:
    """Write ``state`` as checkpoint ``step`` of ``directory`` and wait until it is on disk.

    The stored content is logical (every parameter and optimizer-state leaf unpadded, in its
    own shape, under its path; see this module's docstring), so :func:`restore` can lay it
    out on any mesh and strategy. For periodic asynchronous saves with a retention policy,
    use :class:`Checkpointer`.

    Args:
      state: a :class:`~zshard.ShardedState`.
      directory: the checkpoint folder (created if needed); the step goes in ``DIR/<step>``.
      step: checkpoint number (default: ``state.step``).
      extra: JSON-serialisable data stored beside (data position, RNG state, config).

    Returns:
      The step written.

    Raises:
      ValueError: ``step`` exists already (nothing is overwritten), bad ``extra``, or
        ``directory`` is a file.
    """
    with Checkpointer(directory) as ckpt:
        return ckpt.save(state, step=step, extra=extra)


def restore(
    directory: str | os.PathLike, mesh, *, model, tx: optax.GradientTransformation, step: int | None = None, **init_kw
) -> tuple[ShardedState, Any]:
    """Read checkpoint ``step`` (default: the latest complete one) onto ``mesh``.

    ``restore(DIR, zshard.make_mesh(2, 4), model=make_model, tx=tx, strategy="HYBRID_SHARD")``
    builds the target layout with ``zshard.init(model, tx, mesh, abstract=True, **init_kw)``
    (nothing initialised, ``model`` only traced) and reads each logical array directly
    into its pieces on the new mesh. Parameters and optimizer state come back bitwise.

    Args:
      directory: the checkpoint folder given to :func:`save`.
      mesh: the new mesh, from :func:`zshard.make_mesh` (any shape and device count).
      model: an ``nnx.Module`` or a zero-argument callable building one.
      tx: the Optax transformation that wrote the optimizer state.
      step: which checkpoint (default: the latest complete one).
      **init_kw: ``strategy``, ``zero_stage``, ``unit``, ``mixed_precision``, ``trainable``
        of the new layout, as for :func:`zshard.init`.

    Returns:
      ``(state, extra)``.

    Raises:
      FileNotFoundError: no such directory, no complete checkpoint in it, or no such step.
      ValueError: truncated or corrupt files; a different model (a path missing or extra,
        or a shape / dtype differing: each named with both shapes) or optimizer.
    """
    with Checkpointer(directory) as ckpt:
        return ckpt.restore(mesh, model=model, tx=tx, step=step, **init_kw)


# ----------------------------------------------------------------------------------------
# Export to safetensors
# ----------------------------------------------------------------------------------------

_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


def _export_tensors(source):
    """``(name, shape, dtype, fetch)`` per parameter; ``fetch()`` -> one numpy array."""
    if isinstance(source, ShardedState):
        plan = source.plan
        entries, _ = _layout(source)
        flat = traverse_util.flatten_dict(source.params)
        auto = _auto(plan.mesh)
        for e in entries:
            if e.key[0] != "params":
                continue
            # One parameter at a time: [n_pad] shards -> logical array, replicated, then host.
            fetch = lambda e=e: np.asarray(  # noqa: E731
                _unpad_replicated(_on(auto, flat[e.param]), e.shape, e.layers, auto).addressable_data(0)
            )
            yield path_str(e.param), e.shape, e.dtype, fetch
        return
    ckpt = Checkpointer(source)
    step = ckpt._check_step(None)
    sums = ckpt._read_meta(step)["zshard"].get("checksums", {})
    where = ckpt.directory / str(step) / "state"
    try:
        stored = traverse_util.flatten_dict(dict(ckpt._mngr(create=False).item_metadata(step)["state"].tree))
    except Exception as e:
        raise ValueError(f"checkpoint {str(where)!r} cannot be read ({_short(e)}); truncated or corrupt") from e
    reader = ocp.PyTreeCheckpointer()
    ckpt.close()
    for key, m in stored.items():
        if key[0] != "params":
            continue
        item = traverse_util.unflatten_dict({key: jax.ShapeDtypeStruct(m.shape, m.dtype)})
        args = traverse_util.unflatten_dict({key: ocp.RestoreArgs(restore_type=np.ndarray)})

        def fetch(item=item, args=args, key=key):
            try:
                out = reader.restore(where, args=ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True))
            except Exception as e:
                raise ValueError(f"checkpoint {str(where)!r}: {'.'.join(key)} cannot be read ({_short(e)})") from e
            value = np.asarray(traverse_util.flatten_dict(out)[key])
            if _checksums([jnp.asarray(value)])[0] != sums.get(".".join(key)):
                raise ValueError(f"checkpoint {str(where)!r} is corrupt: {'.'.join(key)} reads back with other contents than were saved (checksum mismatch)")
            return value

        yield ".".join(key[1:]), tuple(m.shape), np.dtype(m.dtype), fetch


def export(source: ShardedState | str | os.PathLike, file: str | os.PathLike) -> Path:
    """Write the full parameters to a safetensors ``file``, one tensor at a time.

    Each parameter is stored under its path (``"blocks.0.lin.kernel"``) in its logical
    shape and dtype. Tensors are gathered one at a time (each replicated on the mesh for a
    moment, then copied to host) and staged in memory-mapped files beside ``file``, from
    which the ``safetensors`` library writes the file: anonymous host memory holds about
    one tensor, never the model (the staged pages are file-backed; the OS can evict them).
    The file is written under a temporary name and renamed: never half-written. With several
    processes, every one must call it (the gathers are collective); process 0 writes.

    Args:
      source: a :class:`~zshard.ShardedState`, or a checkpoint directory (its latest step).
      file: the output path, e.g. ``model.safetensors`` (its directory must exist).

    Returns:
      The path written.

    Raises:
      FileNotFoundError: the checkpoint directory or the output's directory is missing.
      ValueError: the checkpoint is truncated or corrupt; a dtype safetensors cannot hold.
    """
    from safetensors import TensorSpec, serialize_file  # noqa: PLC0415

    file = Path(file)
    if not file.parent.is_dir():
        raise FileNotFoundError(f"export: directory {str(file.parent)!r} of {str(file)!r} does not exist; create it first")
    if file.is_dir():
        raise ValueError(f"export: {str(file)!r} is a directory; give a file path such as model.safetensors")
    writer = jax.process_index() == 0  # every process takes part in the gathers; one writes
    with tempfile.TemporaryDirectory(dir=file.parent, prefix=f".{file.name}.") as tmp:
        specs, maps = {}, []
        for i, (name, shape, dtype, fetch) in enumerate(_export_tensors(source)):
            if dtype.name not in _ST_DTYPES:
                raise ValueError(f"export: parameter {name} has dtype {dtype.name}, which safetensors cannot store")
            value = np.ascontiguousarray(fetch(), dtype=dtype)  # one tensor in host memory
            if not writer:
                continue
            staged = np.lib.format.open_memmap(os.path.join(tmp, f"{i}.npy"), mode="w+", dtype=dtype, shape=value.shape or (1,))
            staged[...] = value.reshape(staged.shape)
            staged.flush()
            del value
            maps.append(staged)
            specs[name] = TensorSpec(dtype=dtype.name, shape=list(shape), data_ptr=staged.ctypes.data, data_len=staged.nbytes if shape else dtype.itemsize)
        if not writer:
            return file
        partial = os.path.join(tmp, "out.safetensors")
        serialize_file(specs, partial, metadata={"format": "zshard", "zshard_format": str(FORMAT)})
        del maps
        os.replace(partial, file)
    return file


def load_params(file: str | os.PathLike, model: nnx.Module) -> nnx.Module:
    """Fill ``model``'s parameters from a safetensors file written by :func:`export`.

    Reads one tensor at a time. ``model`` is an ordinary ``nnx.Module`` of the same
    structure (e.g. ``GPT(cfg, rngs=nnx.Rngs(0))``); it is updated in place and returned.

    Raises:
      FileNotFoundError: ``file`` does not exist.
      ValueError: the file is not a readable safetensors file (truncated, corrupt), or its
        tensors do not match the model's parameters (each path missing, extra, or with a
        differing shape / dtype named); the model is then left unchanged.
    """
    from safetensors import safe_open  # noqa: PLC0415

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"load_params: no file {str(file)!r}")
    flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    want = {path_str(p): (tuple(v.get_value().shape), np.dtype(v.get_value().dtype)) for p, v in flat}
    try:
        with safe_open(file, framework="flax") as f:
            have = {}
            for name in f.keys():
                sl = f.get_slice(name)
                have[name] = (tuple(sl.get_shape()), _from_st_dtype(sl.get_dtype()))
            problems = _differences(want, have, "file", "model")
            if problems:
                raise ValueError(
                    f"load_params: {str(file)!r} does not match the model; {len(problems)} difference(s):\n"
                    + "\n".join(problems[:20]) + "\nthe model was left unchanged"
                )
            values = {p: f.get_tensor(path_str(p)) for p, _ in flat}
    except ValueError:
        raise
    except Exception as e:  # safetensors raises SafetensorError / OSError on a damaged file
        raise ValueError(f"load_params: {str(file)!r} is not a readable safetensors file ({_short(e)})") from e
    nnx.update(model, nnx.from_flat_state([(p, v.replace(values[p])) for p, v in flat]))
    return model


def _from_st_dtype(code: str) -> np.dtype:
    names = {v: k for k, v in _ST_DTYPES.items()}
    return np.dtype(jnp.dtype(names.get(code.upper(), code.lower())))
