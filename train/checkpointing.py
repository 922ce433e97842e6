"""Checkpoints for ``python -m train``: exact resume, and the batch stream's position.

``[checkpoint] ckpt_every = N`` (``--ckpt-every N``) saves ``OUT/checkpoints/<step>`` every
``N`` steps and after the last one (asynchronously, :class:`zshard.Checkpointer`), and a
SIGTERM / SIGUSR1 saves one whatever ``N`` (``train/stops.py``);
``keep = K`` keeps the ``K`` newest; ``resume`` continues from the newest complete
checkpoint in ``OUT``.

Resume is exact: a checkpoint holds, besides the sharded state, the Grain iterator's state
(:class:`BatchStream`), the metrics records so far and the run's configuration
(``Config.to_dict()``). A resumed run draws the same batches, applies the same updates and
writes the same ``metrics.jsonl`` losses as one that never stopped. It may run on another
mesh, strategy or process count; every setting that changes the numbers (model, data,
batch, learning-rate schedule, seed, ...) must match, or the run stops before compiling
with the differing settings named.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grain
import numpy as np

import zshard
from train import data, output
from train.config import Config, flag_of

__all__ = ["BatchStream", "ResumeError", "RunCheckpoints", "prepare"]

SUBDIR = "checkpoints"
"""Checkpoints live in ``OUT/checkpoints/<step>``."""

MAY_DIFFER_ON_RESUME = ("mesh.", "checkpoint.", "distributed.", "logging.", "data.eval_batches", "training.eval_every",
                        "training.prefetch", "training.hpz", "training.fit_check", "training.watchdog")
"""Settings (``section.field`` or a ``section.`` prefix) a resumed run may change: where and
how it runs, what it logs, not what it computes."""


class ResumeError(ValueError):
    """``OUT`` and the checkpoint flags do not fit together (checked before any compile)."""


class BatchStream:
    """:func:`train.data.train_dataset` as an iterator whose position a checkpoint holds.

    Yields this process's rows of each global batch, ``(inputs, targets)``, int32
    ``[batch_size / processes, seq_len]`` each. The position is the Grain iterator's own
    state (``DatasetIterator.get_state()``, JSON: ``{"next_index": batches drawn}``); it is
    stored in the Orbax checkpoint (the ``extra`` record) and :meth:`seek` hands it back to
    ``set_state``. Global batch ``i`` depends on ``(seed, i)`` only, so the same state
    resumes on any number of processes.
    """

    def __init__(self, corpus: np.ndarray, batch_size: int, seq_len: int, seed: int, *, process_index: int = 0, process_count: int = 1):
        ds = data.train_dataset(corpus, batch_size, seq_len, seed, process_index=process_index, process_count=process_count)
        # one background thread reads ahead 2 batches; the state counts batches handed out
        self._it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)))

    def __iter__(self):
        return self

    def __next__(self) -> data.Batch:
        return next(self._it)

    @property
    def drawn(self) -> int:
        """Batches handed out so far (global batch index of the next one)."""
        return int(self._it.get_state()["next_index"])

    def position(self) -> dict:
        """JSON: the Grain iterator state, ``{"next_index": int}``."""
        return dict(self._it.get_state())

    def seek(self, position: dict) -> None:
        """Continue from a :meth:`position` (also accepts ``{"batches_drawn": n}`` of older checkpoints)."""
        if "batches_drawn" in position:
            position = {"next_index": int(position["batches_drawn"])}
        self._it.set_state(dict(position))


def run_settings(run: Config) -> dict:
    """``{"section.field": value}`` of every setting of ``run`` (JSON; unset ones left out)."""
    return {f"{s}.{k}": v for s, table in run.to_dict().items() for k, v in table.items()}


def _may_differ(key: str) -> bool:
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in MAY_DIFFER_ON_RESUME)


class RunCheckpoints:
    """The checkpoints of one ``python -m train`` run in ``OUT/checkpoints``.

    Attributes:
      every: steps between saves (0: only resuming, never saving).
      start: the step the run starts after (0, or the resumed checkpoint's step).
      extra: the resumed checkpoint's ``extra`` (``None`` when starting fresh).
      directory: ``OUT/checkpoints``.
      replaces: ``--resume`` in an unfinished run's folder with no complete checkpoint (no
        summary, no weights): its files (``train.output.OUTPUTS`` names), which the run starting
        again from step 0 replaces (``train.trainer.Trainer.start_output``); else ``[]``.
    """

    def __init__(self, run: Config, out: Path, start: int = 0, extra: dict | None = None, replaces: list[str] | None = None):
        c = run.checkpoint
        self.every, self.steps, self.start, self.extra = c.ckpt_every, run.training.steps, start, extra
        self.replaces = replaces or []  # --resume with no checkpoint: an unfinished run's files, replaced when OUT is written
        self.settings = run_settings(run)
        self.directory = out / SUBDIR
        self.ckpt = zshard.Checkpointer(self.directory, keep=c.keep)

    @property
    def resuming(self) -> bool:
        return self.extra is not None

    def restore(self, model, tx, mesh, batches: BatchStream, **init_kw):
        """The resumed state; seeks ``batches``. Returns ``(state, records)``.

        Raises:
          ResumeError: the checkpoint's files are damaged, or it holds another model.
        """
        try:
            state, extra = self.ckpt.restore(mesh, model=model, tx=tx, step=self.start, **init_kw)
        except (OSError, ValueError) as e:
            where = self.directory / str(self.start)
            raise ResumeError(f"--resume: {e}\n(to resume from the checkpoint before, move {str(where)!r} aside)") from e
        batches.seek(extra["data"])
        return state, list(extra["records"])

    def due(self, step: int) -> bool:
        """Save after ``step``?"""
        return bool(self.every) and (step % self.every == 0 or step == self.steps)

    def save(self, state, step: int, batches: BatchStream, records: list[dict]) -> None:
        """Start writing checkpoint ``step`` (returns before the files are complete)."""
        extra = {"config": self.settings, "data": batches.position(), "records": records}
        self.ckpt.save(state, step=step, extra=extra)

    def compile_save(self, state) -> None:
        """Compile what a save computes on the devices now, so that the first save (a preempted
        run's, within its grace) costs what later ones do (``zshard.Checkpointer.compile_save``)."""
        self.ckpt.compile_save(state)

    def close(self) -> None:
        """Wait for the last save to be complete on disk."""
        self.ckpt.close()


def prepare(run: Config, out: Path, fresh: bool = False) -> RunCheckpoints:
    """Check the checkpoint settings against ``OUT`` before anything compiles.

    Returns the run's checkpoints (also with ``ckpt_every = 0``: a preempted run saves one).
    ``fresh``: the run replaces OUT (``--overwrite``), so its old checkpoints do not count.

    With ``resume`` and no complete checkpoint, the run starts from step 0: in an empty OUT,
    or one that holds an unfinished run (no ``summary.json``, no ``model.safetensors``: killed
    before its first complete checkpoint), whose files it replaces (``replaces``).

    Raises:
      ResumeError: (nothing written) ``OUT`` holds checkpoints and ``resume`` is not set (a
        new run would mix with them); ``resume`` in a run that ended (``summary.json`` or
        ``model.safetensors``) and kept no complete checkpoint (what OUT holds is named, and
        the fixes: ``--out``, ``--init-from OUT``); a resumed run changes a setting that
        changes the numbers (each named with its flag, old -> new); the checkpoint is
        already at ``training.steps``; or its record cannot be read.
    """
    where = out / SUBDIR
    if where.exists() and not where.is_dir():
        raise ResumeError(f"--out: {str(where)!r} is a file; checkpoints need a directory there, give another --out")
    latest = None if fresh else zshard.Checkpointer(where).latest_step()
    if not run.checkpoint.resume:
        if latest is not None:
            raise ResumeError(
                f"--out {str(out)!r} holds checkpoints (latest: step {latest}); pass --resume to continue that run, "
                f"or give a new --out (nothing is overwritten)"
            )
        return RunCheckpoints(run, out)  # ckpt_every 0: no periodic saves, but a preempted run still saves
    if latest is None:
        held = output.earlier_run(out)
        if "summary.json" in held or "model.safetensors" in held:  # the run ended: nothing of it is overwritten
            raise ResumeError(
                f"--resume: {str(out)!r} holds {output.describe_run(out)}, and no complete checkpoint to continue from; "
                f"nothing was changed. Give --out NEW for a new run, or --out NEW --init-from {out} to start one from its weights"
            )
        if held:  # an unfinished run (killed before its first complete checkpoint): its steps are done again, the same
            print(f"--resume: no complete checkpoint in {str(where)!r}; starting again from step 0 (the unfinished run's "
                  f"{', '.join(held)} are replaced)", file=sys.stderr)
        else:
            print(f"--resume: no complete checkpoint in {str(where)!r}; starting from step 0", file=sys.stderr)
        return RunCheckpoints(run, out, replaces=held)
    try:
        extra = zshard.Checkpointer(where).read_extra(latest)
    except (OSError, ValueError) as e:
        raise ResumeError(f"--resume: {e}") from e
    if "config" not in extra:
        raise ResumeError(f"--resume: the checkpoint in {str(where)!r} was written by an older python -m train; give a new --out")
    saved, now = extra["config"], run_settings(run)
    diffs = [f"{flag_of(k)} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
             if not _may_differ(k) and saved.get(k) != now.get(k)]  # fmt: skip
    if diffs:
        raise ResumeError(
            f"--resume: the checkpoint at step {latest} in {str(where)!r} was written with other settings: "
            + "; ".join(diffs) + ". Pass the same ones (only the mesh, strategy, devices, evaluation, logging and "
            "checkpoint settings may change), or give a new --out"
        )
    if latest >= run.training.steps:
        raise ResumeError(f"--resume: the checkpoint in {str(where)!r} is at step {latest}, --steps is {run.training.steps}: "
                          f"the run is finished, nothing to continue and nothing was changed. Give --out NEW for a new run, "
                          f"or --out NEW --init-from {out} to start one from its weights")
    print(f"--resume: continuing from step {latest} ({str(where / str(latest))!r})", file=sys.stderr)
    return RunCheckpoints(run, out, start=latest, extra=extra)
