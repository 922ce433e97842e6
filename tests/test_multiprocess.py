"""Multi-process runs over loopback: ``jax.distributed`` with gloo collectives on CPU.

Every test marked ``multiprocess`` starts real processes (``python -m zshard.launch`` or by
hand) that join through ``zshard.distributed.initialize``; run them alone with
``pytest -m multiprocess``. Losses are checked against the plain single-device Optax step,
never only against another sharded run (gloo reduce-scatter is reported wrong at MiB-sized
chunks, jax-ml/jax#40830; the model here is ~1k parameters). ``python -m train`` under the launcher
(rank 0 writing, checkpoints across process counts): tests/test_preempt_mp.py, whose one
uninterrupted run serves that test and the preemption test's reference.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import mp_worker
import numpy as np
import pytest
from conftest import reference_run, rel_l2, zshard_run
from runs import env as _env

import zshard
from train import data
from zshard.launch import _child_env, free_port

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(mp_worker.__file__).resolve()
PY = sys.executable
DEAD_PEER_LIMIT_S = 60  # a process whose peer died must be gone within this (issue 7)


def _result(output: str) -> dict:
    """The ``RESULT {json}`` line of one process's output."""
    return json.loads(next(line for line in output.splitlines() if line.startswith("RESULT ")).split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def two_by_four():
    """``python tests/mp_worker.py train-kill`` as 2 processes x 4 devices, started by hand (the
    ``ZSHARD_*`` variables the launcher sets, heartbeat timeout 10 s): each strategy of
    ``mp_worker.STRATEGIES`` on ``make_mesh()``, then the tensor mode's GPT on ``make_mesh(2, 2, tensor=2)``;
    then rank 1 kills itself and rank 0 keeps stepping (one start of two processes for the tests of all
    three). ``SimpleNamespace(results={rank: RESULT}, killed=rank 1's status, peer=rank 0's status or None
    when it still ran DEAD_PEER_LIMIT_S after rank 1 died, out=rank 0's output)``. While rank 0 waits for
    the runtime to stop it (rank 1's heartbeats are missed for 10 s), this process runs the single-process
    runs the tests compare with (:func:`_one_process`): a core that would be idle."""
    port, procs, said0 = free_port(), [], []
    try:
        for rank in range(2):
            launched = _child_env(rank, 2, port, devices=4, heartbeat=10, init=None)  # what the launcher gives a rank
            env = _env(**{k: v for k, v in launched.items() if k.startswith("ZSHARD_") or k == "XLA_FLAGS"})
            procs.append(subprocess.Popen([PY, str(WORKER), "train-kill"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
        reader = threading.Thread(target=lambda: said0.extend(procs[0].stdout), daemon=True)  # rank 0's pipe never fills
        reader.start()
        out1, _ = procs[1].communicate(timeout=300)
        died = time.monotonic()
        if "RESULT " in out1:  # rank 1 trained and killed itself; rank 0 waits on it
            _reference(), [_one_process(s) for s in mp_worker.STRATEGIES], _tensor_reference()
        try:
            procs[0].wait(timeout=max(1.0, died + DEAD_PEER_LIMIT_S - time.monotonic()))  # never hangs
            peer = procs[0].returncode
        except subprocess.TimeoutExpired:
            procs[0].kill()
            procs[0].wait()
            peer = None
        reader.join(timeout=10)
        out0 = "".join(said0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "RESULT " in out0 and "RESULT " in out1, out0[-3000:] + out1[-3000:]
    return types.SimpleNamespace(results={0: _result(out0), 1: _result(out1)}, killed=procs[1].returncode, peer=peer, out=out0)


@functools.cache
def _reference():
    """One device's run of the worker's model, once for both strategies."""
    return reference_run(mp_worker.make_model, mp_worker.make_tx(), mp_worker.loss_fn, mp_worker.batches())


@functools.cache
def _one_process(strategy):
    """The worker's training in this one process on ``make_mesh(2, 4)`` (what 2 processes x 4 devices compute)."""
    return zshard_run(mp_worker.make_model(), mp_worker.make_tx(), zshard.make_mesh(2, 4), strategy, mp_worker.loss_fn,
                      mp_worker.batches())  # fmt: skip


@functools.cache
def _tensor_reference():
    """One device's run of the tensor mode's GPT."""
    make, tx, loss, _, data = mp_worker.tensor_case()
    return reference_run(make, tx, loss, data)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", mp_worker.STRATEGIES)
def test_two_processes_train_like_one_process_and_the_reference(two_by_four, strategy):
    want, one = _reference(), _one_process(strategy)
    got = {rank: r[strategy] for rank, r in two_by_four.results.items()}
    assert got[0]["mesh"] == {"replica": 2, "shard": 4}  # make_mesh(): replica = processes
    assert got[0]["losses"] == got[1]["losses"] and got[0]["grad_norms"] == got[1]["grad_norms"]
    np.testing.assert_allclose(got[0]["losses"], want.losses, rtol=1e-5)
    np.testing.assert_allclose(got[0]["grad_norms"], want.grad_norms, rtol=1e-5)  # catches a gradient scale Adam hides
    np.testing.assert_allclose(got[0]["losses"], one.losses, rtol=1e-5)
    params = {tuple(int(k) if k.isdigit() else k for k in p.split("/")): np.asarray(v) for p, v in got[0]["params"].items()}
    assert set(params) == set(want.params)
    for path, ref in want.params.items():
        assert params[path].shape == ref.shape, path
        assert rel_l2(params[path], ref) <= 1e-5, path


@pytest.mark.multiprocess
def test_hybrid_gathers_and_reduce_scatters_stay_inside_a_process(two_by_four):
    result = two_by_four.results[0]
    owner = {int(d): p for d, p in result["device_process"].items()}

    def processes(group):
        return {owner[d] for d in group}

    hybrid, full = result["HYBRID_SHARD"], result["FULL_SHARD"]
    assert hybrid["mesh_processes"] == [[0] * 4, [1] * 4]  # one mesh row per process
    kinds = {c["kind"] for c in hybrid["collectives"]}
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= kinds
    for c in hybrid["collectives"]:
        if c["kind"] in ("all-gather", "reduce-scatter"):
            assert all(len(g) == 4 and len(processes(g)) == 1 for g in c["groups"]), c
    # the gradient shards cross processes once: all-reduce over replica, one device per process
    # (the other all-reduces are the scalar loss and gradient-norm sums over the world)
    assert any(
        all(len(g) == 2 and len(processes(g)) == 2 for g in c["groups"]) for c in hybrid["collectives"] if c["kind"] == "all-reduce"
    )
    # the check can fail: FULL_SHARD's gathers do span both processes
    assert all(len(processes(g)) == 2 for c in full["collectives"] if c["kind"] == "all-gather" for g in c["groups"])


@pytest.mark.multiprocess
def test_tensor_groups_stay_inside_a_process_and_train_like_one_device(two_by_four):
    """2 processes x 4 devices, ``make_mesh(2, 2, tensor=2)``: each tensor group is two devices
    of one process (the per-block all-reduces never cross a host), the GPT with its TP plan
    trains like one device, and a tensor group wider than a process is refused by name."""
    got = {rank: r["tensor"] for rank, r in two_by_four.results.items()}
    assert sorted(got) == [0, 1]
    want = _tensor_reference()
    for r in got.values():
        assert r["mesh"] == {"replica": 2, "shard": 2, "tensor": 2}
        assert all(len(p) == 1 for p in r["group_processes"]), r["group_processes"]
        np.testing.assert_allclose(r["losses"], want.losses, rtol=1e-5)
        np.testing.assert_allclose(r["grad_norms"], want.grad_norms, rtol=1e-5)
        assert r["wide_error"] and "spans processes" in r["wide_error"], r["wide_error"]


@pytest.mark.multiprocess
def test_killed_process_stops_its_peer_with_a_clear_error(two_by_four):
    # two_by_four's processes, once trained: rank 1 SIGKILLs itself, rank 0 keeps stepping with FULL_SHARD
    assert two_by_four.killed == -signal.SIGKILL
    if two_by_four.peer is None:
        pytest.fail(f"rank 0 still running {DEAD_PEER_LIMIT_S} s after rank 1 was killed")
    assert two_by_four.peer != 0
    assert "another task died" in two_by_four.out and "stopped sending heartbeats" in two_by_four.out, two_by_four.out[-3000:]


@pytest.mark.multiprocess
def test_launcher_prefixes_output_and_stops_the_others_when_one_fails(tmp_path):
    script = (  # rank 1 fails once the others have printed (CI: under load rank 0 was stopped before its line)
        "import os, sys, time, pathlib\n"
        "rank, here = os.environ['ZSHARD_PROCESS_ID'], pathlib.Path(sys.argv[1])\n"
        "print('hello from', rank, os.environ['ZSHARD_NUM_PROCESSES'], os.environ['XLA_FLAGS'], flush=True)\n"
        "(here / rank).touch()\n"
        "t = time.monotonic()\n"
        "while rank == '1' and not all((here / r).exists() for r in '02') and time.monotonic() - t < 60: time.sleep(0.05)\n"
        "if rank == '1': sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    cmd = [PY, "-m", "zshard.launch", "--nproc", "3", "--devices-per-proc", "2", "--grace", "2", "--", PY, "-c", script, str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, res.stdout
    for rank in range(3):  # the launcher sets the device count and keeps the other XLA_FLAGS (the suite's own)
        line = next(line for line in res.stdout.splitlines() if line.startswith(f"[rank {rank}] hello from {rank} 3 "))
        assert line.split()[-1] == "--xla_force_host_platform_device_count=2" and line.count("device_count") == 1, line
    assert "rank 1 exited with status 3; stopping the other 2 running process(es)" in res.stdout


BAD_FLAGS = {  # id: (flags, the error's words); the coordinator 127.0.0.1:{port} unless given
    "wrong-process-id": (["--num-processes", "2", "--process-id", "2"], "--process-id 2 is outside 0..1 (--num-processes 2)"),
    "malformed-coordinator": (["--num-processes", "2", "--process-id", "1", "--coordinator", "localhost"],
                              "--coordinator 'localhost': expected HOST:PORT"),
    "unreachable-coordinator": (["--num-processes", "2", "--process-id", "1"],  # last: the only one that starts jax.distributed
                                "could not reach the coordinator 127.0.0.1:{port} within 3 s"),
}  # fmt: skip
_MAINS = (  # python -m train's main once per argv, in one process; a process exits with main's SystemExit status
    "import json, sys\n"
    "from train.__main__ import main\n"
    "for argv in json.loads(sys.argv[1]):\n"
    "    try:\n"
    "        code = main(argv)\n"
    "    except SystemExit as e:\n"
    "        code = e.code\n"
    "    print(f'EXIT {code}', file=sys.stderr, flush=True)\n"
)


@pytest.fixture(scope="module")
def bad_flags(tmp_path_factory):
    """Each :data:`BAD_FLAGS` case through ``python -m train``'s main, one after the other in one
    process (one import of jax and the trainer for the three), ``ZSHARD_INIT_TIMEOUT_S=3``, nobody
    listening on the port: ``(port, {id: (status, the case's stderr, its --out)})``."""
    port, tmp = free_port(), tmp_path_factory.mktemp("bad_flags")
    argvs = [[*([] if "--coordinator" in args else ["--coordinator", f"127.0.0.1:{port}"]), *args, "--out", str(tmp / case)]
             for case, (args, _) in BAD_FLAGS.items()]  # fmt: skip
    res = subprocess.run([PY, "-c", _MAINS, json.dumps(argvs)], cwd=ROOT, env=_env(ZSHARD_INIT_TIMEOUT_S="3"),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    parts = re.split(r"^EXIT (\S+)\n", res.stderr, flags=re.M)  # [stderr 0, status 0, stderr 1, status 1, ...]
    got = {case: (parts[2 * i + 1], parts[2 * i], tmp / case) for i, case in enumerate(BAD_FLAGS) if 2 * i + 1 < len(parts)}
    assert len(got) == len(BAD_FLAGS), res.stdout[-2000:] + res.stderr[-3000:]
    return port, got


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_distributed_flags_are_clear_errors(bad_flags, case):
    port, got = bad_flags
    status, stderr, out = got[case]
    assert status == "2", stderr[-2000:]
    assert BAD_FLAGS[case][1].format(port=port) in stderr, stderr[-2000:]
    assert not out.exists()


@pytest.mark.multiprocess
def test_mismatched_process_count_duplicate_rank_and_double_init_are_clear_errors():
    port = free_port()
    script = (  # zshard/distributed.py loaded by its path, not through the zshard package (flax, optax, orbax:
        # 0.7 s of CPU a process, none of which it uses; it imports jax alone), as tests/runs.py's LAUNCH
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('zshard_distributed', {str(ROOT / 'zshard' / 'distributed.py')!r})\n"
        "d = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(d)\n"
        "port, num, rank, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])\n"
        "try:\n"
        "    d.initialize(f'127.0.0.1:{port}', num, rank, init_timeout_s=30)\n"
        "except Exception as e:\n"
        "    print(f'ERROR {type(e).__name__}: {e}', flush=True); sys.exit(2)\n"
        "print('initialized', flush=True)\n"
        "if wait < 0:\n"
        "    d.initialize()\n"
        "time.sleep(abs(wait))\n"
    )

    def start(num, rank, wait):
        return subprocess.Popen([PY, "-c", script, str(port), str(num), str(rank), str(wait)], cwd=ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip

    coordinator = start(2, 0, 120)  # expects 2 processes
    try:
        wrong = start(3, 1, 0)  # believes there are 3
        out = wrong.communicate(timeout=60)[0]
        assert wrong.returncode == 2, out
        assert "error: --num-processes 3 on process 1, but the coordinator" in out, out
        assert "runs 2 processes; give every process the same --num-processes" in out
        second_zero = start(2, 0, 0).communicate(timeout=60)[0]
        assert "ERROR RuntimeError" in second_zero and f"cannot start the coordinator on port {port}" in second_zero, second_zero
        assert "a second process started with --process-id 0" in second_zero
    finally:
        coordinator.kill()
        coordinator.wait()
    port = free_port()
    twice = subprocess.run([PY, "-c", script, str(port), "1", "0", "-1"], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "initialized" in twice.stdout and "already initialized" in twice.stderr, twice.stdout + twice.stderr


def test_initialize_after_computing_is_an_error_and_single_process_is_a_no_op(monkeypatch):
    import zshard.distributed as dist

    for var in (dist.ENV_COORDINATOR, dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID, "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert dist.initialize() is False  # nothing given, no cluster: a single-process run
    with pytest.raises(RuntimeError, match="must run before any JAX computation"):
        dist.initialize("127.0.0.1:12355", 2, 0)  # this test process already has 8 devices in use
    with pytest.raises(ValueError, match="--coordinator 'host:99999': expected HOST:PORT"):
        dist.parse_coordinator("host:99999")
    assert dist.parse_coordinator("[::1]:80") == ("::1", 80)


@pytest.mark.parametrize("processes", [2, 4])
def test_process_slices_make_the_same_global_batches_and_cover_each_epoch_once(processes):
    corpus = np.random.default_rng(0).integers(0, 256, size=3329, dtype=np.uint8)
    seq_len, batch, steps = 16, 8, 60  # K = 208 examples: 60 batches of 8 span 2+ epochs
    k = data.num_examples(corpus, seq_len)
    example_of = {corpus[i * seq_len : i * seq_len + seq_len + 1].tobytes(): i for i in range(k)}
    assert k == 208 and len(example_of) == k  # random bytes: every window is unique
    one = list(itertools.islice(data.train_batches(corpus, batch, seq_len, seed=3), steps))
    parts = [
        list(itertools.islice(data.train_batches(corpus, batch, seq_len, seed=3, process_index=p, process_count=processes), steps))
        for p in range(processes)
    ]
    for i in range(steps):
        for part in parts:
            assert part[i][0].shape == part[i][1].shape == (batch // processes, seq_len)
        for j in (0, 1):  # inputs, targets: process p holds rows [p B/P, (p+1) B/P) of the global batch
            np.testing.assert_array_equal(np.concatenate([part[i][j] for part in parts]), one[i][j])
    # the stream of examples: each epoch a permutation of 0..K-1, a new one each epoch
    stream = [
        example_of[np.concatenate([x[:1], y]).astype(np.uint8).tobytes()] for x_b, y_b in one for x, y in zip(x_b, y_b)
    ]
    assert sorted(stream[:k]) == list(range(k)) and sorted(stream[k : 2 * k]) == list(range(k))
    assert stream[:k] != stream[k : 2 * k]
    with pytest.raises(ValueError, match="--batch-size 6 does not divide by the 4 processes"):
        next(data.train_batches(corpus, 6, seq_len, seed=0, process_index=0, process_count=4))
