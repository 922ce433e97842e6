"""``python -m train`` as users watch it: TensorBoard events, samples, the resolved config
(rerun gives the same losses), ``python -m train.plot``, and Ctrl-C. One subprocess run of the nano
model, shared between the checks (and the Ctrl-C run's); the rerun and the ``unit = "ends"`` run are
``python -m train``'s main in this process (tests/runs.py's ``train_main``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import matplotlib.image
import optax
import pytest

import zshard.checkpoint

from conftest import ROOT
from runs import train_main
STEPS, EVERY, SAMPLE_BYTES = 8, 4, 24
ARGS = ["--config", str(ROOT / "train" / "configs" / "nano.toml"), "--steps", str(STEPS), "--eval-every", str(EVERY),
        "--sample-every", str(EVERY), "--sample-tokens", str(SAMPLE_BYTES), "--seq-len", "32", "--eval-batches", "2", "--warmup", "2", "--lr", "3e-3"]


def train(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]




@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """One finished run: (out directory, completed process)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    res = train(*ARGS, "--data", str(corpus), "--out", str(out), "--report")  # --report: the memory plot shows model state
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_metrics_have_every_field_for_every_step(run):
    out, _ = run
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert {"loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"} <= r.keys()
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
    # the learning rate each step used: optax's schedule at the count before the update
    schedule = optax.warmup_cosine_decay_schedule(1e-3, 3e-3, warmup_steps=2, decay_steps=STEPS, end_value=3e-4)
    assert [r["lr"] for r in steps] == pytest.approx([float(schedule(i)) for i in range(STEPS)], rel=1e-6)
    # warmup 2: lr * (t + 1) / 3, never 0
    assert [r["lr"] for r in steps[:3]] == pytest.approx([1e-3, 2e-3, 3e-3], rel=1e-6)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, EVERY, 2 * EVERY]


def test_tensorboard_events_read_back_with_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "eval/loss", "perf/tokens_per_s", "perf/step_time_s"} <= tags
    records = read_metrics(out)
    want = {r["step"]: r["loss"] for r in records if "loss" in r}
    got = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert got.keys() == want.keys()
    assert all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want)  # float32 in the event file
    assert [e.step for e in acc.Scalars("eval/loss")] == [0, EVERY, 2 * EVERY]


def test_samples_are_printed_and_written(run, corpus):
    out, res = run
    text = (out / "samples.txt").read_text()
    heads = [line for line in text.splitlines() if line.startswith("=== step")]
    assert [h.split(":")[0] for h in heads] == [f"=== step {EVERY}", f"=== step {2 * EVERY}"]
    data = corpus.read_bytes()
    prompt = data[len(data) - int(len(data) * 0.1):][:16].decode()  # start of the held-out split; seq_len 32 -> 16 bytes
    assert all(f"{head}\n{prompt}" in text for head in heads)
    assert heads[0] in res.stdout and prompt in res.stdout


def test_resolved_config_repeats_the_run_exactly(run, tmp_path):
    out, _ = run
    resolved = tomllib.loads((out / "config.toml").read_text())
    assert resolved["mesh"] == {"devices": 8, "shape": "2x4", "strategy": "HYBRID_SHARD", "unit": "blocks"}
    assert resolved["training"]["steps"] == STEPS and resolved["model"]["seq_len"] == 32
    again = tmp_path / "again"
    assert train_main(["--config", out / "config.toml", "--out", again]) == 0  # in this process: the same numbers as the subprocess's
    untimed = lambda records: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s")} for r in records]  # noqa: E731
    assert untimed(read_metrics(again)) == untimed(read_metrics(out))  # losses, grad norms, lr, eval losses: exact
    assert (again / "samples.txt").read_text() == (out / "samples.txt").read_text()


def test_wrap_policy_ends_trains_the_same_model(run, tmp_path):
    """``[mesh] unit = "ends"``: the embedding and the head are units of their own
    (``train.model.units_with_ends``); the same weights, batches and losses as the default
    ``blocks`` policy, to rounding (another grouping of the same sums)."""
    import tomli_w  # noqa: PLC0415

    out, _ = run
    cfg = tomllib.loads((out / "config.toml").read_text())
    cfg["mesh"]["unit"] = "ends"
    cfg["training"]["steps"] = 3  # warmup (2, at most steps - 1) as in the run: its first two steps are these
    cfg["logging"]["sample_tokens"] = 0  # no sample: the losses are what this compares
    path = tmp_path / "ends.toml"
    path.write_text(tomli_w.dumps(cfg))
    assert train_main(["--config", path, "--out", tmp_path / "ends"]) == 0
    ends = [r for r in read_metrics(tmp_path / "ends") if "loss" in r][:2]
    blocks = [r for r in read_metrics(out) if "loss" in r][:2]
    assert [r["step"] for r in ends] == [r["step"] for r in blocks] == [1, 2]
    for a, b in zip(ends, blocks):
        assert a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (a, b)


def test_plot_writes_the_pngs(run, tmp_path):
    from train.plot import load_run, loss_figure, main

    out, _ = run
    fig = loss_figure(*load_run(out))
    train_line, eval_points = fig.axes[0].get_lines()
    assert train_line.get_linestyle() == "-"
    assert eval_points.get_linestyle() == "None" and eval_points.get_marker() == "o"  # evaluations: markers, not joined
    assert list(eval_points.get_xdata()) == [0, EVERY, 2 * EVERY]
    assert main([str(out), "--to", str(tmp_path / "plots")]) == 0
    for name in ("loss.png", "tokens_per_s.png", "memory.png"):
        img = matplotlib.image.imread(tmp_path / "plots" / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing")])
    assert e.value.code == 2


def test_progress_in_a_log_is_plain_lines_and_saving_is_a_phase_of_its_own(run):
    """stderr is a pipe here: one plain line every few steps, never a bar's redraw; the steps'
    progress is closed before the saving starts, and the throughput leaves out what was timed apart."""
    out, res = run
    lines = res.stderr.splitlines()
    assert "\r" not in res.stderr
    progress = [i for i, line in enumerate(lines) if line.startswith("train: step ")]
    assert progress and lines[progress[-1]].startswith(f"train: step {STEPS}/{STEPS}, ")
    saving = [i for i, line in enumerate(lines) if line.startswith("saving: ")]
    assert saving == [len(lines) - 2] and progress[-1] < saving[0], lines[-6:]
    assert str(out / "model.safetensors") in lines[saving[0]]
    s = json.loads((out / "summary.json").read_text())
    assert s["save_s"] == 0 and s["first_save_s"] is None and s["export_s"] > 0  # no checkpoints in this run
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] * STEPS / (s["train_s"] - s["eval_s"] - s["save_s"]))


def test_resume_of_a_finished_run_without_checkpoints_changes_nothing_and_init_from_takes_its_weights(run, tmp_path, capsys, monkeypatch):
    """--resume in a finished run that kept no checkpoint is refused before anything compiles,
    naming what the folder holds and the fixes; every file stays byte for byte. --init-from
    RUN (a path relative to the working folder) starts a new run from its weights: the new run's
    first evaluation is the finished run's last."""
    import hashlib
    import os
    import shutil

    out = tmp_path / "finished"
    shutil.copytree(run[0], out)

    def hashes():
        return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}

    before = hashes()
    assert {"metrics.jsonl", "summary.json", "model.safetensors", "config.toml", "samples.txt"} <= before.keys()
    assert any(k.startswith("tb/") for k in before) and not (out / "checkpoints").exists()
    from test_train import refused  # noqa: PLC0415  (python -m train's checks in this process: exit 2, one line)

    err = refused(["--config", str(out / "config.toml"), "--out", str(out), "--resume"], capsys).strip().splitlines()
    assert err == [f"python -m train: error: --resume: {str(out)!r} holds a finished run ({STEPS} of {STEPS} steps, weights in "
                   "model.safetensors): config.toml, metrics.jsonl, model.safetensors, samples.txt, summary.json, tb/, and no "
                   "complete checkpoint to continue from; nothing was changed. Give --out NEW for a new run, or --out NEW "
                   f"--init-from {out} to start one from its weights"], err
    assert hashes() == before

    new = tmp_path / "new"
    monkeypatch.chdir(ROOT)  # the working folder the relative --init-from is read from (main in this process: runs.train_main)
    assert train_main([*ARGS, "--data", json.loads((out / "summary.json").read_text())["config"]["data"]["path"], "--steps", "1",
                       "--eval-every", "0", "--sample-tokens", "0", "--init-from", os.path.relpath(out, ROOT), "--out", new]) == 0
    first, last = json.loads((new / "summary.json").read_text()), json.loads((out / "summary.json").read_text())
    assert first["initial_eval_loss"] == pytest.approx(last["final_eval_loss"], rel=1e-5)
    assert first["model"]["preset"] is None and first["model"]["init_from"] == str(out)
    assert first["model"]["name"] == f"nano GPT trained in {out} (step {STEPS})"
    assert tomllib.loads((new / "config.toml").read_text())["model"]["init_from"] == str(out)  # absolute: --resume from anywhere
    assert hashes() == before


def test_tensorboard_shows_each_step_once_after_a_resume_and_skips_non_finite_values(tmp_path, caplog):
    """A run resumed from checkpoint k logs steps k+1... again: TensorBoard hides the stopped
    run's events of those steps (purge_step). A NaN loss is left out of the charts, marked by
    train/nonfinite, without tensorboardX's 'NaN or Inf found' warning."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.metrics import TensorBoard

    first = TensorBoard(tmp_path)
    for step in range(1, 6):  # stopped after step 5; its checkpoint is at step 3
        first.log({"step": step, "loss": float(step)})
    first.close()
    time.sleep(1.1)  # event files are named by the second
    resumed = TensorBoard(tmp_path, purge_step=4)
    with caplog.at_level("WARNING"):
        for step in range(4, 8):
            resumed.log({"step": step, "loss": 10.0 * step if step != 6 else float("nan"), "grad_norm": 1.0})
    resumed.close()
    assert not [r for r in caplog.records if "NaN" in r.getMessage()]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (7, 70)]
    assert [(e.step, e.value) for e in acc.Scalars("train/nonfinite")] == [(6, 1.0)]


def test_sample_continues_the_run_with_its_greedy_tokens(run, capsys):
    """``python -m train.sample RUN --temperature 0``: the prompt, then the argmax bytes of the
    run's weights in a plain model (full forwards, no KV cache), as text; the rate last."""
    from flax import nnx

    from test_sample import greedy, run_sample
    from train.model import GPT
    from train.sample import read_source

    out, _ = run
    model = zshard.load_params(out / "model.safetensors", GPT(read_source(out).cfg, rngs=nnx.Rngs(0)))
    want = greedy(model, list(b"def f("), 8)
    text, _ = run_sample(capsys, out, "--prompt", "def f(", "--tokens", 8, "--temperature", 0)
    assert text == bytes(list(b"def f(") + want).decode("utf-8", errors="replace").removesuffix("\n")


def test_ctrl_c_finishes_the_step_saves_writes_the_summary_and_exits_130(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "train", *ARGS, "--steps", "1000000", "--eval-every", "0", "--sample-every", "0", "--ckpt-every", "100000", "--data", str(corpus),
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # "compiled in" is printed once the Ctrl-C handler is installed
            lines.append(line)
            if "compiled in" in line:
                break
        assert any("compiled in" in line for line in lines), "".join(lines)[-3000:]
        # metrics.jsonl is appended while the run goes on (tail -f follows it): each read
        # is a prefix of the next, the same file (inode), every line whole
        seen, inode, deadline = [], None, time.monotonic() + 120
        while len(seen) < 3 and time.monotonic() < deadline:
            path = out / "metrics.jsonl"
            text = path.read_text() if path.exists() else ""
            if text.count("\n") > (seen[-1].count("\n") if seen else 0):
                assert inode in (None, path.stat().st_ino)
                inode = path.stat().st_ino
                assert not seen or text.startswith(seen[-1])
                assert text.endswith("\n") and all(json.loads(line)["step"] >= 0 for line in text.splitlines())
                seen.append(text)
            time.sleep(0.2)
        assert len(seen) == 3, seen
        # one press delivered twice, as a wrapper that forwards the terminal's SIGINT to its child
        # (which the terminal also sent it) does: the same Ctrl-C, not "again, stop at once"
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and 1 <= summary["steps_done"] < 1_000_000
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(1, summary["steps_done"] + 1))
    assert "interrupted after step" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert "interrupted again" not in err
    # the Ctrl-C says one line (the step is being finished), plain progress lines around it, no blank line
    assert [line for line in err.splitlines() if "interrupted:" in line] == [
        "python -m train: interrupted: finishing the step in flight, then saving and writing the summary "
        "(Ctrl-C again to stop at once)"]
    assert "\r" not in err and "" not in err.splitlines()
    assert "no evaluation in this run" in err.strip().splitlines()[-1]  # --eval-every 0: only step 0's
    assert (out / "model.safetensors").exists()
    # checkpointing is on: the interrupted step is saved, and --resume would continue from it
    assert zshard.checkpoint.Checkpointer(out / "checkpoints").all_steps() == [summary["steps_done"]]


def test_a_terminal_of_0_columns_gets_plain_lines_and_samples_are_cut_at_a_resumed_step(tmp_path):
    """A pseudo-terminal whose size was never set reports 0 columns: a bar would draw nothing
    there, so the progress is plain lines; a resume from step k cuts samples.txt after step k."""
    import io
    import os
    import pty

    from train.output import PlainProgress, keep_samples_through, progress_bar

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert tty.isatty() and os.get_terminal_size(slave).columns == 0
            assert isinstance(progress_bar(10, file=tty), PlainProgress)
    finally:
        os.close(master)
        os.close(slave)
    log = io.StringIO()
    bar = PlainProgress(100, desc="train", unit="step", file=log)  # 100 steps: a line every 5
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == [f"train: step {n}/100" for n in [1, *range(5, 101, 5)]]
    path = tmp_path / "samples.txt"
    path.write_text("=== step 4: a ===\nx\n\n=== step 8: b ===\ny\n\n=== step 12: c ===\nz\n\n")
    keep_samples_through(path, 8)
    assert path.read_text() == "=== step 4: a ===\nx\n\n=== step 8: b ===\ny\n\n"
