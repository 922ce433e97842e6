"""``python -m train`` on a cluster, one process: SIGTERM at several moments saves, a ``--preempt-grace``
too short leaves nothing half-written, and each resumes bit for bit (one chain of runs on one OUT); a run
that cannot fit is refused before its first step; the watchdog, the fit check's numbers and the removal
of half-written checkpoints as units. The processes are what is checked (exit statuses, last lines,
signals), except the uninterrupted reference, the last resume and the fit check's refusal, which run
``python -m train``'s main in this process (tests/runs.py's ``train_main``: the same numbers, bit for bit,
tests/test_cli.py).
Multi-process: tests/test_preempt_mp.py."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from runs import NANO, Run, step_records, train_cmd, train_main

import zshard
from train import fit
from train.cli import parse_config
from train.config import ConfigError
from train.preempt import discard_half_written, latest_complete, wait_on_thread
from train.watchdog import Watchdog

STEPS = 100
SIGNAL_AFTER = 3  # steps in metrics.jsonl before the signal goes


def run_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return train_cmd(*NANO, "--steps", str(STEPS), "--data", str(corpus), "--out", str(out), *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The uninterrupted run (in this process, tests/runs.py's ``train_main``): ``{step: record}``."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert train_main(run_args(corpus, out)[3:]) == 0  # without [python, -m, train]
    return step_records(out)


def _same_numbers(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for k in want:  # bit for bit: floats read back from JSON exactly
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            assert got[k].get(key) == want[k].get(key), (k, key, got[k].get(key), want[k].get(key))


def _complete(out: Path) -> list[int]:
    return zshard.Checkpointer(out / "checkpoints").all_steps()


def test_sigterm_mid_step_while_compiling_during_a_save_and_past_the_grace_then_resume_is_bit_for_bit(tmp_path, corpus, reference, capsys):
    out = tmp_path / "run"
    # 1. mid-step: the step in flight finishes, a checkpoint is saved (no --ckpt-every), exit 143, one line
    a = Run(run_args(corpus, out))
    a.wait_for(lambda: len(step_records(out)) >= SIGNAL_AFTER, f"{SIGNAL_AFTER} steps")
    t = a.signal(signal.SIGTERM)
    assert a.finish() == 143, a.text[-3000:]
    exit_s = time.monotonic() - t
    k = max(step_records(out))
    last = a.lines[-1]
    assert last.startswith(f"python -m train: preempted by SIGTERM after step {k} of {STEPS}: checkpoint "
                           f"{out / 'checkpoints' / str(k)} is complete"), a.text[-3000:]
    assert "continue with the same flags and --resume" in last and "Traceback" not in a.text
    assert _complete(out) == [k] and sorted(step_records(out)) == list(range(1, k + 1))
    summary = (out / "summary.json").read_text()
    assert '"preempted": true' in summary and '"weights": null' in summary
    assert not (out / "model.safetensors").exists()  # the checkpoint holds everything; the grace is short
    print(f"SIGTERM mid-step: checkpoint {k} complete; process gone {exit_s:.2f} s after the signal")

    # 2. while compiling the resumed run: exit 143 at once, nothing written, the checkpoint stays the latest
    before = (out / "metrics.jsonl").read_bytes()
    b = Run(run_args(corpus, out, "--resume"))
    b.wait_line("python -m train: nano GPT")  # printed after validation, before the state is built and compiled
    t = b.signal(signal.SIGTERM)
    assert b.finish() == 143, b.text[-3000:]
    assert f"--resume: continuing from step {k} " in b.text
    assert b.lines[-1] == (f"python -m train: SIGTERM before training started; nothing was written; "
                           f"{out / 'checkpoints' / str(k)} stays the latest checkpoint (--resume continues from it)"), b.text[-3000:]
    assert (out / "metrics.jsonl").read_bytes() == before and _complete(out) == [k]
    print(f"SIGTERM while compiling: gone {time.monotonic() - t:.2f} s after the signal")

    # 3. during a checkpoint save: the signal (SIGUSR1, as SLURM's --signal=USR1@...) right after a periodic save started
    c = Run(run_args(corpus, out, "--resume", "--ckpt-every", "3"))
    c.wait_line(": saving checkpoint ")
    c.signal(signal.SIGUSR1)
    assert c.finish() == 143, c.text[-3000:]
    k2 = max(step_records(out))
    assert k2 > k and "preempted by SIGUSR1 after step" in c.lines[-1]
    assert _complete(out)[-1] == k2 and not [p for p in (out / "checkpoints").iterdir() if not p.name.isdigit()]

    # 4. a --preempt-grace too short for the save in flight: exit 143 with the deadline's line, nothing
    # half-written (Orbax's temporary folders removed, the complete checkpoints kept)
    e = Run(run_args(corpus, out, "--resume", "--ckpt-every", "2", "--preempt-grace", "0.05"))
    e.wait_for(lambda: any(": saving checkpoint " in x for x in e.lines) and len(step_records(out)) >= k2 + 4, f"step {k2 + 4}")
    e.signal(signal.SIGTERM)
    assert e.finish() == 143, e.text[-3000:]
    last = e.lines[-1]
    assert last.startswith("python -m train: --preempt-grace 0.05 s after SIGTERM ran out: "), e.text[-3000:]
    k3 = _complete(out)[-1]
    assert k3 >= k2 and f"the latest complete checkpoint is {out / 'checkpoints' / str(k3)}" in last
    left = [p.name for p in (out / "checkpoints").iterdir() if not p.name.isdigit()]
    assert not left, left  # Orbax's temporary folders removed; the complete ones stay
    print(f"deadline line: {last}")

    # 5. resumed to the end from the latest complete checkpoint: the uninterrupted run's numbers, bit for bit
    # (python -m train's main in this process, as the reference: the numbers are what is checked here; a
    # resumed process's exit status 0: tests/test_preempt_mp.py's last run)
    code = train_main(run_args(corpus, out, "--resume")[3:])
    said = capsys.readouterr()
    assert code == 0, (said.out + said.err)[-3000:]
    assert f"--resume: continuing from step {k3} " in said.err
    _same_numbers(step_records(out), reference)
    assert (out / "model.safetensors").exists()


def test_fit_check_refuses_a_too_long_sequence_before_any_step(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"  # one window of seq_len + 1 in the held-out 10%
    corpus.write_bytes(((Path(__file__).parent.parent / "README.md").read_bytes() * 200)[:1_200_000])
    out = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exited:  # main in this process (train.cli.fail: SystemExit(2), as the process exits)
        train_main(["--model", "nano", "--seq-len", "100000", "--data", str(corpus), "--out", str(out)])
    said = capsys.readouterr()
    text = said.out + said.err
    assert exited.value.code == 2, text[-3000:]
    wall = time.monotonic() - t0
    last = said.err.strip().splitlines()[-1]  # python -m train: error: ... is the last line on stderr, alone
    assert last.startswith("python -m train: error: the run does not fit: the compiled step needs "), text[-3000:]
    for needle in ("GiB per device", "argument", "temp", "cpu devices", "the host's", "emulated devices", "temp (activations) is the largest part",
                   "--grad-accum 2", "--seq-len 50000", "--no-fit-check"):
        assert needle in last, (needle, last)
    assert "compiled in" not in text and not out.exists()  # before the first evaluation and step: nothing written
    print(f"fit check refusal {wall:.1f} s after start: {last}")


def test_fit_check_names_gpu_limits_and_the_state_fixes():
    class Gpu:
        platform, process_index = "gpu", 0

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 1}

    run = parse_config(["--strategy", "NO_SHARD", "--batch-size", "16"])[0]
    mem = {"argument": 70 * 2**30, "output": 70 * 2**30, "alias": 70 * 2**30, "temp": 20 * 2**30}
    line = fit.check(run, "NO_SHARD", mem, None, [Gpu()] * 8)
    assert line.startswith("the run does not fit: the compiled step needs 90.00 GiB per device"), line
    assert "each gpu device has 80.00 GiB (memory_stats()['bytes_limit'])" in line
    assert "argument (the model state) is the largest part: try --strategy FULL_SHARD" in line
    assert fit.check(run, "NO_SHARD", dict(mem, argument=50 * 2**30), None, [Gpu()] * 8) is None  # 70 GiB: fits
    mem2 = dict(mem, argument=1 * 2**30, temp=100 * 2**30)
    hybrid = fit.fixes(parse_config(["--remat", "none"])[0], "HYBRID_SHARD", mem2, 8)
    assert hybrid[0] == "--remat block (recompute each block in backward)" and hybrid[-1] == "more devices"
    assert any("HYBRID_SHARD_OPT" in f for f in hybrid)


def test_cpu_side_is_the_hosts_memory_or_its_cgroup_limit(tmp_path):
    """A CPU device has the host's memory (or the cgroup limit) over the emulated devices, not
    what is free that second: a run that fits is never refused because the page cache filled
    a cgroup (the free-memory reading said 0.8 MiB on a CI machine and refused a nano run)."""
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{12 * 2**30}\n")
    (v2 / "memory.current").write_text(f"{12 * 2**30 - 2**20}\n")  # full of page cache: read, not used
    assert fit._cgroup_limit(v2) == 12 * 2**30
    (v2 / "memory.max").write_text("max\n")
    assert fit._cgroup_limit(v2) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # v1's "no limit"
    assert fit._cgroup_limit(v1) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{8 * 2**30}\n")
    assert fit._cgroup_limit(v1) == 8 * 2**30
    host = fit.host_memory_bytes()
    assert host is not None and host >= 2**30 and (fit._cgroup_limit() is None or host <= fit._cgroup_limit())
    mem = {"argument": 2**20, "output": 2**20, "alias": 2**20, "temp": 2**19}
    cpus = [type("Cpu", (), {"platform": "cpu", "process_index": 0})()] * 8
    got = fit.local_fit(mem, None, cpus)
    assert (got.need, got.have, got.host, got.devices) == (3 * 2**19, host // 8, host, 8)
    assert fit.check(parse_config([])[0], "FULL_SHARD", mem, None, cpus) is None
    line = fit.check(parse_config([])[0], "FULL_SHARD", dict(mem, temp=host), None, cpus)
    assert f"each of the 8 cpu devices has {fit._b(host // 8)} (the host's {fit._b(host)}, shared by 8 emulated devices)" in line


def test_watchdog_names_the_part_the_step_and_the_process():
    fired = []
    done = threading.Event()

    def on_hang(message):
        fired.append(message)
        done.set()

    dog = Watchdog(0.3, first_s=0.001, process="process 3 of 4 (host-b, pid 42)", on_hang=on_hang)
    for i in range(1, 6):  # normal steps: 10 ms each, far under the 0.3 s floor
        dog.enter("step", i)
        time.sleep(0.01)
    assert dog.limit("step")[0] == pytest.approx(0.3)
    dog.enter("evaluation", 5)
    time.sleep(0.01)
    dog.enter("step", 6)
    assert done.wait(10), "the watchdog did not fire on a stalled step"
    (message,) = fired
    assert message.startswith("error: watchdog: step 6 has not finished on process 3 of 4 (host-b, pid 42) after "), message
    assert "(limit 0.3 s: 10 x the median step time " in message and "at least 0.3 s;" in message, message
    assert "the main thread waits in" in message and "exiting with status 124" in message
    dog.close()
    dog2 = Watchdog(1.0, first_s=0.001, on_hang=fired.append)
    dog2.durations["step"] = [0.5, 0.4, 0.6]
    assert dog2.limit("step") == (5.0, "10 x the median step time 0.5 s, at least 1 s")
    dog2.close()
    assert len(fired) == 1
    assert Watchdog(0, first_s=1.0).limit("step")[0] == 10.0  # 0: no thread, limits still defined


def test_discard_half_written_removes_only_the_given_steps_in_progress(tmp_path):
    d = tmp_path / "checkpoints"
    for name in ("4", "6.orbax-checkpoint-tmp-1796000000", "9.orbax-checkpoint-tmp-1796000001"):
        (d / name / "state").mkdir(parents=True)
        (d / name / "state" / "data").write_bytes(b"x" * 100)
    assert discard_half_written(d, [6, 8]) == ["6.orbax-checkpoint-tmp-1796000000"]
    assert sorted(p.name for p in d.iterdir()) == ["4", "9.orbax-checkpoint-tmp-1796000001"]
    assert latest_complete(d) == 4 and latest_complete(tmp_path / "none") is None


def test_discard_half_written_outlasts_writes_in_flight_and_a_save_starting_late(tmp_path):
    """Orbax's writer threads create the step folder again on their next write (tensorstore makes
    parent folders), and the main thread may start the save just after the grace ran out."""
    d = tmp_path / "checkpoints"
    (d / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    stop = threading.Event()

    def writer():  # a write every 2 ms into the folder, as until its first failure
        while not stop.is_set():
            try:
                (d / "6.orbax-checkpoint-tmp" / "state" / "d").mkdir(parents=True, exist_ok=True)
            except OSError:
                return
            time.sleep(0.002)

    def late_save():
        time.sleep(0.02)
        (d / "8.orbax-checkpoint-tmp" / "state").mkdir(parents=True)

    threads = [threading.Thread(target=writer), threading.Thread(target=late_save)]
    for t in threads:
        t.start()
    removed = discard_half_written(d, [6, 8])
    stop.set()
    for t in threads:
        t.join()
    assert sorted(removed) == ["6.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp"]
    assert sorted(p.name for p in d.iterdir()) == []


def test_discard_half_written_waits_for_the_writers_before_removing_its_blockers(tmp_path):
    """CI on a loaded machine left ``6.orbax-checkpoint-tmp``: a write queued behind the load
    came 0.3 s after the last pass (six settle periods), once the blockers were gone, and
    created the folder again; the save itself was begun after the deadline thread first read
    the list of steps. The blockers now stay until the writers have ended."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    steps = [4]  # the caller's list: step 6 is appended while the discard runs
    ended = threading.Event()

    def save():
        time.sleep(0.01)
        steps.append(6)
        (d / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
        time.sleep(0.3)  # the queued write
        try:
            (d / "6.orbax-checkpoint-tmp" / "state" / "d").mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # failed on the blocker: the save has ended
        ended.set()

    t = threading.Thread(target=save)
    t.start()
    removed = discard_half_written(d, steps, writers_done=wait_on_thread(ended.wait))
    t.join()
    assert removed == ["6.orbax-checkpoint-tmp"]
    assert sorted(p.name for p in d.iterdir()) == []
    assert not wait_on_thread(lambda: time.sleep(1))(0.01)  # the wait is bounded


_SAVE_BROKEN_BY_THE_CLEAN_UP = """
import os, signal, sys, time, types
from train.__main__ import main
from train.stops import Stop

import logging, threading
log = logging.getLogger("orbax-like")  # a handler holding the real stderr stream, as absl's does
log.addHandler(logging.StreamHandler(sys.stderr))

def noise():  # another thread's traceback, written at any moment, until the process ends
    while True:
        log.error("Traceback (most recent call last): ... Not a directory")
        time.sleep(0.001)

class Trainer:  # the real main(), a trainer whose save fails once the deadline's clean-up blocks Orbax's writers
    def start_output(self):
        pass
    def train(self):
        threading.Thread(target=noise, daemon=True).start()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)  # the deadline (0.05 s) is reached; its clean-up takes 0.5 s
        if sys.argv[1] == "raises":
            raise ValueError("FAILED_PRECONDITION: Error writing manifest.ocdbt: Not a directory")
        return types.SimpleNamespace(stop=Stop.PREEMPT)  # the run's own end, meanwhile
    def finish(self, progress, t_start):
        print("python -m train: preempted by SIGTERM after step 6 of 100: ...")

def start(argv, stops):
    stops.training()
    stops.set_deadline(0.05, lambda: time.sleep(0.5) or "removed the half-written 6")
    return Trainer()

sys.modules["train.trainer"] = types.SimpleNamespace(start=start)
sys.exit(main([]))
"""


@pytest.mark.parametrize("main_thread", ["raises", "returns"])
def test_a_save_broken_by_the_deadline_clean_up_still_exits_143_with_its_line(main_thread):
    """Races CI met at the ``--preempt-grace`` deadline, whose clean-up blocks Orbax's writers on
    purpose (``Stops.outlast``, ``train.stops._silence``): the main thread's save failed on the
    blockers and the process exited 1 with Orbax's traceback; a run that ended meanwhile ended the
    process before the deadline's line. Exit 143, the deadline's line last (stdout and stderr
    together), while another thread keeps writing."""
    r = subprocess.run([sys.executable, "-c", _SAVE_BROKEN_BY_THE_CLEAN_UP, main_thread], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60, cwd=Path(__file__).parent.parent, check=False)
    assert r.returncode == 143, r.stdout[-3000:]
    assert r.stdout.strip().splitlines()[-1] == ("python -m train: --preempt-grace 0.05 s after SIGTERM ran out: "
                                                "removed the half-written 6"), r.stdout[-3000:]


def test_bad_preempt_grace_and_watchdog_are_config_errors():
    for argv, needle in ((["--preempt-grace", "0"], "checkpoint.preempt_grace (--preempt-grace): must be > 0 and finite, got 0.0; leave it out for no limit"),
                         (["--watchdog", "-1"], "training.watchdog (--watchdog): must be >= 0")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            parse_config(argv)[0].validate()
    run = parse_config(["--no-fit-check", "--watchdog", "0", "--preempt-grace", "90"])[0].validate()
    assert (run.training.fit_check, run.training.watchdog, run.checkpoint.preempt_grace) == (False, 0.0, 90.0)
