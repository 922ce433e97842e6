"""Checkpoints for ``python -m train``: the flags, exact resume, and the batch stream's position.

``--ckpt-every N`` saves ``OUT/checkpoints/<step>`` every ``N`` steps and after the last
one (asynchronously, :class:`zshard.checkpoint.Checkpointer`); ``--keep K`` keeps the
``K`` newest; ``--resume`` continues from the newest complete checkpoint in ``OUT``.

Resume is exact: a checkpoint holds, besides the sharded state, the batch stream's
position (batches drawn and the numpy ``PCG64`` state), the metrics records so far and the
run's flags. A resumed run draws the same batches, applies the same updates and writes
the same ``metrics.jsonl`` losses as one that never stopped. It may run on another mesh or
strategy (``--mesh``, ``--strategy``, ``--devices``); every flag that changes the numbers
(model, data, batch, learning-rate schedule, seed, ...) must match, or the run stops
before compiling with the differing flags named.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grain
import numpy as np

from train import data

__all__ = ["BatchStream", "RunCheckpoints", "add_arguments", "prepare"]

SUBDIR = "checkpoints"
"""Checkpoints live in ``OUT/checkpoints/<step>``."""

MAY_DIFFER_ON_RESUME = frozenset(
    {"devices", "mesh", "strategy", "zero_stage", "report", "out", "ckpt_every", "keep", "resume", "eval_every", "eval_batches",
     "config", "tensorboard", "sample_every", "sample_tokens", "prompt", "temperature", "prefetch",
     "coordinator", "num_processes", "process_id"}
)
"""Flags a resumed run may change: where and how it runs, not what it computes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``checkpoints`` flag group: ``--ckpt-every``, ``--keep``, ``--resume``."""
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--ckpt-every", metavar="N", type=_nonnegative_int, default=0,
                   help="save a checkpoint to OUT/checkpoints/<step> every N steps and after the last (0: never); "
                   "written in the background, restorable on any mesh and strategy")
    g.add_argument("--keep", metavar="K", type=_positive_int, default=None,
                   help="keep only the K newest checkpoints (default: all)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in OUT/checkpoints (exact: same batches, "
                   "same losses); starts from step 0 if there is none")  # fmt: skip


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


_nonnegative_int, _positive_int = _int_at_least(0), _int_at_least(1)


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


def _run_config(args: argparse.Namespace) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (str, int, float, bool, type(None)))}


class RunCheckpoints:
    """The checkpoints of one ``python -m train`` run in ``OUT/checkpoints``.

    Attributes:
      every: steps between saves (0: only with ``--resume``, never saving).
      start: the step the run starts after (0, or the resumed checkpoint's step).
      extra: the resumed checkpoint's ``extra`` (``None`` when starting fresh).
    """

    def __init__(self, args: argparse.Namespace, out: Path, start: int = 0, extra: dict | None = None):
        from zshard.checkpoint import Checkpointer  # noqa: PLC0415

        self.every, self.steps, self.start, self.extra = args.ckpt_every, args.steps, start, extra
        self.config = _run_config(args)
        self.ckpt = Checkpointer(out / SUBDIR, keep=args.keep)

    @property
    def resuming(self) -> bool:
        return self.extra is not None

    def restore(self, model, tx, mesh, batches: BatchStream, **init_kw):
        """The resumed state; seeks ``batches``. Returns ``(state, records)``."""
        try:
            state, extra = self.ckpt.restore(mesh, model=model, tx=tx, step=self.start, **init_kw)
        except (OSError, ValueError) as e:  # damaged files, another model: exit 2 like any bad flag
            where = self.ckpt.directory / str(self.start)
            print(f"python -m train: error: --resume: {e}\n(to resume from the checkpoint before, move "
                  f"{str(where)!r} aside)", file=sys.stderr)
            raise SystemExit(2) from e
        batches.seek(extra["data"])
        return state, list(extra["records"])

    def due(self, step: int) -> bool:
        """Save after ``step``?"""
        return bool(self.every) and (step % self.every == 0 or step == self.steps)

    def save(self, state, step: int, batches: BatchStream, records: list[dict]) -> None:
        """Start writing checkpoint ``step`` (returns before the files are complete)."""
        extra = {"run": self.config, "data": batches.position(), "records": records}
        self.ckpt.save(state, step=step, extra=extra)

    def close(self) -> None:
        """Wait for the last save to be complete on disk."""
        self.ckpt.close()


def prepare(parser: argparse.ArgumentParser, args: argparse.Namespace, out: Path) -> RunCheckpoints | None:
    """Check the checkpoint flags against ``OUT`` before anything compiles.

    Returns ``None`` when the run neither saves nor resumes. Exits (``parser.error``, status
    2, nothing written) when ``OUT`` holds checkpoints and ``--resume`` is not given (a new
    run would mix with them), when a resumed run changes a flag that changes the numbers,
    or when the checkpoint is already at ``--steps``.
    """
    from zshard.checkpoint import Checkpointer  # noqa: PLC0415

    where = out / SUBDIR
    if where.exists() and not where.is_dir():
        parser.error(f"--out: {str(where)!r} is a file; checkpoints need a directory there, give another --out")
    ckpt = Checkpointer(where)
    latest = ckpt.latest_step()
    if not args.resume:
        if latest is not None:
            parser.error(
                f"--out {str(out)!r} holds checkpoints (latest: step {latest}); pass --resume to continue that run, "
                f"or give a new --out (nothing is overwritten)"
            )
        return RunCheckpoints(args, out) if args.ckpt_every else None
    if latest is None:
        print(f"--resume: no complete checkpoint in {str(where)!r}; starting from step 0", file=sys.stderr)
        return RunCheckpoints(args, out)
    try:
        extra = ckpt.read_extra(latest)
    except (OSError, ValueError) as e:
        parser.error(f"--resume: {e}")
    saved, now = extra.get("run", {}), _run_config(args)
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
             if k not in MAY_DIFFER_ON_RESUME and saved.get(k) != now.get(k)]  # fmt: skip
    if diffs:
        parser.error(
            f"--resume: the checkpoint at step {latest} in {str(where)!r} was written with other flags: "
            + "; ".join(diffs) + ". Pass the same flags (only the mesh, strategy, devices, evaluation and "
            "checkpoint flags may change), or give a new --out"
        )
    if latest >= args.steps:
        parser.error(f"--resume: the checkpoint in {str(where)!r} is at step {latest}, --steps is {args.steps}: nothing to do")
    print(f"--resume: continuing from step {latest} ({str(where / str(latest))!r})", file=sys.stderr)
    return RunCheckpoints(args, out, start=latest, extra=extra)
