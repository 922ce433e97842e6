"""The :class:`Trainer` of ``python -m train``: from a validated :class:`train.job.Setup` to a
trained, saved, summarised run.

    trainer = start(argv)           # flags -> devices -> jax.distributed -> validate -> Trainer(setup):
                                    # model, optimizer, sharded state (or the checkpoint), step
                                    # compiled ahead of time, evaluated once; nothing written yet
    trainer.start_output()          # OUT, runs/latest, OUT/config.toml
    progress = trainer.train(interrupts)
    summary = trainer.finish(progress)   # OUT/model.safetensors, OUT/summary.json, one line

The loop runs the step and asks each of its parts whether it is due (``train/hooks.py``):
metrics every step, evaluation, samples and checkpoints at their own cadence. Ctrl-C during
training finishes the step in flight, saves it when checkpointing is on, and ends the loop.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import grain
import jax
from flax import nnx

import zshard
from train import checkpointing, config, data, output, summary
from train.cli import device_count, fail, parse_config
from train.devices import emulate_devices
from train.hooks import Checkpoint, Evaluate, Metrics, Sample
from train.job import Setup, make_optimizer, validate
from train.model import GPT, loss_for, units_with_ends
from train.output import PROG, Interrupts, say, write_atomic

__all__ = ["Progress", "Trainer", "start"]


def start(argv: list[str]) -> "Trainer":
    """Steps 1-3 of a run (``train/__main__.py``): the flags, the emulated devices, ``jax.distributed``,
    the checks (:func:`train.job.validate`) and the compiled :class:`Trainer`, each said in one line."""
    run, config_path = parse_config(argv)
    emulate_devices(device_count(run, argv, config_path))  # before jax starts (the launcher's per-process count stands)
    try:  # before anything touches a device; checks coordinator / num_processes / process_id
        d = run.distributed
        zshard.distributed.initialize(d.coordinator, d.num_processes, d.process_id)
    except (ValueError, RuntimeError, TimeoutError) as e:
        fail(str(e))
    output.WRITES_FILES = jax.process_index() == 0
    setup = validate(run)
    what = "bytes" if run.data.vocab_size is None else f"tokens (vocabulary {run.data.vocab_size})"
    shape = "x".join(str(v) for v in dict(setup.mesh.shape).values())
    axes = " x ".join(setup.mesh.axis_names)
    say(f"{PROG}: {run.model.init_from or run.model.preset + ' GPT'}, {setup.strategy} on a {shape} "
        f"({axes}) mesh of {len(setup.devices)} {setup.devices[0].platform} devices; data: {setup.source}: "
        f"{len(setup.train_data):,} train / {len(setup.eval_data):,} held-out {what}; output: {setup.out}")
    t = Trainer(setup)
    if t.report is not None and output.WRITES_FILES:
        print(t.report.table(), file=sys.stderr)
    n = t.state.plan.num_params()
    if t.start:
        say(f"compiled in {t.compile_s:.1f} s; {n:,} parameters; resumed after step {t.start} "
            f"(eval loss {t.eval_loss0:.4f} at step {t.eval_step0})")
    else:
        say(f"compiled in {t.compile_s:.1f} s; {n:,} parameters; eval loss {t.eval_loss0:.4f} before training")
    return t


@dataclasses.dataclass
class Progress:
    """What the loop did: the final state, the records, the last step trained, timings (s), steps saved."""

    state: object
    records: list
    last: int
    interrupted: bool
    train_s: float
    eval_s: float
    saved: list


class Trainer:
    """The compiled run, before any file is written.

    Attributes:
      setup: the validated :class:`train.job.Setup`.
      state: the sharded train state (``zshard.ShardedState``), fresh or resumed.
      step: the ``zshard.TrainStep``.
      batches: this process's batches (``train.checkpointing.BatchStream``), positioned.
      batch: the first batch of this run (already drawn).
      schedule: the learning-rate schedule (optax), for the ``lr`` of each record.
      warmup: warmup steps.
      records: the metrics records the run continues (a resumed checkpoint's), else ``None``.
      start: the step this run continues after (0 for a fresh run).
      compile_s: seconds to compile the step.
      per_device_bytes: the compiled step's ``memory_analysis()`` (argument/output/temp/alias), or ``None``.
      report: ``zshard.report`` of the step (``--report``), or ``None``.
      evaluate: the :class:`train.hooks.Evaluate` (``evaluate.loss(state)``: the held-out loss).
      sample: the :class:`train.hooks.Sample`.
      checkpoint: the :class:`train.hooks.Checkpoint`, or ``None`` (neither saving nor resuming).
      eval_loss0: the held-out loss this run starts from (measured, or the checkpoint's last).
      eval_step0: the step of ``eval_loss0``.
    """

    def __init__(self, setup: Setup):
        self.setup = setup
        run, ckpt = setup.run, setup.ckpt
        t_cfg = run.training
        tx, self.warmup, self.schedule = make_optimizer(run)
        mp = None
        if t_cfg.param_dtype or t_cfg.reduce_dtype:
            mp = zshard.MixedPrecision(param_dtype=t_cfg.param_dtype, reduce_dtype=t_cfg.reduce_dtype)
        make_model = setup.builder or (lambda: GPT(setup.cfg, rngs=nnx.Rngs(t_cfg.seed)))  # noqa: E731
        shard = grain.sharding.ShardByJaxProcess()  # this process's rows of each global batch
        self.batches = checkpointing.BatchStream(setup.train_data, t_cfg.batch_size, run.model.seq_len, t_cfg.seed,
                                                 process_index=shard.shard_index, process_count=shard.shard_count)
        self.records = None
        unit = units_with_ends if run.mesh.unit == "ends" else None  # None: zshard's default wrap policy (blocks)
        if ckpt is not None and ckpt.resuming:  # state, batch position and records of the checkpoint
            try:
                self.state, self.records = ckpt.restore(make_model, tx, setup.mesh, self.batches, strategy=setup.strategy,
                                                        mixed_precision=mp, unit=unit, offload=run.mesh.offload)
            except checkpointing.ResumeError as e:
                fail(str(e))
        else:
            self.state = zshard.init(make_model, tx, setup.mesh, strategy=setup.strategy, mixed_precision=mp,
                                     params=setup.weights, unit=unit, offload=run.mesh.offload)
        self.start = 0 if ckpt is None else ckpt.start
        loss_fn, has_aux = loss_for(setup.cfg)  # an MoE adds its router's load-balancing loss (metrics["aux"])
        self.step = zshard.make_train_step(loss_fn, has_aux=has_aux, grad_accum=t_cfg.grad_accum, clip_norm=run.optimizer.clip_norm,
                                           skip_nonfinite=t_cfg.skip_nonfinite, remat=t_cfg.remat, prefetch=t_cfg.prefetch)
        self.batch = next(self.batches)

        t0 = time.perf_counter()
        # Ahead-of-time compile for the memory figures; `step(state, batch)` later reuses the
        # compiled executable (JAX caches compilations), it only traces the step once more.
        compiled = self.step.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        self.per_device_bytes = None
        if mem is not None:
            self.per_device_bytes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
        self.report = zshard.report(self.step, self.state, self.batch) if run.logging.report else None

        eval_set = data.eval_batches(setup.eval_data, t_cfg.batch_size, run.model.seq_len, run.data.eval_batches)
        self.evaluate = Evaluate(self.state, eval_set, t_cfg.eval_every, t_cfg.steps, t_cfg.prefetch)
        self.sample = Sample(setup)
        self.checkpoint = None if ckpt is None else Checkpoint(ckpt, self.batches)
        if self.start:  # the checkpointed run's last evaluation
            last = [r for r in self.records if "eval_loss" in r][-1]
            self.eval_loss0, self.eval_step0 = last["eval_loss"], last["step"]
        else:
            self.eval_loss0, self.eval_step0 = self.evaluate.loss(self.state), 0

    def start_output(self) -> None:
        """Create OUT (``--overwrite``: remove the earlier run's files first), point ``runs/latest``
        at it, write ``config.toml``; rank 0 only."""
        setup = self.setup
        out = setup.out
        if not output.WRITES_FILES:
            return
        if setup.run.logging.overwrite and not self.start:
            output.clear_earlier_run(out)
        out.mkdir(parents=True, exist_ok=True)
        if setup.link is not None:
            output.point_latest(setup.link, out)
        (out / "summary.json").unlink(missing_ok=True)  # a resumed run's summary is written again at its end
        header = (f"Resolved configuration of the run in {out}, written by {PROG}.\n"
                  f"Repeat it with: {PROG} --config {out / 'config.toml'} (a new runs/<date-time>, or --out DIR)")
        again = config.Config.from_dict(setup.resolved.to_dict())
        again.logging.out, again.logging.overwrite, again.checkpoint.resume = None, False, False  # where, not what
        write_atomic(out / "config.toml", config.dumps_toml(again, header))

    def train(self, interrupts: Interrupts) -> Progress:
        """Train from step ``start + 1`` to ``training.steps``; each part of the loop runs when due."""
        steps = self.setup.run.training.steps
        metrics = Metrics(self)
        hooks = [h for h in (self.evaluate, self.sample, self.checkpoint) if h is not None]  # this order (module docstring)
        state, batch = self.state, self.batch
        interrupts.training()
        try:
            for i in range(self.start + 1, steps + 1):
                state, step_metrics = self.step(state, batch)  # donates the old `state`
                metrics.dispatched(i, step_metrics)  # reads step i-1's metrics: no per-step sync
                stopping = interrupts.pending
                due = [h for h in hooks if h.due(i, stopping)]
                apart = [h for h in due if h.apart]
                if apart or stopping:
                    rec = metrics.read()
                    with metrics.apart():  # evaluation and sampling time is not training throughput
                        for hook in apart:
                            hook(state, i, rec, metrics)
                for hook in due:
                    if not hook.apart:
                        hook(state, i, metrics.read(), metrics)  # after the evaluation: the records hold step i whole
                metrics.write()  # the records read so far, appended and flushed
                if stopping:
                    break
                if i < steps:
                    batch = next(self.batches)
            metrics.read()
            metrics.write()
        finally:
            if self.checkpoint is not None:
                self.checkpoint.close()  # wait for the last checkpoint to be complete on disk
            metrics.close()
        saved = [] if self.checkpoint is None else self.checkpoint.saved
        return Progress(state, metrics.records, metrics.last, bool(interrupts.pending), time.perf_counter() - metrics.t_train,
                        metrics.eval_s, saved)

    def finish(self, progress: Progress, t_start: float) -> dict:
        """``OUT/model.safetensors``, ``OUT/summary.json`` and the last line (``train/summary.py``);
        ``t_start``: ``time.perf_counter()`` when the program started (for ``wall_s``)."""
        return summary.finish(self, progress, t_start)
