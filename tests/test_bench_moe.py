"""The benchmark's MoE section (train/bench/moe.py): expert parallelism (1x4x2) against plain FSDP (1x8).

The byte target is asserted from the compiled HLO (no timing): EP gathers at most half of the expert
weights' bytes, exactly the formula's ``3/7`` (zshard.formulas.expert_gather_ratio); the EP step's
``zshard.report`` rows (``shard``, ``shard+expert``, ``expert``) equal their formulas. The reading of
the expert gathers and the not-runnable report are checked on hand-made inputs (no compile)."""

from __future__ import annotations

import pytest

from train.bench import moe
from train.bench.tables import targets
from train.model import MoEConfig
from zshard import formulas
from zshard.inspection.hlo import Collective


def test_expert_gathers_are_read_by_their_gathered_shape():
    cfg = MoEConfig(**moe.MOE_BENCH)
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_expert
    up, down = (E // 2) * D * 2 * F * 4, (E // 2) * F * D * 4  # [E/X, D, 2F], [E/X, F, D] fp32 with X = 2
    colls = [Collective("a", "all-gather", "shard", 4, up, up * 3 / 4, trips=2),
             Collective("b", "all-gather", "shard", 4, down, down * 3 / 4, trips=2),
             Collective("c", "all-gather", "shard+expert", 8, D * D * 4, D * D * 4 * 7 / 8, trips=2),  # a dense weight
             Collective("d", "reduce-scatter", "shard", 4, up, up * 3 / 4)]  # a gradient: not a gather
    got = moe.expert_gathers(colls, cfg, 2)
    assert got == {"bytes": 2 * (up + down) * 3 / 4, "count": 4, "axes": ["shard"]}


def test_the_section_reports_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(moe, "ep_missing", lambda: "zshard.make_mesh has no expert=")
    result = moe.moe_section(1)
    assert result == {"runnable": False, "why": "zshard.make_mesh has no expert="}
    assert "not runnable: zshard.make_mesh has no expert=" in moe.moe_table(result)
    (t,) = [t for t in targets({"configs": {}, "moe": result}) if t["name"].startswith("MoE")]
    assert t["value"] is None and not t["ok"] and "not runnable" in t["note"]


@pytest.fixture(scope="module")
def variants():
    """The section's two compiled steps: EP 1x4x2 (with ``zshard.report``) and no EP 1x8 (HLO only)."""
    import numpy as np

    cfg = MoEConfig(**moe.MOE_BENCH)
    tok = np.zeros((moe.BATCH, cfg.seq_len), np.int32)
    return moe.moe_variant(2, (tok, tok)), moe.moe_variant(1, (tok, tok), with_report=False)


def test_ep_gathers_at_most_half_the_expert_bytes(variants):
    ep, base = variants
    assert ep["expert_gathers"]["axes"] == ["shard"]  # the local experts gathered over shard only
    assert base["expert_gathers"]["axes"] == ["shard"]  # (1x8: shard is every device)
    assert ep["expert_gathers"]["count"] == base["expert_gathers"]["count"] > 0  # the same gathers, smaller
    ratio = ep["expert_gathers"]["bytes"] / base["expert_gathers"]["bytes"]
    assert ratio <= 0.5
    assert ratio == pytest.approx(formulas.expert_gather_ratio(8, 2), rel=1e-6)  # 3/7
    assert ep["a2a_bytes"] > 0 and base["a2a_bytes"] == 0  # the tokens travel instead


def test_report_rows_of_an_expert_mesh_equal_the_formulas(variants):
    rep = variants[0]["report"]
    comm = rep.comm_bytes_per_step
    # dense parameters over shard x expert, the local experts over shard only, the tokens over expert
    for axis in ("shard", "shard+expert", "expert"):
        assert comm[axis]["measured"] > 0 and comm[axis]["ratio"] == pytest.approx(1.0, rel=1e-9), (axis, comm)
    x = rep.expert
    cfg = MoEConfig(**moe.MOE_BENCH)
    n = moe.BATCH // 8 * cfg.seq_len  # tokens per device
    cap = n * min(cfg.top_k, cfg.n_experts // 2)  # dropless: n min(k, E/X)
    buf = 2 * cap * cfg.d_model * 4  # [X, cap, D] fp32
    # remat="block": 6 padded all-to-alls per MoE layer (forward twice, backward once), the slot counts twice
    assert {c["buffer_bytes"]: c["count"] for c in x["collectives"]} == {buf: 6 * cfg.n_layers, 2 * 4 * 4: 2 * cfg.n_layers}
    assert x["layers"] == cfg.n_layers and x["formula"] == x["measured"]
    assert "expert axis:" in rep.table()


def test_state_and_gathered_block_equal_the_formulas_with_x(variants):
    import math

    state, rep = variants[0]["state"], variants[0]["report"]
    plan = state.plan
    size = lambda rec: math.prod(rec.shape) * (rec.layers or 1)  # noqa: E731
    psi_x = sum(size(r) for r in plan.layouts.values() if r.expert)
    psi_d = sum(size(r) for r in plan.layouts.values() if not r.expert)
    assert psi_x > psi_d > 0
    # fp32 parameters + Adam's two moments: dense over the 8 devices, E/X experts over S = 4
    assert rep.model_state_bytes["formula"]["total"] == pytest.approx(formulas.expert_state_bytes(psi_d, psi_x, 8, 2)["total"],
                                                                      rel=1e-4)  # (Adam's step counts: a few bytes)
    assert rep.model_state_bytes["ratio"] == pytest.approx(1.0, abs=1e-4)  # measured shards (padding: a few elements)
    block = next(u for u in plan.units if u.layers)
    slots = [s.param for f in block.flats for s in f.slots]
    gathered = sum(p.piece_padded * p.dtype.itemsize for p in slots)  # what one block call gathers
    layer = lambda rec: math.prod(rec.shape)  # noqa: E731
    assert gathered == formulas.gathered_block_bytes(sum(layer(p) for p in slots if not p.expert),
                                                     sum(layer(p) for p in slots if p.expert), 2, 4)


@pytest.mark.exhaustive  # the default run checks the 1x4x2 FULL_SHARD rows (test_report_rows_of_an_expert_mesh_...)
@pytest.mark.parametrize("mesh,strategy", [((1, 1, 8), "FULL_SHARD"), ((2, 2, 2), "FULL_SHARD"), ((2, 2, 2), "HYBRID_SHARD")])
def test_report_rows_on_other_expert_meshes(mesh, strategy):
    import numpy as np
    import optax
    from flax import nnx

    import zshard
    from train.model import build_model, moe_loss

    cfg = MoEConfig(**moe.MOE_BENCH)
    state = zshard.init(lambda: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-3), zshard.make_mesh(*mesh[:2], expert=mesh[2]),
                        strategy=strategy, expert_parallel=moe.EP_GLOB)
    tok = np.zeros((moe.BATCH, cfg.seq_len), np.int32)
    rep = zshard.report(zshard.make_train_step(moe_loss, has_aux=True, grad_accum=2), state, (tok, tok))
    for axis, row in rep.comm_bytes_per_step.items():  # S = 1: the dense parameters' row is "expert (parameters)"
        assert row["ratio"] == pytest.approx(1.0, rel=1e-9), (axis, rep.comm_bytes_per_step)
    assert rep.expert["formula"] == rep.expert["measured"] > 0
