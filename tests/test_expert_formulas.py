"""Expert parallelism's formulas (zshard/expert_formulas.py) against hand-computed values, and the
HLO reader naming a collective over an ``expert`` mesh axis (a hand-made ``shard_map`` program:
``jax.lax.all_to_all`` over ``expert``, a gather over ``shard x expert``), its bytes against the
all-to-all formula. Cheap: the formulas are arithmetic, the program two collectives."""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zshard import formulas
from zshard.inspection.hlo import parse_collectives


# --------------------------------------------------------------------------------------
# The formulas, by hand
# --------------------------------------------------------------------------------------


def test_all_to_all_bytes_by_hand():
    # 1024 tokens x top-8 x D 2048 x bf16 (2 bytes) x (X-1)/X, X = 8: 1024*8*2048*2*7/8
    assert formulas.all_to_all_bytes(1024, 8, 2048, 2, 8) == 29_360_128.0
    assert formulas.all_to_all_bytes(1024, 8, 2048, 2, 1) == 0.0  # one group: nothing leaves the device
    assert formulas.all_to_all_bytes(6, 2, 16, 4, 2) == 6 * 2 * 16 * 4 / 2  # 384


def test_padded_all_to_all_bytes_by_hand():
    # buffer [X, cap, D] = [2, 12, 16] float32 = 1536 bytes; half of it leaves: 768 = cap*D*e*(X-1)
    assert formulas.padded_all_to_all_bytes(12, 16, 4, 2) == 768.0
    assert formulas.padded_all_to_all_bytes(12, 16, 4, 4) == 12 * 16 * 4 * 3  # [4, 12, 16]: 3/4 of 3072 bytes
    # dropless: cap = n k (the worst case), X times the exact bytes
    cap = formulas.dropless_capacity(6, 2)
    assert cap == 12
    for X in (2, 4, 8):
        assert formulas.padded_all_to_all_bytes(cap, 16, 4, X) == pytest.approx(X * formulas.all_to_all_bytes(6, 2, 16, 4, X))


def test_all_to_all_per_step_counts_four_or_six_per_layer():
    per = formulas.all_to_all_bytes(6, 2, 16, 4, 2)
    assert per == 384.0
    assert formulas.expert_all_to_all_per_step(3, 6, 2, 16, 4, 2, remat=False) == 3 * 4 * 384
    assert formulas.expert_all_to_all_per_step(3, 6, 2, 16, 4, 2, remat=True) == 3 * 6 * 384
    assert formulas.expert_all_to_all_per_step(3, 6, 2, 16, 4, 2, grad_accum=2, remat=False) == 2 * 3 * 4 * 384
    assert formulas.expert_all_to_all_per_step(1, 6, 2, 16, 4, 2, remat=False, capacity=12) == 4 * 768


def test_state_with_the_expert_axis_by_hand():
    # Psi_d = 800, Psi_x = 3200 over N = S*X = 8 devices, X = 2, fp32, Adam (2 moments)
    s = formulas.expert_state_bytes(800, 3200, 8, 2)
    assert s["dense"] == 4 * 800 / 8 == 400.0
    assert s["expert"] == 4 * 3200 / (2 * 4) == 1600.0  # 1600 experts' elements per expert group, over S = 4
    assert s["params"] == 2000.0 and s["opt_state"] == 4000.0 and s["total"] == 6000.0
    # the same per device as without the axis on the same N devices: the axis moves bytes, it does not add any
    assert formulas.expert_state_bytes(800, 3200, 8, 1)["total"] == s["total"]
    with pytest.raises(ValueError, match="expert=3 must divide shards=8"):
        formulas.expert_state_bytes(800, 3200, 8, 3)


def test_gathered_block_and_gathers_by_hand():
    # one block: dense 100, experts 1600 (E experts), X = 2, bf16: 2 * (100 + 800) = 1800 bytes
    assert formulas.gathered_block_bytes(100, 1600, 2, 2) == 1800.0
    assert formulas.gathered_block_bytes(100, 1600, 1, 2) == 3400.0  # no EP: every expert
    g = formulas.expert_gather_bytes(100, 1600, 8, 2, 4)  # N = 8: dense over 8, experts over S = 4
    assert g["dense"] == 2 * 4 * 100 * 7 / 8 == 700.0
    assert g["expert"] == 2 * 4 * 800 * 3 / 4 == 4800.0
    g1 = formulas.expert_gather_bytes(100, 1600, 8, 1, 4)  # no EP: every expert over the 8
    assert g1["expert"] == 2 * 4 * 1600 * 7 / 8 == 11200.0
    # the benchmark's row: S = 4, X = 2 against S = 8: 3/7 of the expert bytes (<= 0.5)
    assert formulas.expert_gather_ratio(8, 2) == pytest.approx(4800 / 11200) == pytest.approx(3 / 7)
    assert formulas.expert_gather_ratio(8, 8) == 0.0  # each device one whole expert: nothing to gather


@pytest.mark.parametrize("call", [lambda: formulas.all_to_all_bytes(8, 0, 4, 4, 2),
                                  lambda: formulas.all_to_all_bytes(8, 2, 4, 4, 0),
                                  lambda: formulas.padded_all_to_all_bytes(-1, 4, 4, 2)])
def test_bad_input_is_refused(call):
    with pytest.raises(ValueError, match="expert formula"):
        call()


# --------------------------------------------------------------------------------------
# The HLO reader on a mesh with an expert axis (a hand-made program)
# --------------------------------------------------------------------------------------

X, S, CAP, D = 2, 4, 12, 16


@pytest.fixture(scope="module")
def expert_program():
    """A 1 x 4 x 2 ``(replica, shard, expert)`` mesh; per device a padded dispatch buffer ``[X, cap, D]``
    sent by ``all_to_all`` over ``expert`` and back, and a weight shard gathered over ``shard x expert``."""
    mesh = jax.make_mesh((1, S, X), ("replica", "shard", "expert"), axis_types=(AxisType.Explicit,) * 3)

    def body(buf, w):
        # [X, cap, D] --all_to_all(expert)--> [X, cap, D] (row g from group g)
        out = jax.lax.all_to_all(buf, "expert", 0, 0, tiled=True)
        back = jax.lax.all_to_all(out * 2.0, "expert", 0, 0, tiled=True)  # the combine: the same rows back
        # [D/(S X)] --all_gather(shard, expert)--> [D]
        full = jax.lax.all_gather(w, ("shard", "expert"), tiled=True)
        return back, full[None]  # [1, D] per device

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("shard", "expert")), P(("shard", "expert"))),
                              out_specs=(P(("shard", "expert")), P(("shard", "expert")))))
    split = NamedSharding(mesh, P(("shard", "expert")))
    buf = jax.ShapeDtypeStruct((S * X * X, CAP, D), jnp.float32, sharding=split)  # [S X X, cap, D]: [X, cap, D] per device
    w = jax.ShapeDtypeStruct((S * X * 2,), jnp.float32, sharding=split)
    return mesh, parse_collectives(f.lower(buf, w).compile().as_text(), mesh)


def test_all_to_all_is_attributed_to_the_expert_axis(expert_program):
    mesh, colls = expert_program
    a2a = [c for c in colls if c.kind == "all-to-all"]
    assert len(a2a) == 2, colls
    for c in a2a:
        assert c.axis == "expert" and c.group_size == X
        assert c.buffer_bytes == X * CAP * D * 4  # the padded buffer [X, cap, D], fp32
        assert c.sent_bytes == formulas.padded_all_to_all_bytes(CAP, D, 4, X)


def test_gather_over_shard_and_expert_is_named(expert_program):
    mesh, colls = expert_program
    gathers = [c for c in colls if c.kind == "all-gather"]
    assert [c.axis for c in gathers] == ["shard+expert"], colls
    assert gathers[0].group_size == S * X
    assert gathers[0].sent_bytes == pytest.approx(gathers[0].buffer_bytes * (S * X - 1) / (S * X))


def test_dispatch_formula_reads_the_expert_all_to_alls(expert_program):
    _, colls = expert_program
    call = SimpleNamespace(groups=X, local_experts=4, capacity=CAP, d_model=D, dtype="float32")  # a MoECall's fields
    got = formulas.dispatch_formula([(None, 3, call)], colls, grad_accum=2, remat=False)
    per = formulas.padded_all_to_all_bytes(CAP, D, 4, X)  # 768
    assert got["measured"] == 2 * per  # the program's two all-to-alls, once each
    assert got["collectives"] == [{"buffer_bytes": X * CAP * D * 4, "count": 2}]
    # 3 layers x 2 micro-batches x (4 padded all-to-alls + the slot counts [X, E/X] int32 once): by hand
    assert got["formula"] == 2 * 3 * (4 * 768 + (X - 1) * 4 * 4) and got["layers"] == 3 and got["calls"] == 1
    assert formulas.dispatch_formula(None, colls)["formula"] is None  # nothing recorded: no formula


def test_moe_plan_terms_by_hand():
    from train.scale import MOE_SHAPES, moe_plan

    q = MOE_SHAPES["qwen3-30b-a3b"]
    psi_d, psi_x = q.params()
    assert psi_x == 48 * 128 * 3 * 2048 * 768  # 128 experts of 3 D F per layer
    assert abs((psi_d + psi_x) / 30.5e9 - 1) < 0.01  # the published 30.5 B
    d, x = MOE_SHAPES["deepseek-v3"].params()
    assert abs((d + x) / 671e9 - 1) < 0.01  # the published 671 B (without the multi-token-prediction module)
    r8, r1 = moe_plan(q, 8, 8), moe_plan(q, 8, 1)
    blk_d, blk_x = q.block()
    assert r8["block"] == (2 + 4) * (blk_d + blk_x / 8)  # bf16 gathered + fp32 gradient, E/X experts
    assert r1["block"] == (2 + 4) * (blk_d + blk_x)
    assert r8["state"] + r8["grad_shard"] == r1["state"] + r1["grad_shard"] == 16 * (psi_d + psi_x) / 8
    assert r8["state"] == pytest.approx(formulas.expert_state_bytes(psi_d, psi_x, 8, 8)["total"])  # fp32 params + Adam
    assert r8["gathers"]["expert"] == 0.0  # X = N: each device holds its experts whole, gathers none
    assert r8["a2a"] == 48 * 6 * 4096 * 8 * 2048 * 2 * 7 / 8
    assert r8["a2a_padded"] == 48 * 6 * 4096 * 8 * 2048 * 2 * 7  # cap = n min(k, E/X) = 8n: X times exact


def test_docs_moe_plan_table():
    """docs/expert-parallel.md's plan table is what ``python -m train.scale --moe`` prints."""
    from conftest import ROOT
    from train.scale import MOE_PLANS, MOE_SHAPES, moe_plan, moe_plan_table

    table = moe_plan_table([moe_plan(MOE_SHAPES[m], n, x) for m, n, xs in MOE_PLANS for x in xs])
    page = (ROOT / "docs" / "expert-parallel.md").read_text()
    assert table in page
    reading = page[page.index("How to read it:"):page.index("The compiled step of the same")]
    quoted = re.findall(r"(\d+(?:\.\d+)?)\s+(?:GB/step|GB)\b", reading)
    assert len(quoted) >= 5
    cells = {c.strip() for c in table.split("|")}
    for q in quoted:  # every figure quoted under the table is one of its cells
        assert q in cells, q


def test_parameter_collectives_over_expert_alone_have_their_own_row():
    # a 1 x 1 x 8 mesh (S = 1): the dense parameters' gathers span expert alone; "expert" is the tokens' row
    from zshard.formulas import PARAM_EXPERT, _param_axis

    mesh = jax.make_mesh((1, 1, 8), ("replica", "shard", "expert"), axis_types=(AxisType.Explicit,) * 3)
    assert _param_axis(mesh, ("shard", "expert")) == PARAM_EXPERT == "expert (parameters)"
    mesh = jax.make_mesh((1, 4, 2), ("replica", "shard", "expert"), axis_types=(AxisType.Explicit,) * 3)
    assert _param_axis(mesh, ("shard", "expert")) == "shard+expert" and _param_axis(mesh, ("shard",)) == "shard"
