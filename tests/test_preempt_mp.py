"""``python -m train`` on 2 processes under ``python -m zshard.launch`` (127.0.0.1, gloo): a SIGTERM
reaching one process stops both after the same step with one checkpoint; a SIGTERM to the
launcher while compiling stops both at once; a host that stops (SIGSTOP) is named by its peer's
watchdog; each followed by a resume that ends with the uninterrupted 2-process run's numbers,
bit for bit. One process: tests/test_preempt.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from runs import NANO, Run, launch_cmd, step_records

import zshard

pytestmark = pytest.mark.multiprocess
STEPS = 20  # part 3 freezes a process at step k + 6 (k: part 1's stop, about 5): room to spare
FLAGS = [*NANO, "--strategy", "HYBRID_SHARD", "--steps", str(STEPS)]


def run(corpus: Path, out: Path, *extra: str, launcher: tuple = ()) -> Run:
    return Run(launch_cmd(*FLAGS, "--data", str(corpus), "--out", str(out), *extra, launcher=launcher), timeout=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(((Path(__file__).parent.parent / "README.md").read_bytes() * 20)[:200_000])
    return path


def test_two_processes_stop_at_one_step_and_resume_bit_for_bit(tmp_path, corpus):
    ref = tmp_path / "ref"
    r = run(corpus, ref)
    assert r.finish() == 0, r.text[-4000:]
    want = step_records(ref)
    out = tmp_path / "run"

    # 1. SIGTERM to rank 1 alone, while a checkpoint is being written: both stop after the same step
    a = run(corpus, out, "--ckpt-every", "4")
    a.wait_line("[rank 0] step 4: saving checkpoint ")
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

    # 3. a host that stops: rank 1 frozen (SIGSTOP) mid-run; rank 0's watchdog names the step and itself
    c = run(corpus, out, "--resume", "--watchdog", "10", launcher=("--grace", "2"))
    c.wait_for(lambda: len(step_records(out)) >= k + 6, f"step {k + 6}")
    t = c.signal(signal.SIGSTOP, c.rank_pid(1))
    assert c.finish() == 124, c.text[-4000:]
    hung = next(x for x in c.lines if "watchdog" in x and x.startswith("[rank 0]"))
    assert "python -m train: error: watchdog: step " in hung and " has not finished on process 0 of 2 (" in hung, hung
    assert "the main thread waits in " in hung and "exiting with status 124" in hung
    assert "[zshard.launch] rank 0 exited with status 124 (its watchdog: a part of its loop hung)" in c.text
    print(f"2 processes, rank 1 stopped: the watchdog ended the run {time.monotonic() - t:.1f} s later: {hung}")

    # 4. resumed from the latest complete checkpoint to the end: the uninterrupted run's numbers
    d = run(corpus, out, "--resume")
    assert d.finish() == 0, d.text[-4000:]
    got = step_records(out)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in want:
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            assert got[s].get(key) == want[s].get(key), (s, key, got[s].get(key), want[s].get(key))
