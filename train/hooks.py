"""The periodic parts of ``python -m train``'s loop, each deciding when it is due (the metrics,
due every step, are ``train/metrics.py``).

- :class:`Evaluate`: the held-out loss every ``training.eval_every`` steps and after the last,
  on the sharded state (``zshard.make_eval_step``).
- :class:`Sample`: text every ``logging.sample_every`` steps and after the last
  (``train.generate``, sharded), to the terminal and ``OUT/samples.txt``; none when
  ``logging.sample_tokens`` is 0.
- :class:`Checkpoint`: ``OUT/checkpoints/<step>`` every ``checkpoint.ckpt_every`` steps, after
  the last, when Ctrl-C stops the run (if checkpointing is on) and when SIGTERM / SIGUSR1 does
  (always) (``train/checkpointing.py``, asynchronous).

A hook has ``due(step, stopping)`` (``stopping``: the :class:`train.stops.Stop` every process
acts on after this step) and ``hook(state, step, record, metrics)``; each is timed apart from
training throughput (``Metrics.apart(kind)``: evaluation, samples, and the part of a
checkpoint save that holds the loop, the first one's compile included); ``kind`` names the
part for the watchdog (``train/watchdog.py``) and the summary's times. ``train.trainer.Trainer`` runs them in this order, so a
checkpoint's records hold the step's evaluation. A stopped run skips the evaluation and the
sample of its last step (a preempted run has little time).
"""

from __future__ import annotations

import time

import jax
import numpy as np

import zshard
from train import data, output
from train.generate import continue_tokens
from train.metrics import Metrics
from train.model import cross_entropy_loss
from train.output import say
from train.stops import Stop

__all__ = ["Checkpoint", "Evaluate", "Sample", "every"]


def every(n: int, steps: int, step: int) -> bool:
    """The cadence of evaluations, samples and checkpoints: every ``n`` steps (``0``: never) and after step ``steps``."""
    return step == steps or bool(n and step % n == 0)


class Evaluate:
    """``loss(state) -> float``: mean next-token cross-entropy (nats) over the held-out batches.

    Runs the sharded, forward-only ``zshard.make_eval_step`` (each unit gathered just in time,
    never the whole model on one device); ``compiled`` is the compiled eval step (its
    ``memory_analysis()`` goes to the summary).

    Args:
      state: a ``zshard.ShardedState``.
      batches: global ``(inputs, targets)`` pairs, int32 ``[B, T]`` each (with several
        processes, each passes its own rows ``[i*B/P, (i+1)*B/P)`` to the step).
      every: ``training.eval_every`` (0: only before the first and after the last step).
      steps: ``training.steps``.
      prefetch: units gathered ahead (``training.prefetch``, as the train step).
      sequence_axis: ``1`` on a ``context`` mesh: each sequence split over it, as the train step
        (``zshard.make_eval_step(..., sequence_axis=1)``); ``None``: rows only.
    """

    kind = "evaluation"

    def __init__(self, state, batches: list, every: int, steps: int, prefetch: int | None = None, sequence_axis=None):
        i, procs = jax.process_index(), jax.process_count()
        self.batches = [tuple(x[i * (len(x) // procs):(i + 1) * (len(x) // procs)] for x in b) for b in batches]
        self.every, self.steps = every, steps
        self.step = zshard.make_eval_step(cross_entropy_loss, prefetch=prefetch, sequence_axis=sequence_axis)
        self.compiled = self.step.lower(state, self.batches[0]).compile()

    def loss(self, state) -> float:
        return float(np.mean([float(self.step(state, b)["loss"]) for b in self.batches]))

    def due(self, step: int, stopping: Stop = Stop.NONE) -> bool:
        return not stopping and every(self.every, self.steps, step)

    def __call__(self, state, step: int, rec: dict, metrics: Metrics) -> None:
        rec["eval_loss"] = self.loss(state)
        metrics.tb.log({"step": step, "eval_loss": rec["eval_loss"]})
        say(f"step {step}: train loss {rec['loss']:.4f}, eval loss {rec['eval_loss']:.4f}")


class Sample:
    """``logging.sample_tokens`` tokens after the prompt, every ``logging.sample_every`` steps and
    after the last; printed and appended to ``OUT/samples.txt``.

    Sharded generation with a KV cache (``train.generate.generate``: each unit gathered per
    decoding step, never the whole model). The prompt is ``logging.prompt`` (bytes, or token
    ids of a token file) or the first ``min(64, seq_len / 2)`` held-out tokens. The context is
    at most ``seq_len`` tokens: when it is full, generation continues from the last
    ``seq_len // 2``. Greedy when ``temperature == 0``; the draws depend only on the seed
    ``training.seed + step`` (and the chunk). ``logging.sample_tokens == 0``: never due (no
    sample, no ``samples.txt``).
    """

    kind = "sample"

    def __init__(self, setup):
        run = setup.run
        lg = run.logging
        self.out, self.seq_len, self.prefetch = setup.out, run.model.seq_len, run.training.prefetch
        self.every, self.steps, self.seed = lg.sample_every, run.training.steps, run.training.seed
        self.n, self.temperature = lg.sample_tokens, lg.temperature
        self.byte_level = run.data.vocab_size is None  # else a token file: samples are token ids
        if lg.prompt is not None:
            self.prompt = list(lg.prompt.encode()) if self.byte_level else data.parse_token_prompt(lg.prompt, run.data.vocab_size)
        else:
            self.prompt = [int(t) for t in setup.eval_data[: min(64, run.model.seq_len // 2)]]

    def sample(self, state, prompt: list[int], n: int, temperature: float, seed: int) -> list[int]:
        """``n`` token ids generated after ``prompt`` (``train.generate.continue_tokens``)."""
        return continue_tokens(state, prompt, n, seq_len=self.seq_len, temperature=temperature, seed=seed, prefetch=self.prefetch)

    def due(self, step: int, stopping: Stop = Stop.NONE) -> bool:
        return self.n > 0 and not stopping and every(self.every, self.steps, step)

    def __call__(self, state, step: int, rec: dict, metrics: Metrics) -> None:
        new = self.sample(state, self.prompt, self.n, self.temperature, self.seed + step)
        text = output.format_sample(step, self.prompt, new, self.temperature, self.byte_level)
        if output.WRITES_FILES:
            metrics.print_above_bar(text)
            with open(self.out / "samples.txt", "a", encoding="utf-8") as f:
                f.write(f"{text}\n")


class Checkpoint:
    """Save ``OUT/checkpoints/<step>`` (``train.checkpointing.RunCheckpoints``, in the background)
    every ``checkpoint.ckpt_every`` steps, after the last, at a Ctrl-C stop when checkpointing
    is on and at every SIGTERM / SIGUSR1 stop; the state, the batch stream's position and the
    records so far. ``saved``: the steps saved (begun). ``first_s``: seconds the first save held
    the loop (it compiles the programs that gather each parameter's logical layout; later saves
    only copy to the host), ``None`` before it; its line says so."""

    kind = "checkpoint"  # the writes go on in the background; the part that holds the loop is timed apart

    def __init__(self, ckpt, batches):
        self.ckpt, self.batches, self.saved, self.first_s = ckpt, batches, [], None

    def due(self, step: int, stopping: Stop = Stop.NONE) -> bool:
        return self.ckpt.due(step) or stopping == Stop.PREEMPT or (bool(stopping) and bool(self.ckpt.every))

    def __call__(self, state, step: int, rec: dict, metrics: Metrics) -> None:
        self.saved.append(step)  # first: a --preempt-grace deadline during the save removes its folder
        t0 = time.perf_counter()
        self.ckpt.save(state, step, self.batches, metrics.records)  # `batches` has drawn `step` batches
        first = ""
        if self.first_s is None:
            self.first_s = time.perf_counter() - t0
            first = f"; this first save held the loop {self.first_s:.1f} s, its compile included, not counted as training"
        say(f"step {step}: saving checkpoint {self.ckpt.directory / str(step)} (in the background{first})")

    def close(self) -> None:
        """Wait for the last checkpoint to be complete on disk."""
        self.ckpt.close()
