"""What ``python -m train`` writes and prints: run folders, append-only metrics, TensorBoard,
one-line messages, and Ctrl-C at any moment (docs/main-job.md).

Only rank 0 of a multi-process run writes files and prints progress (:data:`WRITES_FILES`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

PROG = "python -m train"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
RUNS = Path("runs")  # default parent of run folders; RUNS / "latest" links to the newest
OUTPUTS = ("metrics.jsonl", "summary.json", "config.toml", "samples.txt", "tb", "checkpoints", "model.safetensors",
           "loss.png", "tokens_per_s.png", "memory.png")
"""What a run (and ``python -m train.plot``) writes into OUT; ``--overwrite`` removes these only."""

WRITES_FILES = True
"""False on every process but rank 0 of a multi-process run (``python -m train`` sets it)."""


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``path.tmp`` and ``os.replace``: never half-written (rank 0 only)."""
    if not WRITES_FILES:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
        if WRITES_FILES:
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
            from tensorboardX import SummaryWriter  # noqa: PLC0415

            self.writer = SummaryWriter(str(logdir), flush_secs=10)

    def log(self, rec: dict) -> None:
        if self.writer is not None:
            for key, tag in self.TAGS.items():
                if key in rec:
                    self.writer.add_scalar(tag, rec[key], rec["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Interrupts:
    """Ctrl-C (SIGINT) at any moment: exit 130 with one line, nothing half-written.

    Before training (:meth:`training` not yet called) a Ctrl-C exits at once, even while XLA
    compiles: a thread waits on ``signal.set_wakeup_fd``, which the C-level handler writes
    to even when the main thread is inside a long native call (where a Python handler
    would only run after it). Nothing has been written then. During training the first
    Ctrl-C sets :attr:`pending` (the loop finishes the step in flight, saves and writes
    the summary); a second one exits at once.
    """

    def __init__(self):
        self.count, self.in_training, self.pending = 0, False, False
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._read = r
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        signal.signal(signal.SIGINT, self._handler)
        threading.Thread(target=self._watch, daemon=True, name="ctrl-c").start()

    def _handler(self, signum, frame) -> None:  # main thread, between bytecodes
        self.pending = True
        if self.in_training and self.count < 2:
            say(f"{PROG}: interrupted: finishing the step in flight, then saving and writing the summary "
                "(Ctrl-C again to stop at once)")

    def _watch(self) -> None:  # its own thread: runs even while the main thread compiles
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            for signum in data:
                if signum != signal.SIGINT:
                    continue
                self.count += 1
                if not self.in_training:
                    self.exit("interrupted before training started; nothing was written")
                if self.count >= 2:
                    self.exit("interrupted again: stopped at once (files written so far are complete)")

    def training(self) -> None:
        """From here on the first Ctrl-C finishes the step in flight."""
        self.in_training = True
        if self.count:  # arrived between the last check and now
            self.exit("interrupted before training started; nothing was written")

    @staticmethod
    def exit(message: str) -> None:
        try:
            sys.stderr.write(f"\n{PROG}: {message}\n")
            sys.stderr.flush()
        finally:
            os._exit(EXIT_INTERRUPTED)


def format_sample(step: int, prompt: list[int], new: list[int], temperature: float, byte_level: bool) -> str:
    """One sample of ``samples.txt`` (and the terminal): a ``=== step ... ===`` header, then the text.

    ``byte_level`` (vocabulary 256, bytes data): prompt and generated bytes decoded as UTF-8
    (invalid sequences as U+FFFD; a token >= 256, from a fine-tuned checkpoint's larger
    vocabulary, as ``?``). Otherwise (a token file): there is no tokenizer to decode with, so
    the token ids are written, space-separated, the prompt's and the generated ones on two lines
    (``prompt: 464 2068 ...`` / ``sample: 7586 ...``).
    """
    if byte_level:
        head = f"=== step {step}: {len(new)} bytes after a {len(prompt)}-byte prompt, temperature {temperature} ==="
        body = bytes(t if t < 256 else ord("?") for t in [*prompt, *new]).decode("utf-8", errors="replace")
    else:
        head = f"=== step {step}: {len(new)} tokens after a {len(prompt)}-token prompt, temperature {temperature} (token ids) ==="
        body = f"prompt: {' '.join(map(str, prompt))}\nsample: {' '.join(map(str, new))}"
    return f"{head}\n{body}\n"


def say(msg: str) -> None:
    """One line on stderr, above the progress bar (``tqdm.write``); rank 0 only."""
    if WRITES_FILES:
        from tqdm import tqdm  # noqa: PLC0415

        tqdm.write(msg, file=sys.stderr)


def choose_out(run, stamp: str) -> tuple[Path, Path | None]:
    """The output folder and the ``runs/latest`` link to point at it (``None``: leave the link).

    ``logging.out`` if set; else with ``--resume`` the folder ``runs/latest`` points at; else a
    new ``runs/<stamp>``. Raises ``ValueError`` (a usage error) when OUT exists and is not a
    folder, or holds an earlier run's files without ``--overwrite`` / ``--resume``.
    """
    lg, resume = run.logging, run.checkpoint.resume
    if lg.out is not None:
        out, link = Path(lg.out), None
    elif resume:
        latest = RUNS / "latest"
        if not latest.exists():
            raise ValueError(f"--resume without --out continues {latest}, which does not exist; give --out DIR of the run to continue")
        out, link = latest.resolve(), None
    else:
        out, link = RUNS / stamp, RUNS / "latest"
        if out.exists():
            raise ValueError(f"{out} exists already (two runs started in the same second?); give --out DIR")
    if out.exists() and not out.is_dir():
        raise ValueError(f"logging.out (--out) {str(out)!r} exists and is not a directory; give a directory path")
    earlier = sorted(name for name in OUTPUTS if (out / name).exists())
    if earlier and not (resume or lg.overwrite):
        raise ValueError(
            f"--out {str(out)!r} holds an earlier run ({', '.join(earlier)}); pass --overwrite to replace it, "
            "--resume to continue it, or give another --out (without --out each run gets a new runs/<date-time>)"
        )
    return out, link


def clear_earlier_run(out: Path) -> None:
    """``--overwrite``: remove an earlier run's outputs (:data:`OUTPUTS` only) from ``out``."""
    import shutil  # noqa: PLC0415

    for name in OUTPUTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def point_latest(link: Path, out: Path) -> None:
    """``runs/latest`` -> ``out`` (relative link, replaced atomically); left alone if it is a real folder."""
    if link.exists() and not link.is_symlink():
        say(f"note: {link} is a folder (from an older version), not a link; the newest run is {out}")
        return
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(out, link.parent))
    os.replace(tmp, link)
