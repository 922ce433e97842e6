"""Orbax checkpoints of a :class:`~zshard.ShardedState`: :class:`Checkpointer` (periodic,
asynchronous, ``keep``), and the one-call :func:`save` / :func:`restore`.

What is stored is the logical layout (:mod:`zshard.checkpoint.layout`); this module does the
Orbax side: one ``CheckpointManager`` folder per step, written under a temporary name and
renamed when complete, read back onto any mesh and strategy.
"""

from __future__ import annotations

import inspect
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.sharding import NamedSharding

from zshard.checkpoint.layout import (
    FORMAT,
    Entry,
    auto_axes,
    checksums,
    compile_save,
    differences,
    logical_layout,
    logical_spec,
    nested,
    pad_to_state,
    short_error,
    state_tree,
    to_logical_fn,
    variables_from_tree,
)
from zshard.optim.offload import memory_kind, to_device, with_device_params
from zshard.plan.state import ShardedState, init, init_feedback
from zshard.params.units import path_str

__all__ = ["Checkpointer", "restore", "save"]

_TMP_MARK = ".orbax-checkpoint-tmp"


def _steps_on_disk(directory: Path) -> tuple[list[int], list[str]]:
    """Finished step folders and half-written (temporary) ones."""
    done, tmp = [], []
    for child in directory.iterdir() if directory.is_dir() else []:
        if _TMP_MARK in child.name:
            tmp.append(child.name)
        elif child.is_dir() and child.name.isdigit():
            done.append(int(child.name))
    return sorted(done), sorted(tmp)


def _closed_loop_noise(unraisable) -> bool:
    """Is this asyncio's "Event loop is closed", raised on a TensorStore thread after a read failed?

    Orbax reads a checkpoint's arrays concurrently under ``asyncio.run``. When one read fails
    (a truncated or corrupt file) the loop ends with that error and is closed; the other
    reads still finish later and their completion callbacks call ``call_soon_threadsafe`` on
    the closed loop. Python prints each as an "Exception ignored" traceback after zshard's
    clear error. Those reads' results are unused, so the message carries no information.
    """
    e = unraisable.exc_value
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
        return True
    # one of those reads, a coroutine left behind by the failed restore, raising its own read
    # error when it is garbage-collected ("Exception ignored in: <coroutine object
    # _read_array_index_and_device_put>"): the restore already raised the first such error
    obj = unraisable.object
    return inspect.iscoroutine(obj) and obj.__qualname__.endswith("_read_array_index_and_device_put")


def hide_closed_loop_noise() -> None:
    """Drop :func:`_closed_loop_noise` messages from ``sys.unraisablehook``: installed once,
    before a checkpoint's files are first read (the noise can follow a failure at once);
    every other unraisable exception goes to the hook that was there."""
    previous = sys.unraisablehook
    if getattr(previous, "_zshard", False):
        return

    def hook(unraisable):
        if not _closed_loop_noise(unraisable):
            previous(unraisable)

    hook._zshard = True
    sys.unraisablehook = hook


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
        entries, _ = logical_layout(state)
        logical = to_logical_fn(state)(jax.tree.leaves(state_tree(state)))
        sums = checksums(logical)
        plan = state.plan
        meta = {
            "zshard": {
                "format": FORMAT,
                "step": step,
                "strategy": plan.strategy.value,
                "mesh": dict(plan.mesh.shape),
                "params": {path_str(p): list(v.get_value().shape) for p, v in plan.template},
                "variables": {path_str(p): type(v).__name__ for p, v in plan.var_template},  # kinds: export skips RNG state
                "checksums": {".".join(e.key): c for e, c in zip(entries, sums)},
            },
            "extra": extra,
        }
        args = ocp.args.Composite(state=ocp.args.StandardSave(nested(entries, logical)), meta=ocp.args.JsonSave(meta))
        if not mngr.save(step, args=args, force=True):  # pragma: no cover - force=True always saves
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")
        return step

    def compile_save(self, state: ShardedState) -> None:
        """Compile, without running, what :meth:`save` computes on the devices for ``state``'s
        plan (the logical layout and its checksums), so that the first save costs what later
        ones do: a save started by a preemption signal has a grace period. Nothing is written."""
        compile_save(state)

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

    def resolve_step(self, step: int | None = None) -> int:
        """``step`` if it is a complete checkpoint here, else the latest one for ``None``.

        Raises:
          FileNotFoundError: no directory, no complete checkpoint, or no such step.
        """
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
        return self.read_meta(self.resolve_step(step))["extra"]

    def read_meta(self, step: int) -> dict:
        """The JSON record of checkpoint ``step``: ``{"zshard": {format, step, strategy, mesh,
        params, checksums}, "extra": ...}``.

        Raises:
          ValueError: the record is missing, truncated, corrupt or of another format.
        """
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint {str(path)!r} cannot be read ({e}); the file is missing, truncated or corrupt") from e
        if not isinstance(meta, dict) or meta.get("zshard", {}).get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a zshard checkpoint of format {FORMAT}")
        return meta

    def stored_arrays(self, step: int) -> dict:
        """Checkpoint ``step``'s arrays, without reading them: flat dict ``key tuple -> metadata``
        (``.shape``, ``.dtype``), keys as in the logical layout (``("params", "blocks", "0", ...)``).

        Raises:
          ValueError: the files are truncated or corrupt.
        """
        where = str(self.directory / str(step))
        hide_closed_loop_noise()  # restore and export read the files after this
        try:
            stored = self._mngr(create=False).item_metadata(step)["state"]
            return traverse_util.flatten_dict(dict(stored.tree))
        except Exception as e:  # orbax/tensorstore raise many types for a damaged file
            raise ValueError(f"checkpoint {where!r} cannot be read ({short_error(e)}); its files are truncated or corrupt") from e

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
            ``trainable``, ``offload``, as for :func:`zshard.init`: the new placement.

        Returns:
          ``(state, extra)``: a :class:`~zshard.ShardedState` laid out for ``mesh`` and the
          strategy, and the ``extra`` given to :meth:`save`.

        Raises:
          FileNotFoundError: no directory, no complete checkpoint, or no such step.
          ValueError: a file is missing, truncated or corrupt; or the checkpoint does not
            match the model or the optimizer (each differing path with both shapes).
        """
        step = self.resolve_step(step)
        target = init(model, tx, mesh, abstract=True, **init_kw)
        return self._restore_into(target, step)

    def _restore_into(self, target: ShardedState, step: int) -> tuple[ShardedState, Any]:
        """Error-feedback residuals (``ShardedState.feedback``) are restored bit for bit where the
        checkpoint has them at the target's shapes (same data devices, same format); otherwise
        they are reset: zeros where the target keeps error feedback, dropped where it does not,
        with a warning naming why (DeepSpeed's 1-bit Adam resets its error buffers on load too).
        A reset costs the correction of one step; nothing else changes."""
        where = str(self.directory / str(step))
        stored = self.stored_arrays(step)
        want = {e.key: (tuple(e.shape), np.dtype(e.dtype)) for e in logical_layout(target)[0] if e.key[0] == "feedback"}
        have = {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in stored.items() if k[0] == "feedback"}
        if want == have:
            return self._restore_arrays(target, step, stored)
        if not want:
            why = "the target has no error feedback (reduce_format without error_feedback=True): they are dropped"
        elif not have:
            why = "the checkpoint has none (saved without error feedback): they start at zero"
        else:
            why = ("they were saved for another mesh or format (shapes differ: each device's residual belongs to its "
                   "device and its gradient's layout): they start at zero")
        warnings.warn(f"zshard.checkpoint: checkpoint {where!r}: the error-feedback residuals are not restored; {why}",
                      stacklevel=3)
        skipped = {k: m for k, m in stored.items() if k[0] == "feedback"}  # read (Orbax restores whole trees) and dropped
        stored = {k: m for k, m in stored.items() if k[0] != "feedback"}
        state, extra = self._restore_arrays(dataclasses.replace(target, feedback={}), step, stored, skipped)
        return dataclasses.replace(state, feedback=init_feedback(target.plan) if want else {}), extra

    def _restore_arrays(self, target: ShardedState, step: int, stored: dict, skipped=None) -> tuple[ShardedState, Any]:
        meta = self.read_meta(step)
        mngr = self._mngr(create=False)
        where = str(self.directory / str(step))
        entries, treedef = logical_layout(target)
        self._check_match(entries, stored, where)
        auto = auto_axes(target.plan.mesh)
        leaves = jax.tree.leaves(state_tree(target))
        kinds = [memory_kind(leaf) for leaf in leaves]  # offload: read straight into pinned host memory
        abstract = nested(
            entries,
            [
                jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=NamedSharding(auto, logical_spec(auto, e.shape, e.axes), memory_kind=k))
                for e, k in zip(entries, kinds)
            ],
        )
        if skipped:  # stored arrays the target does not take (Orbax restores whole trees): read split over the mesh, dropped
            flat = traverse_util.flatten_dict(abstract)
            for key, m in skipped.items():
                spec = logical_spec(auto, tuple(m.shape), target.plan.data_axes)
                flat[key] = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=NamedSharding(auto, spec))
            abstract = traverse_util.unflatten_dict(flat)
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise ValueError(f"checkpoint {where!r} cannot be read ({short_error(e)}); its files are truncated or corrupt") from e
        logical = [traverse_util.flatten_dict(restored)[e.key] for e in entries]
        want = meta["zshard"].get("checksums", {})
        bad = [".".join(e.key) for e, c in zip(entries, checksums(logical)) if want.get(".".join(e.key)) != c]
        if bad:
            raise ValueError(
                f"checkpoint {where!r} is corrupt: {len(bad)} array(s) read back with other contents than were saved "
                f"(checksum mismatch): {', '.join(bad[:10])}{' ...' if len(bad) > 10 else ''}; restore an earlier step"
            )
        to_state = jax.jit(
            lambda xs: [pad_to_state(to_device(x), e, leaf.shape) for x, e, leaf in zip(xs, entries, leaves)],
            out_shardings=[NamedSharding(auto, leaf.sharding.spec, memory_kind=k) for leaf, k in zip(leaves, kinds)],
        )
        values = jax.tree.unflatten(treedef, [jax.device_put(x, leaf.sharding) for x, leaf in zip(to_state(logical), leaves)])
        state = ShardedState(values["params"], values["opt_state"], values["step"], target.plan, variables_from_tree(values, target),
                             feedback=values.get("feedback", {}))
        return with_device_params(state), meta["extra"]  # offload="optimizer+master": the masters' device copies

    @staticmethod
    def _check_match(entries: list[Entry], stored: dict, where: str) -> None:
        want = {".".join(e.key): (tuple(e.shape), np.dtype(e.dtype)) for e in entries}
        have = {".".join(k): (tuple(m.shape), np.dtype(m.dtype)) for k, m in stored.items()}
        problems = differences(want, have, "checkpoint", "model/optimizer")
        if problems:
            opt_only = all(p.strip().startswith("opt_state.") for p in problems)
            what = "a different optimizer (its state differs)" if opt_only else "a different model"
            shown = problems[:20] + ([f"  ... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise ValueError(
                f"checkpoint {where!r} does not match: it was saved from {what}; {len(problems)} difference(s):\n"
                + "\n".join(shown)
                + "\nRestore with the model and optimizer that wrote it (nothing was changed on disk)."
            )


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
    builds the target state's placement with ``zshard.init(model, tx, mesh, abstract=True, **init_kw)``
    (nothing initialised, ``model`` only traced) and reads each logical array directly
    into its pieces on the new mesh. Parameters and optimizer state come back bitwise.

    Args:
      directory: the checkpoint folder given to :func:`save`.
      mesh: the new mesh, from :func:`zshard.make_mesh` (any shape and device count).
      model: an ``nnx.Module`` or a zero-argument callable building one.
      tx: the Optax transformation that wrote the optimizer state.
      step: which checkpoint (default: the latest complete one).
      **init_kw: ``strategy``, ``zero_stage``, ``unit``, ``mixed_precision``, ``trainable``,
        ``offload`` of the new placement, as for :func:`zshard.init`.

    Returns:
      ``(state, extra)``.

    Raises:
      FileNotFoundError: no such directory, no complete checkpoint in it, or no such step.
      ValueError: truncated or corrupt files; a different model (a path missing or extra,
        or a shape / dtype differing: each named with both shapes) or optimizer.
    """
    with Checkpointer(directory) as ckpt:
        return ckpt.restore(mesh, model=model, tx=tx, step=step, **init_kw)
