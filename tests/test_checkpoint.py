"""Checkpoints: logical save/restore across meshes and strategies (bitwise), exact resume of
``python -m train`` through SIGKILL, kills during a save, safetensors export, bad input."""

import hashlib
import json
import shutil
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import ResBlock, ResMLP, built, mlp_batches, mse_loss
from flax import nnx

import zshard
from train import data
from train.checkpointing import BatchStream

from conftest import ROOT
from runs import train_main

TX = optax.adamw(1e-2, weight_decay=0.1)


def make_model():
    return ResMLP(rngs=nnx.Rngs(0))  # 13 -> 19 -> 3: every parameter padded on 2, 4, 8 devices


def mesh(replica, shard):
    return zshard.make_mesh(replica, shard, devices=jax.devices()[: replica * shard])


def leaves(state):
    """Every array of the state on host: params, optimizer state, step (padded layout)."""
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state, state.step))]


def files(directory):
    """``{relative path: sha256}`` of every file under ``directory``."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(directory).rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Train 3 steps on 1x8 FULL_SHARD, save, then train 2 more: the reference continuation."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    # the model built once, eagerly, and copied (the builder's path: tests/test_strategies.py); restore takes the builder
    state = zshard.init(built(make_model), TX, mesh(1, 8), strategy="FULL_SHARD")
    step = zshard.make_train_step(mse_loss)
    batches = mlp_batches(5)
    for b in batches[:3]:
        state, _ = step(state, b)
    zshard.save(state, directory, extra={"note": "three steps"})
    before = leaves(state)
    losses = []
    for b in batches[3:]:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return directory, before, losses, batches[3:]


def _same_logical(a, b):
    """Padded flats of two layouts agree on their common prefix and are zero beyond it."""
    for x, y in zip(a, b):
        x, y = x.reshape(-1), y.reshape(-1)
        n = min(x.size, y.size)
        np.testing.assert_array_equal(x[:n], y[:n])
        assert not x[n:].any() and not y[n:].any()


@pytest.mark.parametrize(
    "replica,shard,strategy",
    [(2, 4, "HYBRID_SHARD"), (1, 4, "FULL_SHARD"), (4, 2, "HYBRID_SHARD"), (1, 1, "FULL_SHARD"), (2, 4, "NO_SHARD"), (1, 8, "SHARD_OPT")],
)
def test_round_trip_to_any_mesh_and_strategy_and_back_is_bitwise(saved, tmp_path, replica, shard, strategy):
    directory, before = saved[:2]
    state, extra = zshard.restore(directory, mesh(replica, shard), model=make_model, tx=TX, strategy=strategy)
    assert extra == {"note": "three steps"} and int(state.step) == 3
    assert state.plan.strategy.value == strategy and state.plan.mesh.shape == {"replica": replica, "shard": shard}
    kernel = state.params["blocks"][0]["lin"]["kernel"]
    assert kernel.sharding.spec == state.plan.param_specs["blocks"][0]["lin"]["kernel"]
    _same_logical(leaves(state), before)  # parameters and optimizer state, bitwise, in the new layout

    # ... and back: the original 1x8 FULL_SHARD layout, padding included, bit for bit.
    zshard.save(state, tmp_path / "back")
    back, _ = zshard.restore(tmp_path / "back", mesh(1, 8), model=make_model, tx=TX, strategy="FULL_SHARD")
    for x, y in zip(leaves(back), before):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)



def test_training_continues_with_the_same_losses(saved):
    directory, _, ref_losses, more = saved
    step = zshard.make_train_step(mse_loss)
    same, _ = zshard.restore(directory, mesh(1, 8), model=make_model, tx=TX, strategy="FULL_SHARD")
    other, _ = zshard.restore(directory, mesh(2, 4), model=make_model, tx=TX, strategy="HYBRID_SHARD")
    for b, want in zip(more, ref_losses):
        same, m = step(same, b)
        assert float(m["loss"]) == want  # the same layout: bit for bit
        other, m = step(other, b)
        np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)  # reduction order differs


class Stacked(nnx.Module):
    """Three ResBlocks stacked with nnx.vmap (one unit, ``[L, n_pad]`` per parameter) and a head."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return ResBlock(19, rngs=rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(19, 3, rngs=rngs)


def test_stacked_layers_round_trip(tmp_path):
    """Stacked parameters ([L, n_pad], each layer padded) from 1x8 FULL_SHARD to 2x4 HYBRID_SHARD and back."""
    make = lambda: Stacked(nnx.Rngs(1))  # noqa: E731
    tx = optax.adam(1e-3)
    state = zshard.init(make(), tx, mesh(1, 8), strategy="FULL_SHARD")
    assert {u.name: u.layers for u in state.plan.units}["blocks"] == 3
    assert state.params["blocks"]["lin"]["kernel"].shape == (3, 368)  # 19*19 = 361 -> 368 per layer
    zshard.save(state, tmp_path / "a")
    other, _ = zshard.restore(tmp_path / "a", mesh(2, 4), model=make, tx=tx, strategy="HYBRID_SHARD")
    assert other.params["blocks"]["lin"]["kernel"].shape == (3, 364)  # 361 -> 364 per layer
    ref = nnx.state(make(), nnx.Param).to_pure_dict()
    jax.tree.map(np.testing.assert_array_equal, nnx.state(zshard.unshard(other), nnx.Param).to_pure_dict(), ref)
    zshard.save(other, tmp_path / "b")
    back, _ = zshard.restore(tmp_path / "b", mesh(1, 8), model=make, tx=tx, strategy="FULL_SHARD")
    for x, y in zip(leaves(back), leaves(state)):
        np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------------------
# Bad input: clear errors, nothing on disk changed
# ----------------------------------------------------------------------------------------


def test_missing_directory_and_half_written_only(tmp_path, one):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory .*nowhere"):
        zshard.restore(tmp_path / "nowhere", mesh(1, 8), model=make_model, tx=TX)
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "half" / "7.orbax-checkpoint-tmp").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint .*half-written: 7\.orbax-checkpoint-tmp"):
        zshard.restore(tmp_path / "half", mesh(1, 8), model=make_model, tx=TX)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 9 .*complete steps: \[3\]"):
        zshard.restore(one, mesh(1, 8), model=make_model, tx=TX, step=9)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """A checkpoint of step 3 (initial ResMLP, AdamW, 1x8 FULL_SHARD), written once."""
    directory = tmp_path_factory.mktemp("one") / "ckpt"
    zshard.save(zshard.init(built(make_model), TX, mesh(1, 8)), directory, step=3)
    return directory


def saved_dir(tmp_path, one):
    """A private copy of ``one`` that a test may damage."""
    shutil.copytree(one, tmp_path / "one")
    return tmp_path / "one"


def test_different_model_or_optimizer_is_refused_naming_paths_and_shapes(one):
    directory = one
    before = files(directory)
    with pytest.raises(ValueError, match=r"(?s)different model.*params\.inp\.kernel: checkpoint \[13, 19\] float32, model/optimizer \[13, 20\]"):
        zshard.restore(directory, mesh(1, 8), model=lambda: ResMLP(d=20, rngs=nnx.Rngs(0)), tx=TX)
    with pytest.raises(ValueError, match=r"params\.blocks\.2\.lin\.kernel: missing in the checkpoint"):
        zshard.restore(directory, mesh(1, 8), model=lambda: ResMLP(n_blocks=3, rngs=nnx.Rngs(0)), tx=TX)
    with pytest.raises(ValueError, match=r"(?s)different optimizer.*opt_state\.0\.mu\.blocks\.0\.lin\.bias: in the checkpoint \[19\] float32"):
        zshard.restore(directory, mesh(1, 8), model=make_model, tx=optax.sgd(0.1))
    assert files(directory) == before


def test_existing_step_and_bad_extra_write_nothing(saved, tmp_path, one):
    directory = one
    before = files(directory)
    state, _ = zshard.restore(saved[0], mesh(1, 8), model=make_model, tx=TX)
    with pytest.raises(ValueError, match="step 3 exists already"):
        zshard.save(state, directory, step=3)
    with pytest.raises(ValueError, match="extra must hold only JSON"):
        zshard.save(state, tmp_path / "new", extra={"rng": np.random.default_rng(0)})
    assert files(directory) == before and not (tmp_path / "new").exists()


def _value_location(directory, key):
    """``(data file, offset, length)`` of array chunk ``key`` in checkpoint step 3, from the
    OCDBT b-tree that restore itself reads (``tensorstore.ocdbt.dump``).

    Several files under ``state/`` are never read on restore (the per-process b-trees that
    the save merged into the root one), so damage must aim at what restore reads."""
    import tensorstore as ts

    base = ts.KvStore.open(f"file://{directory / '3' / 'state'}/").result()
    root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    for entry in ts.ocdbt.dump(base, root).result()["entries"]:
        if entry["key"] == key.encode():
            # "value:<prefix>:<file>:<offset>:<length>"; inline values live in the b-tree node itself
            assert "indirect_value" in entry, f"{key} is stored inline in the b-tree node, not in a data file"
            _, prefix, name, offset, length = entry["indirect_value"].split(":")
            return directory / "3" / "state" / prefix / name, int(offset), int(length)
    raise AssertionError(f"{key} not in the checkpoint's OCDBT b-tree")


def _damage(directory, how):
    if how == "meta":
        target = directory / "3" / "meta" / "metadata"
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        return
    # the one chunk of params.blocks.0.lin.kernel ([19, 19] float32, zstd), stored in a data file
    path, offset, length = _value_location(directory, "params.blocks.0.lin.kernel/0.0")
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[offset + length // 2] ^= 0xFF
    else:
        raw = raw[: offset + length // 2]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "how,needle",
    [("flip", "is corrupt: 1 array.*params.blocks.0.lin.kernel"), ("truncate", "truncated or corrupt"), ("meta", "truncated or corrupt")],
)
def test_corrupt_or_truncated_files_are_refused(tmp_path, one, how, needle, capfd):
    directory = saved_dir(tmp_path, one)
    _damage(directory, how)
    before = files(directory)
    capfd.readouterr()
    with pytest.raises(ValueError, match=needle) as err:
        zshard.restore(directory, mesh(2, 4), model=make_model, tx=TX, strategy="HYBRID_SHARD")
    assert str(directory) in str(err.value)
    with pytest.raises(ValueError, match="corrupt"):
        zshard.export(directory, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    assert files(directory) == before
    assert "Traceback" not in capfd.readouterr().err  # the error alone, no asyncio tracebacks after it


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # asyncio's "Event loop is closed" after a refusal
def test_damage_to_any_data_file_is_refused_or_harmless(tmp_path, one):
    """A flipped byte or a cut in the middle of each data file under ``state/``, one at a time:
    restore either refuses it (ValueError naming the checkpoint, nothing else printed) or
    gives the clean arrays."""
    clean = leaves(zshard.restore(one, mesh(2, 4), model=make_model, tx=TX, strategy="HYBRID_SHARD")[0])
    names = sorted(str(p.relative_to(one)) for p in (one / "3" / "state").rglob("d/*") if p.is_file())
    assert len(names) >= 2
    outcomes = {}
    for name in names:
        for how in ("flip", "truncate"):
            directory = tmp_path / f"{how}-{Path(name).name}"
            shutil.copytree(one, directory)
            raw = bytearray((directory / name).read_bytes())
            if how == "flip":
                raw[len(raw) // 2] ^= 0xFF
            else:
                raw = raw[: len(raw) // 2]
            (directory / name).write_bytes(bytes(raw))
            try:
                state, _ = zshard.restore(directory, mesh(2, 4), model=make_model, tx=TX, strategy="HYBRID_SHARD")
            except ValueError as e:
                assert str(directory) in str(e) and "corrupt" in str(e)
                outcomes[name, how] = "refused"
                continue
            for x, y in zip(leaves(state), clean):
                np.testing.assert_array_equal(x, y)
            outcomes[name, how] = "identical"
    assert "refused" in outcomes.values(), outcomes  # the files restore reads are among them


# ----------------------------------------------------------------------------------------
# Export to safetensors
# ----------------------------------------------------------------------------------------


def test_export_and_load_params_give_the_same_logits(saved, tmp_path):
    from safetensors import safe_open

    directory = saved[0]
    state, _ = zshard.restore(directory, mesh(2, 4), model=make_model, tx=TX, strategy="HYBRID_SHARD")
    x = mlp_batches(1)[0][0]
    want = np.asarray(zshard.unshard(state)(x))
    for source, name in ((state, "state.safetensors"), (directory, "dir.safetensors")):
        path = zshard.export(source, tmp_path / name)
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # readable like any file the user writes
        with safe_open(path, framework="numpy") as f:
            assert set(f.keys()) == {"inp.kernel", "inp.bias", "head.kernel", "head.bias"} | {
                f"blocks.{i}.lin.{k}" for i in (0, 1) for k in ("kernel", "bias")
            }
            assert f.get_tensor("inp.kernel").shape == (13, 19)
        model = zshard.load_params(path, ResMLP(rngs=nnx.Rngs(42)))
        np.testing.assert_array_equal(np.asarray(model(x)), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.safetensors", "state.safetensors"]  # no staging left


def test_load_params_refuses_other_models_and_damaged_files(saved, tmp_path):
    path = zshard.export(saved[0], tmp_path / "m.safetensors")
    other = ResMLP(d=20, rngs=nnx.Rngs(0))
    kept = nnx.state(other, nnx.Param).to_pure_dict()
    with pytest.raises(ValueError, match=r"inp\.kernel: file \[13, 19\] float32, model \[13, 20\] float32"):
        zshard.load_params(path, other)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(other, nnx.Param).to_pure_dict(), kept)  # unchanged
    raw = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="cut.safetensors.*not a readable safetensors file"):
        zshard.load_params(tmp_path / "cut.safetensors", make_model())
    with pytest.raises(FileNotFoundError, match="no file"):
        zshard.load_params(tmp_path / "none.safetensors", make_model())


# ----------------------------------------------------------------------------------------
# Kills while saving, and exact resume of python -m train
# ----------------------------------------------------------------------------------------

SAVER = textwrap.dedent(
    """
    import dataclasses, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import conftest  # 8 emulated devices
    import jax, optax, zshard
    from conftest import ResMLP
    from flax import nnx
    from zshard.checkpoint import Checkpointer
    state = zshard.init(lambda: ResMLP(d=256, n_blocks=4, rngs=nnx.Rngs(0)), optax.adam(1e-3), zshard.make_mesh(1, 8))
    ckpt = Checkpointer(sys.argv[1], keep=2)
    for k in range(1, 10_000):
        value = dataclasses.replace(state, params=jax.tree.map(lambda x: x * 0 + k, state.params))
        ckpt.save(value, step=k, extra={{"k": k}})
        print("started", k, flush=True)
    """
)


def _wait_for(predicate, proc, timeout=120.0):
    t_end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < t_end, "timed out"
        time.sleep(0.002)


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_sigkill_while_saving_leaves_the_previous_checkpoint_intact(tmp_path, delay_s):
    """Kill the writer while checkpoint k >= 3 is being written (delay_s after its temporary
    folder appears): the newest complete checkpoint restores whole, and no half-written one
    is listed or picked up."""
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    directory = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tmp_seen = lambda: any(p.name.split(".")[0].isdigit() and int(p.name.split(".")[0]) >= 3 and "tmp" in p.name  # noqa: E731
                               for p in (directory.iterdir() if directory.exists() else []))
        _wait_for(tmp_seen, proc)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
    leftovers = [p.name for p in directory.iterdir() if "tmp" in p.name]
    if delay_s == 0:
        assert leftovers, "the kill should have landed inside a save"
    ckpt = zshard.checkpoint.Checkpointer(directory)
    latest = ckpt.latest_step()
    assert latest is not None and latest >= 2
    assert all("tmp" not in str(s) for s in ckpt.all_steps())
    state, extra = ckpt.restore(mesh(2, 4), model=lambda: ResMLP(d=256, n_blocks=4, rngs=nnx.Rngs(0)), tx=optax.adam(1e-3),
                                strategy="HYBRID_SHARD")
    assert extra == {"k": latest}
    for p in jax.tree.leaves(nnx.state(zshard.unshard(state), nnx.Param).to_pure_dict()):
        assert np.all(np.asarray(p) == latest)
    # The directory stays usable: a later save completes beside the leftover temporary folder.
    ckpt.save(state, step=latest + 100)
    ckpt.close()
    assert zshard.checkpoint.Checkpointer(directory).latest_step() == latest + 100


def test_batch_stream_matches_train_batches_and_seeks():
    corpus = np.frombuffer(bytes(range(256)) * 8, dtype=np.uint8)
    stream, plain = BatchStream(corpus, 4, 8, seed=3), data.train_batches(corpus, 4, 8, seed=3)
    for _ in range(3):
        a, b = next(stream), next(plain)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    pos = json.loads(json.dumps(stream.position()))  # as stored in the checkpoint's JSON
    want = next(stream)
    other = BatchStream(corpus, 4, 8, seed=3)  # the seed is a run flag, checked on resume
    other.seek(pos)
    np.testing.assert_array_equal(next(other)[0], want[0])
    assert other.drawn == 4




def _train(corpus, out, *extra):
    args = ["--model", "nano", "--steps", "20", "--seq-len", "32", "--batch-size", "8", "--data", str(corpus),
            "--eval-every", "10", "--eval-batches", "1", "--sample-tokens", "0", "--out", str(out), *extra]  # fmt: skip
    # --sample-tokens 0: no generation programs compiled in the three runs; samples draw from seed + step,
    # not the training stream (train/hooks.py), so the losses compared are the same with or without them
    return [sys.executable, "-m", "train", *args]


def _losses(out):
    return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def _run_until_killed(cmd, when):
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(when, proc, timeout=300)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL  # killed, not finished
    finally:
        proc.kill()


def test_resume_after_sigkill_is_exact(tmp_path, corpus, capfd):
    """20 steps straight == 10 steps, SIGKILL while checkpoint 15 is being written, --resume
    from 10 (the half-written 15 is never picked up) for the last 10: the same metrics.jsonl
    losses, bit for bit. The killed run is a process; the other two are python -m train's main in
    this process (tests/runs.py's ``train_main``)."""
    straight = tmp_path / "straight"
    assert train_main(_train(corpus, straight)[3:]) == 0  # python -m train's main in this process (tests/runs.py)
    want = _losses(straight)
    assert [s for s, loss, _ in want if loss is not None] == list(range(1, 21))

    out, ck = tmp_path / "killed", ["--ckpt-every", "5", "--keep", "2"]
    _run_until_killed(_train(corpus, out, *ck), lambda: (out / "checkpoints" / "15.orbax-checkpoint-tmp").exists())
    assert zshard.checkpoint.Checkpointer(out / "checkpoints").all_steps() == [5, 10]
    capfd.readouterr()
    assert train_main(_train(corpus, out, *ck, "--resume")[3:]) == 0
    assert "continuing from step 10" in capfd.readouterr().err
    assert _losses(out) == want  # bitwise: floats read back from JSON exactly
    assert zshard.checkpoint.Checkpointer(out / "checkpoints").all_steps() == [15, 20]


def test_cli_refuses_to_mix_runs(tmp_path, corpus):
    """Checked before anything compiles (train.checkpointing.prepare), nothing written."""
    from train.cli import parse_config
    from train.checkpointing import ResumeError, prepare, run_settings

    out = tmp_path / "run"
    state = zshard.init(built(make_model), TX, mesh(1, 8))  # built once, eagerly (the builder's path: tests/test_strategies.py)
    base = ["--model", "nano", "--steps", "20", "--data", str(corpus), "--out", str(out)]
    zshard.save(state, out / "checkpoints", step=4, extra={"config": run_settings(parse_config(base)[0].resolved())})
    before = files(out)
    for argv, needle in [
        (["--ckpt-every", "5"], "holds checkpoints (latest: step 4); pass --resume"),
        (["--resume", "--seed", "1"], "--seed 0 -> 1"),
        (["--resume", "--lr", "0.01"], "--lr 0.003 -> 0.01"),
        (["--resume", "--steps", "4"], "--steps 20 -> 4"),
    ]:
        with pytest.raises(ResumeError) as err:
            prepare(parse_config(base + argv)[0].resolved(), out)
        assert needle in str(err.value)
    ok = prepare(parse_config(base + ["--resume", "--mesh", "2x4", "--strategy", "HYBRID_SHARD"])[0].resolved(), out)
    assert ok.resuming and ok.start == 4
    assert files(out) == before
    # no checkpoint: an unfinished run (killed before its first one) starts again and its files are
    # replaced; one that ended (a summary, weights) is refused, nothing changed
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 5.0}\n')
    again = prepare(parse_config(base + ["--resume", "--out", str(other)])[0].resolved(), other)
    assert not again.resuming and again.replaces == ["metrics.jsonl"]
    (other / "summary.json").write_text(json.dumps({"steps_done": 20, "steps": 20, "weights": None}))
    with pytest.raises(ResumeError, match=r"holds a finished run \(20 of 20 steps\): metrics.jsonl, summary.json, and no "
                       r"complete checkpoint.*--init-from"):
        prepare(parse_config(base + ["--resume", "--out", str(other)])[0].resolved(), other)


def test_compile_save_compiles_ahead_so_the_first_save_compiles_nothing(tmp_path):
    import jax.monitoring

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if "backend_compile" in name else None)
    state = zshard.init(built(make_model), TX, mesh(2, 4))  # built once, eagerly (the builder's path: tests/test_strategies.py)
    ckpt = zshard.Checkpointer(tmp_path / "ck")
    ckpt.compile_save(state)
    assert compiles and not (tmp_path / "ck").exists()  # compiled (unpadding, checksums); nothing written
    n = len(compiles)
    ckpt.save(state, step=1)
    ckpt.close()
    assert len(compiles) == n  # the first save ran what was compiled ahead
    restored, _ = zshard.restore(tmp_path / "ck", mesh(2, 4), model=make_model, tx=TX)
    jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)
