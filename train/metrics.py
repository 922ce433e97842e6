"""The metrics of ``python -m train``, due every step: ``OUT/metrics.jsonl``, TensorBoard, the progress bar.

``OUT/metrics.jsonl``: one JSON object per step (``loss``, ``grad_norm`` (nats per token, its
gradient's global L2 norm), ``lr``, ``step_time_s`` (s, between the reads of consecutive
steps' metrics), ``tokens_per_s`` (over the last :data:`THROUGHPUT_WINDOW` steps),
``eval_loss`` at evaluations), appended and flushed as each step's metrics are read:
``tail -f`` follows it, and a crash loses at most the step in flight. (``--resume`` first
replaces it, once, with the records of the checkpoint it continues from.) TensorBoard events
go to ``OUT/tb``. Only rank 0 writes (``train.output.WRITES_FILES``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

from train import output
from train.output import PROG, write_atomic

__all__ = ["THROUGHPUT_WINDOW", "Metrics", "MetricsLog", "TensorBoard"]

THROUGHPUT_WINDOW = 10  # steps: metrics' tokens_per_s is measured over this many steps


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
    per step), ``perf/tokens_per_s``, ``perf/step_time_s``. View with
    ``tensorboard --logdir OUT/tb``.
    """

    TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "eval_loss": "eval/loss",
            "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s"}

    def __init__(self, logdir: Path | None):
        self.writer = None
        if logdir is not None:
            self.writer = SummaryWriter(str(logdir), flush_secs=10)

    def log(self, rec: dict) -> None:
        if self.writer is not None:
            for key, tag in self.TAGS.items():
                if key in rec:
                    self.writer.add_scalar(tag, rec[key], rec["step"])

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
    :meth:`apart` (evaluation, samples) left out.
    """

    def __init__(self, trainer):
        run, out = trainer.setup.run, trainer.setup.out
        self.run, self.lrs = run, np.asarray(trainer.schedule(np.arange(run.training.steps)))  # lr of step i: lrs[i - 1]
        self.tokens_per_step = run.training.batch_size * run.model.seq_len  # tokens (bytes for text)
        self.records = list(trainer.records) if trainer.start else [{"step": 0, "eval_loss": trainer.eval_loss0}]
        self.log = MetricsLog(out / "metrics.jsonl")
        self.log.start(self.records)
        self.tb = TensorBoard(out / "tb" if run.logging.tensorboard and output.WRITES_FILES else None)
        if not trainer.start:
            self.tb.log(self.records[0])
        self.bar = tqdm(total=run.training.steps, initial=trainer.start, desc="train", unit="step", dynamic_ncols=True,
                        file=sys.stderr, disable=not output.WRITES_FILES)
        self.t_train = self.t_last = time.perf_counter()
        self.recent: list[float] = []  # seconds per step, the last THROUGHPUT_WINDOW steps
        self.eval_s = 0.0  # time spent apart (evaluating and sampling) inside the loop, s
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
        rec.update({k: float(v) for k, v in metrics.get("aux", {}).items()})  # e.g. an MoE's router_aux_loss
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

    @contextlib.contextmanager
    def apart(self):
        """Time spent inside is not training throughput (added to ``eval_s``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.eval_s += time.perf_counter() - t0
            self.t_last = time.perf_counter()

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
        self.bar.close()
        self.tb.close()
        self.log.close()
