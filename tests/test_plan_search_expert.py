"""The plan search with the expert axis (train/planning/search.py on a mixture of experts): the candidates
``R x S x X``, their memory floor against the compiled program, the pruning against brute force, the
formula traffic (all-to-all of zshard.moe.a2a_bytes), the JSON's ``mesh.expert`` and the ``--expert`` command."""

import jax
import pytest

from train.model import MoEConfig
from train.planning import load_profile
from train.planning.cost import Workload, formula_traffic
from train.planning.search import WITH_EXPERT, compile_candidate, enumerate_candidates, memory_floor, search

CFG = MoEConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, n_experts=4, top_k=2,
                d_expert=16, scan=True)
SEQ, BATCH = 16, 8


def test_the_space_has_the_expert_axis_where_zshard_takes_it():
    cands = enumerate_candidates(8, CFG, SEQ, BATCH, ("block",))
    with_x = [c for c in cands if c["mesh"]["expert"] > 1]
    assert {c["mesh"]["expert"] for c in with_x} == {2, 4}  # divisors of the 4 experts (and of the 8 devices per node)
    for c in with_x:
        m = c["mesh"]
        assert m["tensor"] == m["context"] == 1 and c["strategy"] in WITH_EXPERT
        assert m["replica"] * m["shard"] * m["expert"] == 8
        assert c["micro_batch"] * c["accumulation"] * m["replica"] * m["shard"] * m["expert"] == BATCH
    assert all(c["mesh"]["expert"] == 1 for c in cands if c["mesh"]["tensor"] > 1 or c["mesh"]["context"] > 1)
    # an expert group inside a node: with 2 devices per node only X = 2
    assert {c["mesh"]["expert"] for c in enumerate_candidates(8, CFG, SEQ, BATCH, ("block",), devices_per_node=2)} == {1, 2}


def test_formula_traffic_with_the_expert_axis():
    """By hand: 1x2x4 FULL_SHARD, remat none: the dense part over shard+expert (8 ways), the experts' E/X over shard
    (2 ways), the all-to-all of a2a_bytes 4 times per layer."""
    w = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ, remat="none")
    mesh = {"replica": 1, "shard": 2, "tensor": 1, "context": 1, "expert": 4}
    t = {(c["kind"], c["axis"]): c for c in formula_traffic(w, mesh, "FULL_SHARD", gather_bytes=4, activation_bytes=4)}
    pe = 4 * 3 * 32 * 16 * 2
    assert w.expert_params == pe
    dense = w.psi - pe
    assert t["all-gather", "shard+expert"]["bytes"] == pytest.approx(2 * dense * 4 * 7 / 8)
    assert t["all-gather", "shard"]["bytes"] == pytest.approx(2 * pe / 4 * 4 * 1 / 2)
    assert t["reduce-scatter", "shard"]["bytes"] == pytest.approx(pe / 4 * 4 * 1 / 2)
    # one device: 1 sequence of 16 tokens; dropless capacity 16 * min(2, 4/4) = 16 rows to each of the 3 others
    a2a = t["all-to-all", "expert"]
    assert a2a["count"] == 4 * 2 and a2a["bytes"] == 8 * 3 * 16 * 32 * 4
    with pytest.raises(ValueError, match="SHARD_OPT"):
        formula_traffic(w, mesh, "SHARD_OPT")


def _picked(pick):
    return [c for c in enumerate_candidates(8, CFG, SEQ, BATCH, ("block",))
            if (c["mesh"]["expert"], c["mesh"]["replica"], c["strategy"]) in pick and c["accumulation"] == 1]


def _check_floor(c, rep, peak):
    w = Workload.of_config(CFG, global_batch=BATCH, seq_len=SEQ)
    floor = memory_floor(c, CFG, w.psi, SEQ, expert_params=w.expert_params)["total"]
    assert 0 < floor <= peak, (c, floor, peak)
    assert any(x["kind"] == "all-to-all" for x in rep.collectives), c  # the program does dispatch over expert


@pytest.fixture(scope="module")
def brute():
    """The expert part of the space brute-forced (remat block, no accumulation, compiled): X = 2 on R = 1 with FULL_SHARD
    and SHARD_GRAD_OP, X = 4 on R = 2 with HYBRID_SHARD (HYBRID_SHARD_ZERO2: the exhaustive test below)."""
    cands = _picked({(2, 1, "FULL_SHARD"), (2, 1, "SHARD_GRAD_OP"), (4, 2, "HYBRID_SHARD")})
    return [(c, *compile_candidate(c, CFG, SEQ, BATCH, jax.devices()[:8])[:2]) for c in cands]


# its floor's terms are HYBRID_SHARD's shards (X = 4 on R = 2) and SHARD_GRAD_OP's gathered parameters (X = 2), both in brute
@pytest.mark.exhaustive
def test_floor_of_hybrid_shard_zero2_with_the_expert_axis():
    (c,) = _picked({(4, 2, "HYBRID_SHARD_ZERO2")})
    _check_floor(c, *compile_candidate(c, CFG, SEQ, BATCH, jax.devices()[:8])[:2])


def test_floor_below_the_compiled_peak_and_pruning_keeps_what_fits(brute):
    """The floor never exceeds the compiled peak (so no budget prunes what fits), and a budget that one expert
    candidate just fits prunes others but keeps it."""
    assert len(brute) == 3
    for c, rep, peak in brute:
        _check_floor(c, rep, peak)
    budget = min(p for _, _, p in brute)  # one expert candidate fits: the pruning must keep it
    res = search(CFG, model="tiny-moe", devices=8, seq=SEQ, batch=BATCH, profile=load_profile("cpu"), budget=budget,
                 compile_devices=None, remats=("block",))
    key = lambda c: (tuple(c["mesh"].values()), c["strategy"], c["remat"], c["accumulation"])  # noqa: E731
    pruned = {key(c) for c in res["candidates"] if c["pruned"]}
    assert pruned, "the budget prunes nothing: the test would not test the pruning"
    assert not pruned & {key(c) for c, _, p in brute if p <= budget}
    best = next(c for c in res["candidates"] if c["mesh"]["expert"] > 1)
    assert f"--expert {best['mesh']['expert']}" in best["command"] and best["step_s"] > 0
