"""The plan search (train/planning/search.py, ``python -m train.plan --search``): pruning against brute force,
memory exact against the compiled program, the JSON fields, the errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zshard
from train import plan
from train.model import PLAN_PRESETS, build_model, cross_entropy_loss
from train.models import GPTConfig
from train.planning import load_profile
from train.planning.search import enumerate_candidates, memory_floor, compile_candidate, search, what_would_fit
from train.planning.search_cli import JSON_FIELDS

CFG = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, scan=True)
SEQ, BATCH = 32, 8


def _psi():
    model = nnx.eval_shape(lambda: build_model(CFG, nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# HYBRID_SHARD_ZERO2's floor is HYBRID_SHARD's shards (2x4, in the brute force) plus SHARD_GRAD_OP's gathered
# parameters (1x8, in the brute force): its compiled candidate is checked under -m exhaustive (one compile fewer).
REPEATED_FLOOR = ("HYBRID_SHARD_ZERO2",)


def _space():
    """The tiny GPT on meshes 1x8 and 2x4 (every strategy of each), remat block, and FULL_SHARD without remat."""
    return [c for c in enumerate_candidates(8, CFG, SEQ, BATCH, ("block", "none"))
            if c["mesh"]["tensor"] == c["mesh"]["context"] == 1 and c["accumulation"] == 1 and c["mesh"]["replica"] <= 2
            and (c["remat"] == "block" or c["strategy"] == "FULL_SHARD")]


@pytest.fixture(scope="module")
def brute():
    """A small space brute-forced (:func:`_space` but :data:`REPEATED_FLOOR`), each candidate compiled."""
    out = []
    for c in _space():
        if c["strategy"] not in REPEATED_FLOOR:
            rep, peak, _ = compile_candidate(c, CFG, SEQ, BATCH, jax.devices()[:8])
            out.append((c, rep, peak))
    return out


def _check_floor(c, peak):
    floor = memory_floor(c, CFG, _psi(), SEQ)["total"]
    assert 0 < floor <= peak, (c, floor, peak)


def test_floor_never_above_the_compiled_peak(brute):
    """The pruning bound: no candidate the compiled program fits is pruned, whatever the budget."""
    assert len(brute) == 7 and len(_space()) == 8
    for c, _, peak in brute:
        _check_floor(c, peak)


@pytest.mark.exhaustive  # its floor's terms: HYBRID_SHARD's and SHARD_GRAD_OP's (REPEATED_FLOOR)
@pytest.mark.parametrize("strategy", REPEATED_FLOOR)
def test_floor_of_a_repeated_strategy(strategy):
    c = next(c for c in _space() if c["strategy"] == strategy)
    _check_floor(c, compile_candidate(c, CFG, SEQ, BATCH, jax.devices()[:8])[1])


def test_search_keeps_what_brute_force_finds_fitting_and_best(brute):
    """With a budget between the compiled peaks, the search's pruning keeps every candidate brute force finds
    fitting, and brute force's best (by the predicted step from its program) is among the candidates it keeps."""
    peaks = sorted(p for _, _, p in brute)
    budget = peaks[len(peaks) // 2]
    profile = load_profile("cpu")
    res = search(CFG, model="tiny", devices=8, seq=SEQ, batch=BATCH, profile=profile, budget=budget, compile_devices=None,
                 remats=("block", "none"))
    key = lambda c: (tuple(c["mesh"].values()), c["strategy"], c["remat"], c["accumulation"])  # noqa: E731
    space = {key(c) for c, _, _ in brute}
    pruned = {key(c) for c in res["candidates"] if c["pruned"]} & space
    assert pruned, "the budget prunes nothing: the test would not test the pruning"
    fitting = [(c, p) for c, _, p in brute if p <= budget]
    assert fitting and len(fitting) < len(brute)
    assert not pruned & {key(c) for c, _ in fitting}
    best = min(fitting, key=lambda cp: _predicted(cp[0], next(r for c, r, _ in brute if c is cp[0]), profile))[0]
    assert key(best) not in pruned


def _predicted(c, rep, profile):
    from train.planning import Workload, predict, traffic_of_report

    w = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ, remat=c["remat"])
    return predict(w, traffic_of_report(rep), profile, c["mesh"], strategy=c["strategy"]).step_s


def test_compiled_memory_exact(brute):
    """A finalist's memory_bytes is the compiled program's argument + output - alias + temp."""
    c, rep, peak = next((c, r, p) for c, r, p in brute if c["strategy"] == "FULL_SHARD" and c["remat"] == "block")
    m = c["mesh"]
    mesh = zshard.make_mesh(m["replica"], m["shard"], devices=jax.devices()[:8])
    state = zshard.init(lambda: build_model(CFG, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy="FULL_SHARD", abstract=True)
    step = zshard.make_train_step(cross_entropy_loss, remat="block")
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    ma = step.lower(state, (tokens, tokens)).compile().memory_analysis()
    want = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    assert peak == want


@pytest.fixture
def tiny_preset(monkeypatch):
    monkeypatch.setitem(PLAN_PRESETS, "tiny-search", CFG)
    return "tiny-search"


def test_cli_json_fields_and_ranking(tiny_preset, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = plan.main(["--model", tiny_preset, "--devices", "8", "--seq-len", str(SEQ), "--global-batch-tokens", str(BATCH * SEQ),
                    "--search", "--finalists", "1", "--remat", "block", "--device-memory-gb", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "best:" in text and "tok/s/dev" in text
    got = json.loads(out.read_text())["candidates"]
    assert len(got) >= 3
    for c in got:
        assert set(JSON_FIELDS) <= set(c)
        assert set(c["mesh"]) == {"replica", "shard", "tensor", "context"}
        assert np.prod(list(c["mesh"].values())) == 8
        assert c["micro_batch"] * c["accumulation"] * c["mesh"]["replica"] * c["mesh"]["shard"] == BATCH
        assert c["command"].startswith(f"python -m train --model {tiny_preset}")
    assert got[0]["compiled"] and got[0]["fits"]
    assert sum(c["compiled"] for c in got) == 1
    fit = [c["step_s"] for c in got if c["fits"] and not c["compiled"]]
    assert fit == sorted(fit)


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-9t", "--devices", "8"], "--model 'llama-9t': choose one of"),
    (["--model", "llama-7b", "--devices", "8", "--target", "tpu9"], "--target"),
    (["--model", "llama-7b", "--devices", "7", "--batch-size", "8"], "--devices 7: no mesh"),
    (["--model", "llama-7b", "--devices", "8", "--seq-len", "2048", "--global-batch-tokens", "3000"],
     "--global-batch-tokens 3000 does not divide"),
    (["--model", "llama-7b", "--devices", "8", "--mesh", "1x8"], "--mesh: --search chooses the mesh"),
    (["--model", "llama-7b", "--devices", "8", "--remat", "block,most"], "--remat most"),
    (["--model", "llama-7b"], "--search needs --devices"),
])
def test_errors_before_compiling(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(argv + ["--search"])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_mesh_required_without_search(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--model", "llama-7b"])
    assert "--mesh is required" in capsys.readouterr().err


def test_nothing_fits_says_what_would():
    """llama-70b on 8 devices of 80 GB: no state fits; 16+ devices, or the optimizer offloaded, would."""
    cfg = PLAN_PRESETS["llama-70b"]
    res = search(cfg, model="llama-70b", devices=8, seq=4096, batch=8, profile=load_profile("h100"), budget=80e9)
    assert not any(c["fits"] for c in res["candidates"])
    assert all(c["reason"] for c in res["candidates"])
    lines = what_would_fit(cfg, devices=8, seq=4096, batch=8, budget=80e9, psi=69_000_000_000, activation_bytes=2)
    assert any(line.startswith("--devices ") for line in lines)


@pytest.mark.parametrize("flag", ["--mesh", "--strategy", "--mesh.shape"])
def test_auto_refuses_the_flags_it_chooses(flag, capsys):
    from train.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--auto", f"{flag}=1x8" if "mesh" in flag else flag, *([] if "mesh" in flag else ["FULL_SHARD"])])
    assert e.value.code == 2
    assert f"{flag}: --auto chooses" in capsys.readouterr().err


@pytest.mark.exhaustive  # tests/test_train_auto.py runs the same choice end to end
def test_auto_chooses_and_records(tmp_path):
    """choose() writes the best candidate into the Config (what config.toml records) and the Config validates;
    summary.json's auto holds the predicted and the median measured step_s."""
    from train.config import Config
    from train.planning.auto import auto_summary, choose

    run = Config()
    run.model.preset, run.model.seq_len, run.training.batch_size = "nano", 32, 8
    auto = choose(run, jax.devices()[:8], finalists=1, log=lambda *a: None)
    c = auto["choice"]
    m = c["mesh"]
    assert run.mesh.shape.startswith(f"{m['replica']}x{m['shard']}")
    assert (run.mesh.strategy, run.training.remat, run.training.grad_accum) == (c["strategy"], c["remat"], c["accumulation"])
    assert c["compiled"] and auto["predicted_step_s"] == c["step_s"] > 0
    run.validate(8)
    got = auto_summary(auto, [{"step_time_s": 9.0}, {"step_time_s": 1.0}, {"step_time_s": 3.0}, {"step_time_s": 2.0}])["auto"]
    assert got["measured_step_s"] == 2.0 and got["ratio"] == pytest.approx(2.0 / c["step_s"])
    assert auto_summary(None, []) == {}


@pytest.mark.parametrize("scipy", [True, False])
def test_spearman(scipy, monkeypatch):
    """The benchmark's rank correlation, with scipy and with numpy's ranks (ties: mean ranks)."""
    import sys

    from train.bench.planned import spearman

    if not scipy:
        monkeypatch.setitem(sys.modules, "scipy.stats", None)  # import fails: the numpy path
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


def test_help_lists_auto():
    """``python -m train --help`` documents ``--auto`` (its parser takes the flag; take_auto removes it before parsing)."""
    from train.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--auto " in text and "plan search" in text and "Refused beside --mesh, --strategy" in text
