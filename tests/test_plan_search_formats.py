"""The plan search over the quantized wire formats (``--formats``, train/planning/formats.py): the space zshard takes,
the floor and the pruning against brute force with formats and error feedback, a quantized finalist's memory exact
against the compiled program, the JSON fields and the ``python -m train`` flags of the command."""

import json
import shlex

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import zshard
from train import plan
from train.cli import parse_config
from train.model import PLAN_PRESETS, build_model, cross_entropy_loss
from train.models import GPTConfig
from train.planning import Workload, load_profile, predict, traffic_of_report
from train.planning.formats import Matrices, format_pairs, parse_formats
from train.planning.search import compile_candidate, enumerate_candidates, memory_floor, search
from train.planning.search_cli import JSON_FIELDS
from train.planning.single import train_command

CFG = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, scan=True)
SEQ, BATCH = 32, 8
FORMATS = (None, "int8")
KEY = lambda c: (tuple(c["mesh"].values()), c["strategy"], c["remat"], c["accumulation"],  # noqa: E731
                 c["gather_format"], c["reduce_format"], c["error_feedback"])


def test_the_space_has_the_formats_zshard_takes():
    cands = enumerate_candidates(8, CFG, SEQ, BATCH, ("block",), formats=FORMATS, error_feedback=True)
    plain = enumerate_candidates(8, CFG, SEQ, BATCH, ("block",))
    assert len(cands) > len(plain) and all(not (c["gather_format"] or c["reduce_format"]) for c in plain)
    for c in cands:
        m, q = c["mesh"], c["gather_format"] or c["reduce_format"]
        if c["strategy"] in ("NO_SHARD", "SHARD_OPT") or m["shard"] * m["context"] * (1 if c["strategy"].startswith("HYBRID") else
                                                                                         m["replica"]) == 1:
            assert not q, c  # no shard-axis collective to quantize: zshard refuses, or the format applies to nothing
        if m["tensor"] > 1:
            assert not c["gather_format"], c  # Shardy fails to lower it inside nnx.scan (formats.format_pairs)
            assert not c["error_feedback"], c  # check_plan refuses error feedback on tensor-split parameters
        if c["strategy"] == "HYBRID_SHARD_OPT":
            assert not c["error_feedback"], c
        assert c["error_feedback"] == bool(c["reduce_format"])
    full = [c for c in cands if c["strategy"] == "FULL_SHARD" and c["mesh"]["shard"] == 8 and c["accumulation"] == 1]
    assert {(c["gather_format"], c["reduce_format"]) for c in full} == {(g, r) for g in FORMATS for r in FORMATS}
    tp = {(c["gather_format"], c["reduce_format"]) for c in enumerate_candidates(8, CFG, SEQ, BATCH, ("block",), formats=FORMATS)
          if c["mesh"]["tensor"] == 2 and c["strategy"] == "FULL_SHARD"}
    assert tp == {(None, None), (None, "int8")}
    expert = {"mesh": {"replica": 1, "shard": 4, "tensor": 1, "context": 1, "expert": 2}, "strategy": "FULL_SHARD"}
    assert format_pairs(expert, FORMATS, scan=True) == [(None, None, False)]
    assert parse_formats("none, int8,int8") == (None, "int8")
    with pytest.raises(ValueError, match="int3"):
        parse_formats("int3")


@pytest.fixture(scope="module")
def brute():
    """Five candidates compiled: HYBRID_SHARD 2x4 unquantized, FULL_SHARD 1x8 with int8 gathers and
    with int8 gathers and reductions and error feedback, HYBRID_SHARD 2x4 and SHARD_GRAD_OP 1x8 with int8 reductions and
    error feedback (block remat, no accumulation)."""
    want = {((2, 4, 1, 1), "HYBRID_SHARD", None, None),
            ((1, 8, 1, 1), "FULL_SHARD", "int8", None), ((1, 8, 1, 1), "FULL_SHARD", "int8", "int8"),
            ((2, 4, 1, 1), "HYBRID_SHARD", None, "int8"), ((1, 8, 1, 1), "SHARD_GRAD_OP", None, "int8")}
    both = (enumerate_candidates(8, CFG, SEQ, BATCH, ("block",), formats=FORMATS)
            + enumerate_candidates(8, CFG, SEQ, BATCH, ("block",), formats=FORMATS, error_feedback=True))
    cands = list({KEY(c): c for c in both if c["accumulation"] == 1 and c["error_feedback"] == bool(c["reduce_format"])
                  and (tuple(c["mesh"].values()), c["strategy"], c["gather_format"], c["reduce_format"]) in want}.values())
    assert len(cands) == len(want)
    return [(c, *compile_candidate(c, CFG, SEQ, BATCH, jax.devices()[:8])[:2]) for c in cands]


def test_floor_below_the_compiled_peak_and_pruning_keeps_what_fits(brute):
    """The floor (error-feedback residuals included) is never above the compiled peak; with a budget between the
    peaks the search with formats prunes none of the candidates that fit, nor brute force's best."""
    psi = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ).psi
    mats = Matrices.of_config(CFG)
    for c, rep, peak in brute:
        q = mats.quantized(8 if c["strategy"] != "HYBRID_SHARD" else 4, 256)
        floor = memory_floor(c, CFG, psi, SEQ, feedback_params=q)
        assert 0 < floor["total"] <= peak, (c, floor, peak)
        assert (floor["feedback"] > 0) == c["error_feedback"]
        kinds = {x["kind"] for x in rep.collectives}
        assert ("all-to-all" in kinds) == bool(c["reduce_format"]), rep.collectives  # qgZ: quantized blocks all-to-all-ed
    peaks = sorted(p for _, _, p in brute)
    budget = (peaks[1] + peaks[2]) / 2  # SHARD_GRAD_OP's floor, its residuals included, is above it: pruned
    profile = load_profile("cpu")
    res = search(CFG, model="tiny", devices=8, seq=SEQ, batch=BATCH, profile=profile, budget=budget, remats=("block",),
                 formats=FORMATS, error_feedback=True, log=lambda *_: None)
    res0 = search(CFG, model="tiny", devices=8, seq=SEQ, batch=BATCH, profile=profile, budget=budget, remats=("block",),
                  formats=FORMATS, log=lambda *_: None)
    pruned = {KEY(c) for c in res["candidates"] + res0["candidates"] if c["pruned"]}
    assert pruned & {KEY(c) for c, _, _ in brute}, "the budget prunes nothing in the space: the test would not test the pruning"
    fitting = [(c, r) for c, r, p in brute if p <= budget]
    assert 0 < len(fitting) < len(brute)
    assert not pruned & {KEY(c) for c, _ in fitting}
    w = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ)
    best = min(fitting, key=lambda cr: predict(w, traffic_of_report(cr[1]), profile, cr[0]["mesh"], strategy=cr[0]["strategy"]).step_s)
    assert KEY(best[0]) not in pruned


def test_quantized_finalist_memory_is_the_compiled_programs(brute):
    """compile_candidate's peak of FULL_SHARD 1x8 with int8 gathers and reductions and error feedback is the
    program's argument + output - alias + temp, built here by hand."""
    c, rep, peak = next(x for x in brute if x[0]["gather_format"] and x[0]["reduce_format"])
    assert c["error_feedback"]
    mesh = zshard.make_mesh(1, 8, devices=jax.devices()[:8])
    mp = zshard.MixedPrecision(gather_format=zshard.Quant("int8", block=256),
                               reduce_format=zshard.Quant("int8", block=256, error_feedback=True))
    state = zshard.init(lambda: build_model(CFG, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy="FULL_SHARD", abstract=True,
                        mixed_precision=mp)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    ma = zshard.make_train_step(cross_entropy_loss, remat="block").lower(state, (tokens, tokens)).compile().memory_analysis()
    assert peak == ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes


def test_command_carries_the_train_flags():
    cmd = train_command("small", {"replica": 2, "shard": 4, "tensor": 1, "context": 1}, "HYBRID_SHARD", 16, 128, "block",
                        formats={"gather_format": "int8", "reduce_format": "int4", "error_feedback": True, "block": 128})
    assert cmd.endswith("--gather-format int8 --reduce-format int4 --error-feedback --quant-block 128")
    run, _ = parse_config(shlex.split(cmd)[3:])
    pr = run.precision
    assert (pr.gather_format, pr.reduce_format, pr.error_feedback, pr.block) == ("int8", "int4", True, 128)
    plain = train_command("small", {"replica": 1, "shard": 8}, "FULL_SHARD", 16, 128, "block")
    assert plain == train_command("small", {"replica": 1, "shard": 8}, "FULL_SHARD", 16, 128, "block", formats={})
    assert "format" not in plain


def test_cli_json_has_the_formats(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(PLAN_PRESETS, tiny_preset := "tiny-search", CFG)
    out = tmp_path / "plan.json"
    rc = plan.main(["--model", tiny_preset, "--devices", "8", "--seq-len", str(SEQ), "--global-batch-tokens", str(BATCH * SEQ),
                    "--search", "--finalists", "0", "--remat", "block", "--formats", "none,int8,int4", "--error-feedback",
                    "--device-memory-gb", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "wire g/r" in text and "wire formats none,int8,int4 (error feedback)" in text
    got = json.loads(out.read_text())["candidates"]
    assert {"gather_format", "reduce_format", "error_feedback"} <= set(JSON_FIELDS)
    seen = set()
    for c in got:
        assert set(JSON_FIELDS) <= set(c)
        assert c["gather_format"] in FORMATS + ("int4",) and c["reduce_format"] in FORMATS + ("int4",)
        assert c["error_feedback"] == bool(c["reduce_format"])
        flags = shlex.split(c["command"])
        for key, flag in (("gather_format", "--gather-format"), ("reduce_format", "--reduce-format")):
            assert (flags[flags.index(flag) + 1] if flag in flags else None) == c[key]
        assert ("--error-feedback" in flags) == c["error_feedback"]
        seen.add((c["gather_format"], c["reduce_format"]))
    assert len(seen) > 1


@pytest.mark.parametrize("argv, needle", [
    (["--formats", "int3"], "--formats 'int3'"),
    (["--formats", ""], "--formats ''"),
    (["--formats", "none,,int8"], "--formats 'none,,int8'"),
    (["--finalists", "-1"], "--finalists -1: must be 0 or more"),
    (["--formats", "int4", "--quant-block", "255"], "block must be even"),
    (["--gather-format", "int8"], "--gather-format: --search chooses the formats"),
    (["--error-feedback", "--formats", "none"], "--error-feedback corrects"),
])
def test_format_errors_before_compiling(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--model", "llama-7b", "--devices", "8", "--search"] + argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_formats_without_search_refused(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--model", "llama-7b", "--mesh", "1x8", "--formats", "int8"])
    assert "--formats is for --search" in capsys.readouterr().err


@pytest.mark.parametrize("mesh, strategy, g, r, ef", [
    ((1, 4, 2, 1), "FULL_SHARD", None, "int8", False),  # tensor axis, scanned layers: the reduction only
    ((2, 2, 2, 1), "HYBRID_SHARD_OPT", None, "int8", False),
    ((1, 4, 1, 2), "FULL_SHARD", "int8", "int8", False),  # context axis
    ((2, 1, 1, 4), "HYBRID_SHARD_ZERO2", "int8", "int8", True),
])
def test_enumerated_formats_lower(mesh, strategy, g, r, ef):
    """A few of the space's riskier quantized candidates are enumerated and lower (zshard takes them; on 2026-12-06
    all 121 quantized candidates of this space with formats none,int8, with and without error feedback, lowered)."""
    c = next(c for c in enumerate_candidates(8, CFG, SEQ, BATCH, ("block",), formats=FORMATS, error_feedback=ef)
             if KEY(c)[:2] == (mesh, strategy) and (c["gather_format"], c["reduce_format"]) == (g, r) and c["accumulation"] == 1)
    m = c["mesh"]
    from train.model import tensor_plan

    mp = zshard.MixedPrecision(gather_format=g, reduce_format=r and zshard.Quant(r, error_feedback=ef))
    state = zshard.init(lambda: build_model(CFG, nnx.Rngs(0)), optax.adamw(1e-4),
                        zshard.make_mesh(m["replica"], m["shard"], tensor=m["tensor"], context=m["context"], devices=jax.devices()[:8]),
                        strategy=strategy, abstract=True, mixed_precision=mp, tensor_parallel=tensor_plan(CFG, m["tensor"]) or None)
    step = zshard.make_train_step(cross_entropy_loss, remat="block", sequence_axis=1 if m["context"] > 1 else None)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    step.lower(state, (tokens, tokens))


def test_formula_bytes_of_a_quantized_candidate_against_its_program(brute):
    """FULL_SHARD 1x8, int8 gathers and reductions: the formulas' all-to-all (qgZ) and the leftover reduce-scatter (the
    norms and biases no format quantizes) are the program's bytes; the gathers within 20% (the formulas gather the root
    unit twice); the all-to-all over the shard axes hides behind the backward, an expert axis's does not."""
    from train.planning.cost import phase_of
    from train.planning.search import _traffic

    c, rep, _ = next(x for x in brute if x[0]["gather_format"] and x[0]["reduce_format"])
    w = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ)
    formula = {(t["kind"], t["axis"]): t["bytes"] for t in _traffic(c, w, Matrices.of_config(CFG).quantized(8, 256), 4, 256)[0]}
    compiled = {(t["kind"], t["axis"]): t["bytes"] for t in traffic_of_report(rep)}
    assert set(formula) == set(compiled)
    for k in (("all-to-all", "shard"), ("reduce-scatter", "shard")):
        assert formula[k] == pytest.approx(compiled[k], rel=1e-6)
    assert formula[("all-gather", "shard")] == pytest.approx(compiled[("all-gather", "shard")], rel=0.2)
    plain = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ)
    unq = _traffic({**c, "gather_format": None, "reduce_format": None, "error_feedback": False}, plain, 0, 4, 256)[0]
    assert sum(t["bytes"] for t in unq) > 2 * sum(formula.values())
    assert phase_of("all-to-all", "shard", "FULL_SHARD") == "backward"
    assert phase_of("all-to-all", "expert", "FULL_SHARD") == "critical"


def test_a_format_that_would_quantize_nothing_is_left_out():
    """Blocks larger than any matrix's share of a device: zshard would refuse every format, so none is searched."""
    res = search(CFG, model="tiny", devices=8, seq=SEQ, batch=BATCH, profile=load_profile("cpu"), budget=1e9, remats=("block",),
                 formats=FORMATS, block=1 << 20, log=lambda *_: None)
    assert res["candidates"] and not any(c["gather_format"] or c["reduce_format"] for c in res["candidates"])
