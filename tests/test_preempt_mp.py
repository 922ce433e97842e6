"""``python -m train`` on 2 processes under ``python -m zshard.launch`` (127.0.0.1, gloo). One uninterrupted
run (the module's ``reference``) serves both tests: its output, files and samples are the launcher's CLI
path (rank 0 writes, every line prefixed, both ranks evaluate the same model), its checkpoints resume in
1 process and back in 2 (across process counts), and its numbers are what the preempted runs must end
with. A SIGTERM reaching one process stops both after the same step with one checkpoint; a SIGTERM to the
launcher while compiling stops both at once; each followed by a resume that ends with the uninterrupted
2-process run's numbers, bit for bit. A host that stops (SIGSTOP) is named by its peer's watchdog: the
2-process run that resumes from the 1-process checkpoint (one launch for both checks). One process:
tests/test_preempt.py. The losses of 2 processes against 1 and the reference, on a small model:
tests/test_multiprocess.py."""

from __future__ import annotations

import json
import shutil
import signal
import time
import types
from pathlib import Path

import pytest
from runs import NANO, Run, launch_cmd, step_records, train_main

import zshard

pytestmark = pytest.mark.multiprocess
STEPS = 20  # the first test's 2-process resume from step 8 freezes a process after step 8 + FREEZE_AFTER: room to spare
FREEZE_AFTER = 4  # steps the watchdog's run records before rank 1 stops (a step's limit is the median's from the second on)
CKPT_EVERY = 4
FLAGS = [*NANO, "--strategy", "HYBRID_SHARD", "--steps", str(STEPS)]


def run(corpus: Path, out: Path, *extra: str, launcher: tuple = ()) -> Run:
    return Run(launch_cmd(*FLAGS, "--data", str(corpus), "--out", str(out), *extra, launcher=launcher), timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(((Path(__file__).parent.parent / "README.md").read_bytes() * 20)[:200_000])
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted 2-process run, a checkpoint every 4 steps and a sample after the last step
    (neither changes the numbers): ``SimpleNamespace(run, out, want)``, ``want`` its ``{step: record}``
    as written (the launch test below rewrites ``out``'s checkpoints and metrics afterwards)."""
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run(corpus, out, "--ckpt-every", str(CKPT_EVERY), "--sample-tokens", "4")
    assert r.finish() == 0, r.text[-4000:]
    return types.SimpleNamespace(run=r, out=out, want=step_records(out))


def test_launch_runs_python_m_train_with_rank_0_writing(reference, corpus, capsys):
    # The numbers of 2 processes x 4 against 1 x 8 and the reference are checked on a small model
    # (tests/test_multiprocess.py's two_by_four); this is the CLI path: flags, per-process data, rank 0 output.
    r, out = reference.run, reference.out
    assert f"[rank 1] python -m train: {STEPS} steps; eval loss" in r.text and "rank 0 writes the files" in r.text
    assert f"[rank 0] python -m train: {STEPS} steps; eval loss" in r.text and f"model.safetensors in {out}" in r.text
    lines = [line for line in r.lines if line]  # whole lines (samples may hold \x0b, \x1c, ...: not splitlines())
    assert all(line.startswith(("[rank 0] ", "[rank 1] ", "[zshard.launch] ")) for line in lines), r.text[-4000:]
    assert not [line for line in lines if "[Gloo]" in line]  # library chatter hidden (--verbose shows it)
    assert not any("step/s" in line or "s/step" in line for line in lines if line.startswith("[rank 1]"))  # one bar: rank 0's
    assert (out / "samples.txt").read_text().strip()  # rank 0 wrote the 2-process sample
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 8
    assert summary["mesh"] == {"replica": 2, "shard": 4}  # replica = processes
    assert sorted(reference.want) == list(range(1, STEPS + 1))
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    finals = {line.split("]")[0]: line.split("->")[1].split()[0] for line in r.lines if "nats/byte" in line}
    assert len(finals) == 2 and len(set(finals.values())) == 1  # both ranks evaluated the same model

    # Checkpoints across process counts: step 4 written by 2 processes resumes in 1 process
    # (1x8 FULL_SHARD), whose step 8 resumes again in 2 processes; the losses stay those of
    # the uninterrupted 2-process run. (A 2-process resume on the same mesh, bit for bit, is
    # the next test's last run.)
    want = {s: rec["loss"] for s, rec in reference.want.items()}
    ckpts = out / "checkpoints"
    assert sorted(int(d.name) for d in ckpts.iterdir()) == list(range(CKPT_EVERY, STEPS + 1, CKPT_EVERY))
    resume = [*FLAGS, "--data", str(corpus), "--out", str(out), "--resume"]  # no sample

    def keep_through(step):
        for d in ckpts.iterdir():
            if int(d.name) > step:
                shutil.rmtree(d)

    def same_losses(got, step):
        for k in got:
            assert abs(got[k]["loss"] - want[k]) <= 1e-5 * abs(want[k]), (step, k, got[k]["loss"], want[k])

    # python -m train's main in this process (tests/runs.py's train_main: no import of jax again), to the end
    keep_through(4)
    code = train_main([*resume, "--ckpt-every", str(CKPT_EVERY), "--devices", "8", "--mesh", "1x8", "--strategy", "FULL_SHARD"])
    said = capsys.readouterr()
    assert code == 0, (said.out + said.err)[-4000:]
    assert "--resume: continuing from step 4 " in said.out + said.err
    got = step_records(out)
    assert got.keys() == want.keys()
    same_losses(got, 4)

    # 2 processes resume from the 1-process step 8 (the numbers of its steps, as above); then a host that
    # stops: rank 1 frozen (SIGSTOP) mid-run, rank 0's watchdog names the step and itself. No --ckpt-every:
    # the parts rank 0 may wait in are steps (a save's first limit is 10 x the compile time).
    keep_through(8)
    metrics = out / "metrics.jsonl"
    stale = metrics.stat().st_ino  # steps 1-20 of the 1-process run until this run replaces the file (atomically)
    c = Run(launch_cmd(*resume, "--watchdog", "10", launcher=("--grace", "2")), timeout=300)
    c.wait_for(lambda: metrics.stat().st_ino != stale and len(step_records(out)) >= 8 + FREEZE_AFTER, f"step {8 + FREEZE_AFTER}")
    t = c.signal(signal.SIGSTOP, c.rank_pid(1))
    assert c.finish() == 124, c.text[-4000:]
    assert "--resume: continuing from step 8 " in c.text, c.text[-4000:]
    got = step_records(out)
    assert sorted(got) == list(range(1, max(got) + 1)) and 8 + FREEZE_AFTER <= max(got) < STEPS, sorted(got)
    same_losses(got, 8)
    hung = next(x for x in c.lines if "watchdog" in x and x.startswith("[rank 0]"))
    assert "python -m train: error: watchdog: step " in hung and " has not finished on process 0 of 2 (" in hung, hung
    assert "the main thread waits in " in hung and "exiting with status 124" in hung
    assert "[zshard.launch] rank 0 exited with status 124 (its watchdog: a part of its loop hung)" in c.text
    print(f"2 processes, rank 1 stopped: the watchdog ended the run {time.monotonic() - t:.1f} s later: {hung}")


def test_two_processes_stop_at_one_step_and_resume_bit_for_bit(tmp_path, corpus, reference):
    want = reference.want
    out = tmp_path / "run"

    # 1. SIGTERM to rank 1 alone, while a checkpoint is being written: both stop after the same step
    a = run(corpus, out, "--ckpt-every", str(CKPT_EVERY))
    a.wait_line(f"[rank 0] step {CKPT_EVERY}: saving checkpoint ")
    t = a.signal(signal.SIGTERM, a.rank_pid(1))
    assert a.finish() == 143, a.text[-4000:]
    k = max(step_records(out))
    line0 = next(x for x in a.lines if x.startswith("[rank 0] python -m train: preempted"))
    line1 = next(x for x in a.lines if x.startswith("[rank 1] python -m train: preempted"))
    assert f"preempted by a signal on process 1 after step {k} of {STEPS}: checkpoint {out / 'checkpoints' / str(k)} is complete" in line0
    assert f"preempted by SIGTERM after step {k} of {STEPS}: checkpoint {out / 'checkpoints' / str(k)} is complete" in line1
    assert zshard.Checkpointer(out / "checkpoints").all_steps()[-1] == k
    print(f"2 processes, SIGTERM to rank 1: both saved step {k}; launcher gone {time.monotonic() - t:.2f} s after the signal")

    # 2. SIGTERM to the launcher while the resumed run compiles: forwarded, both exit 143 at once
    b = run(corpus, out, "--resume")
    b.wait_line("[rank 0] python -m train: nano GPT")
    t = b.signal(signal.SIGTERM)
    assert b.finish() == 143, b.text[-4000:]
    for rank in (0, 1):
        assert f"[rank {rank}] python -m train: SIGTERM before training started; nothing was written" in b.text, b.text[-4000:]
    assert "[zshard.launch] SIGTERM: forwarded to every process" in b.text
    assert zshard.Checkpointer(out / "checkpoints").all_steps()[-1] == k
    print(f"2 processes, SIGTERM to the launcher while compiling: gone {time.monotonic() - t:.2f} s after the signal")

    # 3. resumed from the latest complete checkpoint to the end: the uninterrupted run's numbers
    d = run(corpus, out, "--resume")
    assert d.finish() == 0, d.text[-4000:]
    got = step_records(out)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in want:
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            assert got[s].get(key) == want[s].get(key), (s, key, got[s].get(key), want[s].get(key))
