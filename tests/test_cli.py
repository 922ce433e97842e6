"""``python -m train`` as users watch it: TensorBoard events, samples, the resolved config
(rerun gives the same losses), ``python -m train.plot``, and Ctrl-C. Three subprocess runs
of the nano model, shared between the checks."""

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
    res = train("--config", str(out / "config.toml"), "--out", str(again))
    assert res.returncode == 0, res.stderr[-3000:]
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
    path = tmp_path / "ends.toml"
    path.write_text(tomli_w.dumps(cfg))
    res = train("--config", str(path), "--out", str(tmp_path / "ends"))
    assert res.returncode == 0, res.stderr[-3000:]
    ends = [r for r in read_metrics(tmp_path / "ends") if "loss" in r][:2]
    blocks = [r for r in read_metrics(out) if "loss" in r][:2]
    assert [r["step"] for r in ends] == [r["step"] for r in blocks] == [1, 2]
    for a, b in zip(ends, blocks):
        assert a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (a, b)


def test_plot_writes_the_pngs(run, tmp_path):
    from train.plot import main

    out, _ = run
    assert main([str(out), "--to", str(tmp_path / "plots")]) == 0
    for name in ("loss.png", "tokens_per_s.png", "memory.png"):
        img = matplotlib.image.imread(tmp_path / "plots" / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing")])
    assert e.value.code == 2


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
    assert "no evaluation in this run" in err.strip().splitlines()[-1]  # --eval-every 0: only step 0's
    assert (out / "model.safetensors").exists()
    # checkpointing is on: the interrupted step is saved, and --resume would continue from it
    assert zshard.checkpoint.Checkpointer(out / "checkpoints").all_steps() == [summary["steps_done"]]
