"""The :class:`Trainer` of ``python -m train``: from a validated :class:`train.job.Setup` to a
trained, saved, summarised run.

    trainer = start(argv, stops)    # flags -> devices -> jax.distributed -> validate -> Trainer(setup):
                                    # model, optimizer, sharded state (or the checkpoint), step
                                    # compiled ahead of time, fit-checked, evaluated once; nothing written yet
    trainer.start_output()          # OUT, runs/latest, OUT/config.toml
    progress = trainer.train()
    summary = trainer.finish(progress)   # OUT/model.safetensors, OUT/summary.json, one line

The loop runs the step and asks each of its parts whether it is due (``train/hooks.py``):
metrics every step, evaluation, samples and checkpoints at their own cadence; a watchdog
times each part (``train/watchdog.py``). A stop (``train/stops.py``: Ctrl-C, SIGTERM,
SIGUSR1), agreed by every process (``train/preempt.py``), finishes the step in flight, saves
it (always after SIGTERM / SIGUSR1, with checkpointing on after Ctrl-C) and ends the loop.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time

import grain
import jax
from flax import nnx

import zshard
from train import checkpointing, config, data, fit, output, summary
from train.cli import device_count, fail, parse_config
from train.planning.auto import choose, take_auto
from train.devices import emulate_devices
from train.hooks import Checkpoint, Evaluate, Metrics, Sample
from train.job import Setup, make_optimizer, validate
from train.model import build_model, expert_plan, loss_for, tensor_plan, units_with_ends
from train.output import PROG, say, write_atomic
from train.preempt import StopAgreement, discard_half_written, latest_complete, wait_on_thread
from train.stops import Stop, Stops
from train.watchdog import Watchdog

__all__ = ["Progress", "Trainer", "start"]


def start(argv: list[str], stops: Stops) -> "Trainer":
    """Steps 1-3 of a run (``train/__main__.py``): the flags, the emulated devices, ``jax.distributed``,
    the checks (:func:`train.job.validate`) and the compiled :class:`Trainer`, each said in one line.
    ``stops``: the signal handling installed first (its handlers again after ``jax.distributed``)."""
    try:  # --auto: the plan search chooses the mesh, strategy, remat and accumulation (train/planning/auto.py)
        argv, auto = take_auto(argv)
    except ValueError as e:
        fail(str(e))
    run, config_path = parse_config(argv)
    emulate_devices(device_count(run, argv, config_path))  # before jax starts (the launcher's per-process count stands)
    # jax.distributed's preemption service would take SIGTERM (its handler replaces ours, and
    # the process then ignores the signal); train/preempt.py agrees on the stop instead
    jax.config.update("jax_enable_preemption_service", False)
    try:  # before anything touches a device; checks coordinator / num_processes / process_id
        d = run.distributed
        if zshard.distributed.initialize(d.coordinator, d.num_processes, d.process_id):
            stops.install()  # ours again, should a jax version install a handler all the same
    except (ValueError, RuntimeError, TimeoutError) as e:
        fail(str(e))
    output.WRITES_FILES = jax.process_index() == 0
    if auto:
        try:
            auto = choose(run, jax.devices()[: max(run.mesh.devices, 1)], log=say)
        except ValueError as e:
            fail(str(e))
    setup = validate(run)
    if setup.ckpt.resuming:
        stops.before_training = (f"nothing was written; {setup.ckpt.directory / str(setup.ckpt.start)} stays the latest "
                                 f"checkpoint (--resume continues from it)")
    what = "bytes" if run.data.vocab_size is None else f"tokens (vocabulary {run.data.vocab_size})"
    shape = "x".join(str(v) for v in dict(setup.mesh.shape).values())
    axes = " x ".join(setup.mesh.axis_names)
    say(f"{PROG}: {setup.model['name']}, {setup.strategy} on a {shape} "
        f"({axes}) mesh of {len(setup.devices)} {setup.devices[0].platform} devices; data: {setup.source}: "
        f"{len(setup.train_data):,} train / {len(setup.eval_data):,} held-out {what}; output: {setup.out}")
    t = Trainer(setup, stops)
    t.auto = auto or None  # summary.json's "auto": the choice, predicted and measured step_s
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
    stop: Stop  # why the loop ended early (agreed by every process), Stop.NONE when it ran every step
    train_s: float  # s, from the first step to the last step's metrics (evaluations and saves inside included)
    eval_s: float  # s of train_s spent evaluating and sampling
    saved: list
    save_s: float = 0.0  # s of train_s spent starting checkpoint saves (the first one's compile included)
    first_save_s: float | None = None  # s the first save held the loop (None: no save)
    save_wait_s: float = 0.0  # s after the last step, waiting for the last checkpoint to be complete

    @property
    def interrupted(self) -> bool:
        return bool(self.stop)


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
      fit_check_s: seconds the fit check took (``train/fit.py``; 0 with ``--no-fit-check``).
      save_compile_s: seconds compiling the save ahead (``--preempt-grace`` set; else 0).
      stops: the :class:`train.stops.Stops`; agreement: the :class:`train.preempt.StopAgreement`.
      saved_at: ``time.monotonic()`` when the stop's checkpoint was complete, else ``None``.
    """

    def __init__(self, setup: Setup, stops: Stops):
        self.setup, self.stops, self.saved_at = setup, stops, None
        run, ckpt = setup.run, setup.ckpt
        t_cfg = run.training
        tx, self.warmup, self.schedule = make_optimizer(run)
        mp = run.mixed_precision()  # [training] dtypes and [precision] formats
        make_model = setup.builder or (lambda: build_model(setup.cfg, nnx.Rngs(t_cfg.seed)))  # noqa: E731
        shard = grain.sharding.ShardByJaxProcess()  # this process's rows of each global batch
        self.batches = checkpointing.BatchStream(setup.train_data, t_cfg.batch_size, run.model.seq_len, t_cfg.seed,
                                                 process_index=shard.shard_index, process_count=shard.shard_count)
        self.records = None
        unit = units_with_ends if run.mesh.unit == "ends" else None  # None: zshard's default wrap policy (blocks)
        # the model's Megatron plan over the tensor axis (train.models.tensor_plan), {} without one; refused in train.job.validate
        plan = tensor_plan(setup.cfg, dict(setup.mesh.shape).get("tensor", 1))
        # the experts over the expert axis (train.models.expert_plan; refused in train.job.validate): only with the axis
        experts = expert_plan(setup.cfg, run.expert())
        ep = {"expert_parallel": experts} if experts else {}
        if ckpt is not None and ckpt.resuming:  # state, batch position and records of the checkpoint
            try:
                self.state, self.records = ckpt.restore(make_model, tx, setup.mesh, self.batches, strategy=setup.strategy,
                                                        mixed_precision=mp, unit=unit, tensor_parallel=plan,
                                                        offload=run.mesh.offload, **ep)
            except checkpointing.ResumeError as e:
                fail(str(e))
        else:
            try:  # zshard refuses a combination before compiling (e.g. an expert axis with NO_SHARD): one line, no traceback
                self.state = zshard.init(make_model, tx, setup.mesh, strategy=setup.strategy, mixed_precision=mp,
                                         params=setup.weights, unit=unit, tensor_parallel=plan,
                                         offload=run.mesh.offload, **ep)
            except ValueError as e:
                fail(f"strategy (--strategy) {setup.strategy} on the mesh {dict(setup.mesh.shape)}: {e}")
        self.start = 0 if ckpt is None else ckpt.start
        loss_fn, has_aux = loss_for(setup.cfg)  # an MoE adds its router's load-balancing loss (metrics["aux"])
        # mesh.context > 1: each (inputs, targets) sequence split over context (docs/long-sequences.md)
        sequence_axis = 1 if run.context() > 1 else None
        self.step = zshard.make_train_step(loss_fn, has_aux=has_aux, grad_accum=t_cfg.grad_accum, clip_norm=run.optimizer.clip_norm,
                                           skip_nonfinite=t_cfg.skip_nonfinite, remat=t_cfg.remat, prefetch=t_cfg.prefetch,
                                           sequence_axis=sequence_axis, hpz=t_cfg.hpz)
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
        eval_set = data.eval_batches(setup.eval_data, t_cfg.batch_size, run.model.seq_len, run.data.eval_batches)
        self.evaluate = Evaluate(self.state, eval_set, t_cfg.eval_every, t_cfg.steps, t_cfg.prefetch, sequence_axis)
        self.fit_check_s = 0.0
        if t_cfg.fit_check:  # before the first evaluation and the first step: a run that cannot fit stops here
            t0 = time.perf_counter()
            eval_mem = self.evaluate.compiled.memory_analysis()
            eval_bytes = None if eval_mem is None else {k: int(getattr(eval_mem, f"{k}_size_in_bytes"))
                                                        for k in ("argument", "output", "temp", "alias")}
            refusal = fit.check(run, setup.strategy, self.per_device_bytes, eval_bytes, setup.devices)
            self.fit_check_s = time.perf_counter() - t0
            if refusal is not None:
                fail(refusal)
        self.report = zshard.report(self.step, self.state, self.batch) if run.logging.report else None
        self.sample = Sample(setup)
        self.checkpoint = None if ckpt is None else Checkpoint(ckpt, self.batches)
        self.agreement = StopAgreement(stops)  # several processes: compiles its all-gather here
        self.save_compile_s = 0.0
        if run.checkpoint.preempt_grace is not None:  # a grace to keep: the first save must not compile
            t0 = time.perf_counter()
            ckpt.compile_save(self.state)
            self.save_compile_s = time.perf_counter() - t0
        stops.set_deadline(run.checkpoint.preempt_grace, self._deadline)
        if self.start:  # the checkpointed run's last evaluation
            last = [r for r in self.records if "eval_loss" in r][-1]
            self.eval_loss0, self.eval_step0 = last["eval_loss"], last["step"]
        else:
            self.eval_loss0, self.eval_step0 = self.evaluate.loss(self.state), 0

    def _deadline(self) -> str:
        """``--preempt-grace`` ran out (the deadline thread; the process ends after): remove what
        is half-written (process 0), and say which checkpoint a ``--resume`` continues from."""
        where = self.setup.ckpt.directory
        writers = wait_on_thread(self.setup.ckpt.ckpt.wait_until_finished)  # Orbax's writers, failed on the blockers
        removed = discard_half_written(where, self.checkpoint.saved, writers_done=writers) if jax.process_index() == 0 and self.checkpoint else []
        latest = latest_complete(where)
        if removed:  # also when the stop's own checkpoint was complete: an earlier save may have been cut short
            gone = f"removed the half-written {', '.join(str(where / n) for n in removed)}; "
        elif self.saved_at is not None:
            gone = f"the stop's checkpoint {where / str(self.checkpoint.saved[-1])} is complete; "
        else:
            gone = "no new checkpoint; "
        if latest is None:
            return gone + "there is no complete checkpoint: the run starts again from step 0"
        return gone + f"the latest complete checkpoint is {where / str(latest)} (--resume continues from it)"

    def start_output(self) -> None:
        """Create OUT (``--overwrite``: remove the earlier run's files first), point ``runs/latest``
        at it, write ``config.toml``; rank 0 only. From here on a signal stops the loop after a step."""
        setup = self.setup
        out = setup.out
        self.stops.training()
        if not output.WRITES_FILES:
            return
        if (setup.run.logging.overwrite and not self.start) or (setup.ckpt is not None and setup.ckpt.replaces):
            output.clear_earlier_run(out)  # --overwrite, or --resume of an unfinished run with no checkpoint
        out.mkdir(parents=True, exist_ok=True)
        if self.start:  # resumed from checkpoint k: the samples of later steps are drawn again
            output.keep_samples_through(out / "samples.txt", self.start)
        if setup.link is not None:
            output.point_latest(setup.link, out)
        (out / "summary.json").unlink(missing_ok=True)  # a resumed run's summary is written again at its end
        header = (f"Resolved configuration of the run in {out}, written by {PROG}.\n"
                  f"Repeat it with: {PROG} --config {out / 'config.toml'} (a new runs/<date-time>, or --out DIR)")
        again = config.Config.from_dict(setup.resolved.to_dict())
        again.logging.out, again.logging.overwrite, again.checkpoint.resume = None, False, False  # where, not what
        write_atomic(out / "config.toml", config.dumps_toml(again, header))

    def train(self) -> Progress:
        """Train from step ``start + 1`` to ``training.steps``; each part of the loop runs when due."""
        steps = self.setup.run.training.steps
        metrics = Metrics(self)
        hooks = [h for h in (self.evaluate, self.sample, self.checkpoint) if h is not None]  # this order (module docstring)
        state, batch, stopping, done = self.state, self.batch, Stop.NONE, False
        process = f"process {jax.process_index()} of {jax.process_count()} ({socket.gethostname()}, pid {os.getpid()})"
        watchdog = Watchdog(self.setup.run.training.watchdog, self.compile_s, process)
        try:
            for i in range(self.start + 1, steps + 1):
                watchdog.enter("step", i)
                state, step_metrics = self.step(state, batch)  # donates the old `state`
                metrics.dispatched(i, step_metrics)  # reads step i-1's metrics: no per-step sync
                stopping = self.agreement.poll()  # the same on every process
                due = [h for h in hooks if h.due(i, stopping)]
                if due or stopping:
                    rec = metrics.read()  # the evaluation first: a checkpoint's records hold step i whole
                    for hook in due:
                        watchdog.enter(hook.kind, i)
                        with metrics.apart(hook.kind):  # not training throughput
                            hook(state, i, rec, metrics)
                watchdog.enter("step", i, timed=False)  # the rest of iteration i
                metrics.write()  # the records read so far, appended and flushed
                if stopping:
                    break
                if i < steps:
                    batch = next(self.batches)
            metrics.read()
            metrics.write()
            done = True
        finally:
            metrics.end_progress()  # the steps are over: saving is a phase of its own, timed apart
            t_save = time.perf_counter()
            if done:
                self._say_saving(stopping)
            if self.checkpoint is not None:
                watchdog.enter("checkpoint wait", metrics.last)
                self.checkpoint.close()  # wait for the last checkpoint to be complete on disk (every process)
                if stopping:
                    self.saved_at = time.monotonic()
            watchdog.close()
            metrics.close()
        saved = [] if self.checkpoint is None else self.checkpoint.saved
        first = None if self.checkpoint is None else self.checkpoint.first_s
        return Progress(state, metrics.records, metrics.last, stopping, metrics.t_end - metrics.t_train, metrics.eval_s,
                        saved, metrics.save_s, first, time.perf_counter() - t_save)

    def _say_saving(self, stopping: Stop) -> None:
        """The line that starts the saving phase: the last checkpoint's background writes, the weights."""
        what = []
        if self.checkpoint is not None and self.checkpoint.saved:
            what.append(f"checkpoint {self.setup.ckpt.directory / str(self.checkpoint.saved[-1])} (its background writes)")
        if stopping != Stop.PREEMPT:  # a preempted run writes no weights (train/summary.py)
            what.append(str(self.setup.out / "model.safetensors"))
        if what:
            say(f"saving: {', then '.join(what)}")

    def finish(self, progress: Progress, t_start: float) -> dict:
        """``OUT/model.safetensors``, ``OUT/summary.json`` and the last line (``train/summary.py``);
        ``t_start``: ``time.perf_counter()`` when the program started (for ``wall_s``)."""
        return summary.finish(self, progress, t_start)
