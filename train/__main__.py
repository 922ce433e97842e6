"""``python -m train``: train the byte-level GPT with zshard; metrics, TensorBoard, samples, weights, summary.

    python -m train                                        # defaults: train/configs/default.toml
    python -m train --config train/configs/nano.toml --steps 50 --mesh 2x4

One run, every check before any compile and nothing written until the model has compiled and
been evaluated once:

1. ``train.cli.parse_config``: flags and ``--config FILE`` -> ``train.config.Config``;
   ``train.devices.emulate_devices``: ``mesh.devices`` emulated CPU devices (an accelerator,
   if JAX finds one, is used instead, N capping its devices); ``jax.distributed`` start-up;
2. ``train.job.validate``: the configuration against the data, the devices, OUT and its
   checkpoints -> ``train.job.Setup``;
3. ``train.trainer.Trainer``: the sharded state (or the checkpoint with ``--resume``) and the
   step, compiled ahead of time for its memory figures, evaluated once;
4. ``Trainer.train``: ``OUT/config.toml``, then the steps; metrics, evaluation, samples and
   checkpoints each run when due (``train/hooks.py``);
5. ``Trainer.finish``: ``OUT/model.safetensors``, ``OUT/summary.json`` and one line saying
   what was written where (``train/summary.py``).

Exit status: 0; 2 for bad input (one line naming the key, its flag and the fix), also for a
run that cannot fit in the devices' memory (``train/fit.py``); 130 after Ctrl-C (before
training: at once, nothing written; during training: the step in flight is finished, saved
when checkpointing is on, and the weights and summary are written); 143 after SIGTERM or
SIGUSR1 (before training: at once, nothing written; during training: the step in flight is
finished, a checkpoint saved and the summary written, one line naming the checkpoint)
(``train/stops.py``); 124 when a part of the loop hangs (``train/watchdog.py``). Run folders,
``metrics.jsonl``, resuming and preemption: docs/main-job.md.
"""

from __future__ import annotations

import sys
import time

_T_START = time.perf_counter()  # wall time counts from here (includes importing jax)

from train.stops import EXIT_INTERRUPTED, EXIT_PREEMPTED, Stop, Stops  # noqa: E402  (no jax: the signal handlers come first)


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    stops = Stops()  # first: a signal while importing jax, compiling or evaluating exits at once
    from train.trainer import start  # noqa: PLC0415  (after the signal handlers: importing jax takes seconds)

    try:
        trainer = start(sys.argv[1:] if argv is None else list(argv), stops)
        trainer.start_output()
        progress = trainer.train()
        trainer.finish(progress, _T_START)
    finally:  # a --preempt-grace clean-up under way ends the process 143 itself, with the last line
        stops.outlast()
    return {Stop.NONE: 0, Stop.INTERRUPT: EXIT_INTERRUPTED, Stop.PREEMPT: EXIT_PREEMPTED}[progress.stop]


if __name__ == "__main__":
    sys.exit(main())
