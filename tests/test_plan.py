"""Planning without hardware: abstract init, report on abstract inputs, `python -m train.plan`."""

import contextlib
import importlib.util
import io
import json
import re

import jax
import numpy as np
import optax
import pytest
from conftest import built, gpt_batches, reference_run, zshard_run
from flax import nnx

import zshard
from train import plan
from train.bench.gpu import model_flops_per_token, multiplying_params
from train.model import GPT, GPTConfig, Llama, LlamaConfig, cross_entropy_loss
from train.plan_gpu import dot_flops, overlap

def small_llama():
    cfg = LlamaConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    return Llama(cfg, rngs=nnx.Rngs(0))


def tied_gpt():
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=True), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make", [small_llama, tied_gpt], ids=["llama-gqa", "gpt-tied"])
def test_plan_presets_architectures_match_single_device(make):
    data = gpt_batches(4)
    want = reference_run(make, optax.sgd(0.5), cross_entropy_loss, data)
    # a built module (copied to the shards, no initialiser compiled); the builders' path: the Llama's in
    # test_abstract_init_matches_concrete[FULL_SHARD], the tied GPT's in tests/test_memory.py's test_units_with_ends_matches_single_device
    got = zshard_run(built(make), optax.sgd(0.5), zshard.make_mesh(2, 4), "HYBRID_SHARD", cross_entropy_loss, data)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)  # the tied weight counts once
    for path, ref in want.params.items():
        np.testing.assert_allclose(got.params[path], ref, rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD", "SHARD_OPT"])
def test_abstract_init_matches_concrete(strategy):
    mesh = zshard.make_mesh(2, 4)
    # FULL_SHARD's concrete state from the builder (its initialisers compiled under jit: the Llama's builder
    # path), the others' from the model built once, eagerly, and copied to the shards (the same layouts)
    concrete = zshard.init(small_llama if strategy == "FULL_SHARD" else built(small_llama), optax.adamw(1e-3), mesh,
                           strategy=strategy)
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


def planned(argv: list[str]) -> str:
    """``python -m train.plan``'s ``main`` in this process (the test process's 8 emulated devices stand: a
    subprocess spent seconds importing jax and starting its own): asserts the exit status 0, returns stdout.
    The process's own exit status 0 is tests/test_memory.py's test_plan_cli_unit_ends (and test_sample's --help)."""
    assert len(jax.devices()) == 8  # the backend runs: plan.main's emulate_devices(mesh size) leaves conftest's 8 devices
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert plan.main([str(a) for a in argv]) == 0
    return buf.getvalue()


def test_plan_cli_reports_and_gives_a_verdict(tmp_path):
    out = planned(["--model", "gpt2-124m", "--mesh", "2x4", "--strategy", "HYBRID_SHARD", "--seq-len", "64", "--gather-format", "int8",
                   "--replica-format", "int8", "--json", tmp_path / "p.json", "--device-memory-gb", "80"])
    summary = json.loads((tmp_path / "p.json").read_text())  # the default --target cpu: the CPU program, fp32
    assert summary["target"] == "cpu" and summary["precision"] == "parameters float32" and summary["attention"]["kernel"] == "xla"
    assert summary["memory"]["temp"] > 0 and summary["collectives"] and summary["flops"] > 0 and "peer" not in summary
    # GPT-2 small (124,439,808 with tied head) without qkv biases (12 x 2304), positions for 64 tokens only
    n = 124_439_808 - 12 * 2304 - (1024 - 64) * 768
    assert f"HYBRID_SHARD on 2x4 ({n:,} parameters, remat=block, grad_accum=1)" in out
    assert "FITS" in out and "DOES NOT FIT" not in out and summary["fits"]
    assert summary["prediction"]["profile"] == "cpu" and "predicted on cpu: " in out and summary["micro_batch"] == 1
    # the quantized formats (docs/quantized.md), per axis against the formula
    assert "gather int8/256, reduce float32 |" in out, out[-3000:]
    assert re.search(r"\| replica \| [0-9.]+ \| [0-9.]+ \| (0\.99|1\.0)\d+ \| reduce int8/256 \|", out), out[-3000:]
    # the other verdict, DOES NOT FIT: test_plan_without_the_cuda_plugin_says_so's TINY Llama with --device-memory-gb
    # 0.0001 (the same comparison of the peak with the budget; its own plan here compiled a third program); the
    # default budget when --device-memory-gb is not given (80 GB on the CPU target): test_plan_cli_tensor_axis


def test_plan_cli_bad_input(capsys):
    """Refused before any compile, in this process (a subprocess per case spent seconds importing
    jax): ``plan.main`` exits with status 2 and names the flag; ``python -m train.plan``'s own exit
    status is tests/test_memory.py's test_plan_cli_unit_ends's and tests/test_sample.py's."""
    for argv, needles in (
        (["--model", "llama-9b", "--mesh", "1x2"], ["choose one of gpt2-124m"]),
        (["--model", "gpt2-124m", "--mesh", "2x2", "--batch-size", "6"], ["must divide by the 4 data devices"]),
        (["--model", "gpt2-124m", "--mesh", "1x1x5"], ["--mesh 1x1x5", "n_heads"]),
        (["--model", "gpt2-124m", "--mesh", "2x2", "--strategy", "NO_SHARD", "--gather-format", "int8"],
         ["NO_SHARD keeps every parameter whole"]),
    ):
        with pytest.raises(SystemExit) as e:
            plan.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and all(n in err for n in needles), (argv, err[-1000:])


def test_plan_bad_target_and_peer(capsys):
    """Refused before any compile (in this process: argparse exits with status 2)."""
    errs = []
    for flags, want in ((["--target", "tpu"], "argument --target: invalid choice: 'tpu'"),
                        (["--mesh", "1x2x2", "--peer"], "--peer compares with jax.jit over FSDP shardings")):
        with pytest.raises(SystemExit) as e:
            plan.main(["--model", "gpt2-124m", "--mesh", "2x2", *flags])
        errs.append(capsys.readouterr().err)
        assert e.value.code == 2 and want in errs[-1], errs[-1][-1000:]
    assert all(t in errs[0].split("choose from")[1] for t in ("cpu", "h100", "h200", "a100")), errs[0]


def test_plan_cli_tensor_axis():
    """``--mesh RxSxT``: the preset's TP plan (train.models.tensor_plan), the batch over the
    R*S data devices, the tensor row of the report (Megatron-LM's all-reduce count)."""
    out = planned(["--model", "gpt2-124m", "--mesh", "1x2x2", "--seq-len", "64"])
    assert "FULL_SHARD on 1x2x2 (" in out and "global batch 2 x 64 tokens" in out
    assert "Megatron-LM's count 5" in out and "| tensor |" in out
    # no --device-memory-gb: the CPU target's 80 GB, and the verdict against it (DOES NOT FIT: the plan without the CUDA plugin)
    assert re.search(r"= [0-9.]+ GB of 80 GB: FITS \(margin \+", out), out[-1000:]


# ---------------------------------------------------------------------------------------
# --target, --json, --hlo, --peer: the XLA:GPU program compiled without a GPU (train/plan_gpu.py)
# ---------------------------------------------------------------------------------------

TINY = LlamaConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=128, scan=True)


def _plan(monkeypatch, tmp_path, *flags):
    """``python -m train.plan`` in this process on the TINY Llama (head width 32, as cuDNN takes):
    ``(stdout, the --json summary, the --hlo text)``."""
    monkeypatch.setitem(plan.PLAN_PRESETS, "tiny-llama", TINY)
    out = {"json": tmp_path / "plan.json", "hlo": tmp_path / "plan.hlo"}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert plan.main(["--model", "tiny-llama", "--mesh", "1x8", "--json", str(out["json"]), "--hlo", str(out["hlo"]), *flags]) == 0
    return buf.getvalue(), json.loads(out["json"].read_text()), out["hlo"].read_text()


@pytest.fixture(scope="module")
def h100_plan(tmp_path_factory):
    pytest.importorskip("jax_cuda12_plugin", reason="jax's CUDA plugin (the cuda12 extra) is not installed: no XLA:GPU compiler")
    with pytest.MonkeyPatch.context() as mp:
        return _plan(mp, tmp_path_factory.mktemp("h100"), "--target", "h100", "--peer")


def _check_program(s: dict, hlo: str | None = None):
    mem = s["memory"]
    assert set(mem) == {"argument", "output", "alias", "temp", "peak"} and all(isinstance(v, int) for v in mem.values())
    assert mem["temp"] > 0 and mem["peak"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    att = s["attention"]
    assert att["kernel"] in ("cudnn", "xla")
    assert (att["kernel"] == "cudnn") == (att["forward_calls"] > 0) == (att["backward_calls"] > 0)
    if hlo is not None:
        assert ("__cudnn$fmha" in hlo) == (att["kernel"] == "cudnn")
    assert s["collectives"], "no collective in an 8-GPU FSDP step"
    for c in s["collectives"]:
        assert set(c) >= {"op", "axis", "bytes", "async", "compute_between"}
        assert isinstance(c["async"], bool) and isinstance(c["compute_between"], int) and c["bytes"] > 0
        assert c["async"] or c["compute_between"] == 0
    assert any(c["op"] == "all-gather" and c["axis"] == "shard" and c["async"] for c in s["collectives"])
    assert isinstance(s["flops"], float) and s["flops"] > 0


def test_plan_h100_json_and_hlo(h100_plan):
    out, summary, hlo = h100_plan
    assert summary["target"] == "h100" and "H100" in summary["device_kind"]
    assert "bfloat16 gathers and compute, float32 gradient reduction" in summary["precision"] and summary["precision"] in out
    _check_program(summary, hlo)
    assert "HloModule" in hlo and "all-gather-start" in hlo
    # the dots of one device's step: at least forward + backward (6 N per token) of the blocks' and head's matmuls
    blocks = TINY.n_layers * (TINY.d_model * (TINY.n_heads + 2 * TINY.n_kv_heads) * 32 + TINY.d_model * TINY.d_model
                              + 3 * TINY.d_model * TINY.d_ff)
    tokens = TINY.seq_len  # one sequence per device
    assert 6 * (blocks + TINY.vocab_size * TINY.d_model) * tokens <= summary["flops"] <= 12 * (blocks + TINY.vocab_size * TINY.d_model) * tokens + 1e7
    assert f"attention: {summary['attention']['kernel']}" in out and "collectives in the program" in out
    assert summary["prediction"]["profile"] == "h100" and "predicted on h100: " in out and summary["step_s"] > 0


def test_plan_h100_peer(h100_plan):
    out, summary, _ = h100_plan
    peer = summary["peer"]
    assert peer["target"] == "h100"
    _check_program(peer)
    kernels = summary["attention"]["kernel"], peer["attention"]["kernel"]  # the same model code on both sides
    assert kernels == ("cudnn", "cudnn")  # the peer's batch-sharded jit reaches cuDNN too (zshard.gpu._over_batch)
    assert "| per GPU | zshard | FSDP-compiler peer | zshard / peer |" in out and "| temp GB per GPU |" in out
    # the precision gradients are summed in: zshard's reduce_dtype float32; the jit peer's bf16 weight-gradient dots
    top = lambda s: max(s["reduce_dtypes"], key=s["reduce_dtypes"].get)  # noqa: E731
    assert (top(summary), top(peer)) == ("f32", "bf16") and "| gradient reduce-scatter dtype (by bytes) | f32 (" in out
    assert "gradients are reduced in f32 by zshard, in bf16 by the peer" in out


def test_program_reader_counts_dots_and_overlap():
    """dot_flops and overlap on programs whose answers are known: a scanned matmul compiled for CPU,
    and an async all-gather with one fusion between its start and done."""
    def f(x, w):
        return jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]

    hlo = jax.jit(f).lower(jax.ShapeDtypeStruct((16, 32), np.float32), jax.ShapeDtypeStruct((3, 32, 32), np.float32)).compile().as_text()
    assert dot_flops(hlo) == 3 * 2 * 16 * 32 * 32
    mesh = zshard.make_mesh(1, 8)
    text = """HloModule m

ENTRY %main (p: f32[8]) -> f32[64] {
  %p = f32[8]{0} parameter(0)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
  %agd = f32[64]{0} all-gather-done(%ags)
  %ags2 = (f32[8]{0}, f32[64]{0}) all-gather-start(%fusion.1), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":true}}
  %agd2 = f32[64]{0} all-gather-done(%ags2)
  ROOT %ag3 = f32[64]{0} all-gather(%p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""
    got = [(c["op"], c["axis"], c["bytes"], c["async"], c["compute_between"]) for c in overlap(text, mesh)]
    assert got == [("all-gather", "shard", 256, True, 1), ("all-gather", "shard", 256, False, 0), ("all-gather", "shard", 256, False, 0)]


def test_plan_without_the_cuda_plugin_says_so(monkeypatch, tmp_path):
    # as after the README's `pip install -e ".[train]"`: no jax_plugins package, so find_spec raises
    real = importlib.util.find_spec

    def find_spec(name, *a):
        if name.startswith("jax_plugins"):
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    # --device-memory-gb 0.0001: the verdict DOES NOT FIT (FITS: test_plan_cli_reports_and_gives_a_verdict, and with the
    # default budget test_plan_cli_tensor_axis); one plan of the TINY Llama serves both
    out, summary, _ = _plan(monkeypatch, tmp_path, "--target", "h200", "--mesh", "1x2", "--seq-len", "16", "--device-memory-gb", "0.0001")
    assert "--target h200: jax's CUDA plugin is not installed (the cuda12 extra): compiling on 2 emulated CPU devices" in out
    assert summary["target"] == "cpu" and summary["mesh"] == {"replica": 1, "shard": 2, "tensor": 1, "context": 1}
    # the prediction is on the target asked for (train/planning), from the CPU program's collectives
    assert summary["prediction"]["profile"] == "h200" and "predicted on h200 (collective bytes from the cpu program)" in out
    assert summary["step_s"] > 0 and 0 < summary["mfu"] < 1 and summary["compiled"]
    assert "DOES NOT FIT" in out and "FITS (margin" not in out and not summary["fits"] and summary["device_memory_gb"] == 0.0001, out[-1000:]
    assert summary["reason"].startswith("peak ") and " per device > " in summary["reason"], summary["reason"]  # the prediction says why
    # python -m train's own flags: the 2 devices (its default is 8) and the bf16 compute of a GPU target
    assert summary["command"] == "python -m train --model tiny-llama --mesh 1x2 --devices 2 --strategy FULL_SHARD " \
        "--batch-size 2 --seq-len 16 --remat block --param-dtype bfloat16 --reduce-dtype float32"
    assert summary["attention"]["kernel"] == "xla" and summary["memory"]["temp"] > 0


def test_llama_3_2_1b_preset_and_its_flop_count():
    """The preset has Llama 3.2 1B's 1,235,814,400 parameters (Meta's model card: 1.23B), and with
    tied embeddings every parameter multiplies (the table is the output head), so the MFU count
    of train/bench/gpu.py takes all of them; an untied table is a lookup and is left out."""
    cfg = plan.PLAN_PRESETS["llama-3.2-1b"]
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert total == 1_235_814_400 and multiplying_params(model) == total
    untied = nnx.eval_shape(lambda: Llama(LlamaConfig(**{**vars(cfg), "tie_embeddings": False}), rngs=nnx.Rngs(0)))
    assert multiplying_params(untied) == total  # + the head, - the table: the same size
    # PaLM appendix B: 6 N + 12 L H Q T
    assert model_flops_per_token(cfg, total) == 6 * total + 12 * 16 * 32 * 64 * 4096
