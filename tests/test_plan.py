"""Planning without hardware: abstract init, report on abstract inputs, `python -m train.plan`."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import gpt_batches, reference_run, zshard_run
from flax import nnx

import zshard
from train.model import GPT, GPTConfig, Llama, LlamaConfig, cross_entropy_loss

ROOT = Path(__file__).resolve().parent.parent


def small_llama():
    cfg = LlamaConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    return Llama(cfg, rngs=nnx.Rngs(0))


def tied_gpt():
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=True), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make", [small_llama, tied_gpt], ids=["llama-gqa", "gpt-tied"])
def test_plan_presets_architectures_match_single_device(make):
    data = gpt_batches(4)
    want = reference_run(make, optax.sgd(0.5), cross_entropy_loss, data)
    got = zshard_run(make, optax.sgd(0.5), zshard.make_mesh(2, 4), "HYBRID_SHARD", cross_entropy_loss, data)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)  # the tied weight counts once
    for path, ref in want.params.items():
        np.testing.assert_allclose(got.params[path], ref, rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD", "SHARD_OPT"])
def test_abstract_init_matches_concrete(strategy):
    mesh = zshard.make_mesh(2, 4)
    concrete = zshard.init(small_llama, optax.adamw(1e-3), mesh, strategy=strategy)
    abstract = zshard.init(small_llama, optax.adamw(1e-3), mesh, strategy=strategy, abstract=True)
    c_leaves, c_def = jax.tree.flatten(concrete)
    a_leaves, a_def = jax.tree.flatten(abstract)
    assert [str(p) for p, _ in jax.tree_util.tree_leaves_with_path(concrete)] == [str(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)]
    for c, a in zip(c_leaves, a_leaves):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype) == (c.shape, c.dtype)
        assert a.sharding.spec == c.sharding.spec
    step = zshard.make_train_step(cross_entropy_loss)
    tokens = np.zeros((8, 16), np.int32)
    r_c = zshard.report(step, concrete, (tokens, tokens))
    r_a = zshard.report(step, abstract, (jax.ShapeDtypeStruct((8, 16), np.int32),) * 2)
    assert r_a.model_state_bytes == r_c.model_state_bytes
    assert r_a.comm_bytes_per_step == r_c.comm_bytes_per_step
    assert r_a.per_device_bytes["argument"] == r_c.per_device_bytes["argument"]


def test_plan_cli_reports_and_gives_a_verdict():
    cmd = [sys.executable, "-m", "train.plan", "--model", "gpt2-124m", "--mesh", "2x4", "--strategy", "HYBRID_SHARD",
           "--seq-len", "64", "--gather-format", "int8", "--replica-format", "int8", "--device-memory-gb", "80"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # GPT-2 small (124,439,808 with tied head) without qkv biases (12 x 2304), positions for 64 tokens only
    n = 124_439_808 - 12 * 2304 - (1024 - 64) * 768
    assert f"HYBRID_SHARD on 2x4 ({n:,} parameters, remat=block, grad_accum=1)" in out.stdout
    assert "FITS" in out.stdout and "DOES NOT FIT" not in out.stdout
    # the quantized formats (docs/quantized.md), per axis against the formula
    assert "gather int8/256, reduce float32 |" in out.stdout, out.stdout[-3000:]
    assert re.search(r"\| replica \| [0-9.]+ \| [0-9.]+ \| (0\.99|1\.0)\d+ \| reduce int8/256 \|", out.stdout), out.stdout[-3000:]
    tiny = subprocess.run(cmd[:-1] + ["0.1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "DOES NOT FIT" in tiny.stdout, tiny.stdout[-1000:]


def test_plan_cli_bad_input():
    out = subprocess.run([sys.executable, "-m", "train.plan", "--model", "llama-9b", "--mesh", "1x2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "choose one of gpt2-124m" in out.stderr
    out = subprocess.run([sys.executable, "-m", "train.plan", "--model", "gpt2-124m", "--mesh", "2x2", "--batch-size", "6"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "must divide by the 4 data devices" in out.stderr
    out = subprocess.run([sys.executable, "-m", "train.plan", "--model", "gpt2-124m", "--mesh", "1x1x5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--mesh 1x1x5" in out.stderr and "n_heads" in out.stderr, out.stderr[-1000:]
    out = subprocess.run([sys.executable, "-m", "train.plan", "--model", "gpt2-124m", "--mesh", "2x2", "--strategy", "NO_SHARD",
                          "--gather-format", "int8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "NO_SHARD keeps every parameter whole" in out.stderr, out.stderr[-1000:]


def test_plan_cli_tensor_axis():
    """``--mesh RxSxT``: the preset's TP plan (train.models.tensor_plan), the batch over the
    R*S data devices, the tensor row of the report (Megatron-LM's all-reduce count)."""
    cmd = [sys.executable, "-m", "train.plan", "--model", "gpt2-124m", "--mesh", "1x2x2", "--seq-len", "64"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FULL_SHARD on 1x2x2 (" in out.stdout and "global batch 2 x 64 tokens" in out.stdout
    assert "Megatron-LM's count 5" in out.stdout and "| tensor |" in out.stdout
