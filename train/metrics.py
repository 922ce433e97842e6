"""The metrics of ``python -m train``, due every step: ``OUT/metrics.jsonl``, TensorBoard, the progress bar.

``OUT/metrics.jsonl``: one JSON object per step (``loss``, ``grad_norm`` (nats per token, its
gradient's global L2 norm), ``lr``, ``step_time_s`` (s, between the reads of consecutive
steps' metrics), ``tokens_per_s`` (over the last :data:`THROUGHPUT_WINDOW` steps),
``eval_loss`` at evaluations; an MoE's ``router_aux_loss``, ``router_z_loss``, ``cross_entropy``,
``expert_load`` (a list: each expert's share of the routed slots) and ``dropped_fraction``:
:func:`train.models.moe_loss`), appended and flushed as each step's metrics are read:
``tail -f`` follows it, and a crash loses at most the step in flight. (``--resume`` first
replaces it, once, with the records of the checkpoint it continues from.) TensorBoard events
go to ``OUT/tb``. Only rank 0 writes (``train.output.WRITES_FILES``).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter
from train import output
from train.output import PROG, write_atomic

__all__ = ["THROUGHPUT_WINDOW", "Metrics", "MetricsLog", "TensorBoard", "aux_record"]

THROUGHPUT_WINDOW = 10  # steps: metrics' tokens_per_s is measured over this many steps


def aux_record(aux: dict) -> dict:
    """A step's ``metrics["aux"]`` as JSON values: scalars as floats, arrays (an MoE's
    ``expert_load`` ``[E]``) as lists of floats, plus ``max_expert_load`` = ``E * max(expert_load)``
    (1: every expert as loaded as the mean; the most loaded expert's excess otherwise)."""
    rec = {}
    for k, v in aux.items():
        a = np.asarray(v, np.float64)
        rec[k] = float(a) if a.ndim == 0 else a.tolist()
    if "expert_load" in rec:
        load = np.asarray(rec["expert_load"])
        rec["max_expert_load"] = float(load.max() * load.size)
    return rec


class MetricsLog:
    """``OUT/metrics.jsonl``, append-only: one JSON object per line, each line flushed as written.

    :meth:`start` replaces the file once (atomically) with the records a run starts from
    (the step-0 evaluation, or a resumed checkpoint's records); :meth:`write` appends
    ``records[n:]`` for the records not yet written. Rank 0 only.
    """

    def __init__(self, path: Path):
        self.path, self.file, self.written = path, None, 0

    def start(self, records: list[dict]) -> None:
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in records))
        self.written = len(records)
        if output.WRITES_FILES:
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, records: list[dict]) -> None:
        new, self.written = records[self.written :], len(records)
        if self.file is not None and new:
            self.file.write("".join(json.dumps(r) + "\n" for r in new))
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class TensorBoard:
    """Scalars to TensorBoard event files in ``OUT/tb`` (``tensorboardX.SummaryWriter``), or nothing.

    Tags: ``train/loss``, ``train/grad_norm``, ``train/lr``, ``eval/loss`` (nats per byte,
    per step), ``perf/tokens_per_s``, ``perf/step_time_s``, an MoE's ``moe/router_aux_loss``,
    ``moe/router_z_loss``, ``moe/max_expert_load``, ``moe/dropped_fraction``, and ``train/nonfinite`` (1 at a
    step whose loss or gradient norm was NaN or infinite: those values are left out, charts
    cannot draw them). View with ``tensorboard --logdir OUT/tb``.

    Args:
      logdir: ``OUT/tb``, or ``None`` for nothing.
      purge_step: a run resumed from checkpoint ``k`` passes ``k + 1``: TensorBoard hides the
        earlier events of steps >= ``k + 1`` (those a stopped run logged after its checkpoint,
        logged again now), so each step shows once (``SummaryWriter(purge_step=...)``).
    """

    TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "eval_loss": "eval/loss",
            "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "router_aux_loss": "moe/router_aux_loss",
            "router_z_loss": "moe/router_z_loss", "max_expert_load": "moe/max_expert_load", "dropped_fraction": "moe/dropped_fraction"}

    def __init__(self, logdir: Path | None, purge_step: int | None = None):
        self.writer = None
        if logdir is not None:
            self.writer = SummaryWriter(str(logdir), flush_secs=10, purge_step=purge_step)

    def log(self, rec: dict) -> None:
        if self.writer is None:
            return
        nonfinite = False
        for key, tag in self.TAGS.items():
            if key in rec:
                if math.isfinite(rec[key]):
                    self.writer.add_scalar(tag, rec[key], rec["step"])
                else:
                    nonfinite = True
        if nonfinite:
            self.writer.add_scalar("train/nonfinite", 1.0, rec["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Metrics:
    """Each step's ``loss``, ``grad_norm``, ``lr``, ``step_time_s`` and ``tokens_per_s``, as records.

    ``records`` starts from the step-0 evaluation (or a resumed checkpoint's records);
    :meth:`dispatched` is called right after step ``i`` is queued and reads step ``i - 1``;
    :meth:`read` waits for the step in flight. Step time is between the reads of consecutive
    steps' metrics; with asynchronous dispatch one step's time can land on its neighbour, so
    ``tokens_per_s`` is over the last :data:`THROUGHPUT_WINDOW` steps, time spent
    :meth:`apart` (evaluation, samples, starting a checkpoint save) left out, of the progress
    bar's rate too.

    The progress (rank 0): a ``tqdm`` bar on a terminal, else one plain line every few steps
    (``train.output.progress_bar``); :meth:`end_progress` closes it after the last step, so the
    saving that follows is a phase of its own and its time is no step's.
    """

    def __init__(self, trainer):
        run, out = trainer.setup.run, trainer.setup.out
        self.run, self.lrs = run, np.asarray(trainer.schedule(np.arange(run.training.steps)))  # lr of step i: lrs[i - 1]
        self.tokens_per_step = run.training.batch_size * run.model.seq_len  # tokens (bytes for text)
        self.records = list(trainer.records) if trainer.start else [{"step": 0, "eval_loss": trainer.eval_loss0}]
        self.log = MetricsLog(out / "metrics.jsonl")
        self.log.start(self.records)
        self.tb = TensorBoard(out / "tb" if run.logging.tensorboard and output.WRITES_FILES else None,
                              purge_step=trainer.start + 1 if trainer.start else None)  # resumed: the later steps once
        if not trainer.start:
            self.tb.log(self.records[0])
        self.bar = output.progress_bar(run.training.steps, trainer.start, desc="train", unit="step",
                                       disable=not output.WRITES_FILES)
        self.t_train = self.t_last = time.perf_counter()
        self.t_end = None  # perf_counter() when the last step's metrics were read (end_progress)
        self.recent: list[float] = []  # seconds per step, the last THROUGHPUT_WINDOW steps
        self.apart_s: dict[str, float] = {}  # s spent apart inside the loop, by hook kind (evaluation, sample, checkpoint)
        self.pending = None  # (step number, metrics) dispatched but not yet read
        self.last = trainer.start  # the last step whose metrics were read

    def dispatched(self, step: int, metrics) -> None:
        """Step ``step`` is queued: read the one before it (which finishes meanwhile)."""
        if self.pending is not None:
            self._record(*self.pending)
        self.pending = (step, metrics)

    def read(self) -> dict:
        """Wait for the step in flight, record it; returns the newest record."""
        if self.pending is not None:
            self._record(*self.pending)
            self.pending = None
        return self.records[-1]

    def _record(self, i: int, metrics) -> None:
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        now = time.perf_counter()
        self.recent.append(now - self.t_last)
        del self.recent[:-THROUGHPUT_WINDOW]
        rec = {"step": i, "loss": loss, "grad_norm": grad_norm, "lr": float(self.lrs[i - 1]),
               "tokens_per_s": self.tokens_per_step * len(self.recent) / sum(self.recent), "step_time_s": now - self.t_last}
        rec.update(aux_record(metrics.get("aux", {})))  # an MoE's router losses, expert load, dropped fraction
        t_cfg = self.run.training
        nonfinite = int(metrics["nonfinite"])  # the same on every device (reduced over the mesh)
        if nonfinite:
            rec["skipped"] = int(t_cfg.skip_nonfinite)
        self.t_last, self.last = now, i
        self.records.append(rec)
        self.tb.log(rec)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
        self.bar.update(1)
        if nonfinite and not t_cfg.skip_nonfinite:
            self.write()
            self.close()
            raise SystemExit(
                f"{PROG}: error: non-finite loss {loss} / grad norm {grad_norm} at step {i}; lower --lr "
                f"(now {self.run.optimizer.lr}), add --clip-norm, or pass --skip-nonfinite to skip such steps"
            )

    @property
    def eval_s(self) -> float:
        """Seconds spent evaluating and sampling inside the loop."""
        return self.apart_s.get("evaluation", 0.0) + self.apart_s.get("sample", 0.0)

    @property
    def save_s(self) -> float:
        """Seconds the loop spent starting checkpoint saves (the first compiles; the writes go on in the background)."""
        return self.apart_s.get("checkpoint", 0.0)

    @contextlib.contextmanager
    def apart(self, kind: str = "evaluation"):
        """Time spent inside is not training throughput, nor the progress bar's rate (added to
        ``apart_s[kind]``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            now = time.perf_counter()
            self.apart_s[kind] = self.apart_s.get(kind, 0.0) + now - t0
            output.pause_progress(self.bar, now - t0)
            self.t_last = now

    def end_progress(self) -> None:
        """The steps are over: close the progress (its rate stays that of the steps); what
        follows (waiting for the last checkpoint, the weights) is saving, timed apart."""
        if self.t_end is None:
            self.t_end = time.perf_counter()
            self.bar.close()

    def write(self) -> None:
        """Append the records read so far to ``OUT/metrics.jsonl`` (flushed)."""
        self.log.write(self.records)

    def print_above_bar(self, text: str) -> None:
        """``text`` on stdout without breaking the progress bar (rank 0)."""
        if output.WRITES_FILES:
            self.bar.clear()
            print(text, flush=True)
            self.bar.refresh()

    def close(self) -> None:
        self.end_progress()
        self.tb.close()
        self.log.close()
