"""``python -m train.bench --quick``: the benchmark program runs, its peers agree, its outputs hold together.

One in-process run of the smallest mode (tiny GPT, 8 emulated devices, 3 strategies), plus
the pure formulas of the scale section. No timing is asserted (step and compile times are
only reported).
"""

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from train.bench import median_ratio, train_flops_per_token
from train.bench import main as bench_main
from train.scale import activation_bytes, expected_peak, memory_formula, moment_bytes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    # In this process (conftest already gave jax 8 CPU devices): saves a second jax start-up.
    out = tmp_path_factory.mktemp("bench")
    buf, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("XLA_FLAGS")
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            assert bench_main(["--quick", "--out", str(out)]) == 0
    finally:  # main() sets XLA_FLAGS for the processes it starts; leave the suite's as it was
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved
    return out, buf.getvalue(), json.loads((out / "bench.json").read_text()), err.getvalue()


def test_quick_bench_peers_agree_and_outputs_hold_together(quick):
    out, stdout, res, stderr = quick
    rows = {r["name"]: r for r in res["configs"]["Q"]["rows"]}
    assert list(rows) == ["reference (1 device)", "DDP", "FSDP-compiler", "FSDP-compiler remat=block", "zshard/NO_SHARD",
                          "zshard/FULL_SHARD", "zshard/HYBRID_SHARD", "zshard/FULL_SHARD remat=none",
                          "zshard/FULL_SHARD prefetch=1", "zshard/FULL_SHARD tensor=2"]  # fmt: skip (CPU: the default prefetch is 0)
    ref = rows["reference (1 device)"]["losses"]
    for name, r in rows.items():
        # every peer trains the same model on the same data: same losses over the first two steps
        assert len(r["losses"]) == 2
        for got, want in zip(r["losses"], ref):
            assert abs(got - want) <= 1e-5 * abs(want), (name, r["losses"], ref)
        pd = r["per_device_bytes"]
        assert set(pd) == {"argument", "output", "temp", "alias"} and pd["argument"] > 0
        if name != "reference (1 device)":
            assert len(r["step_s_all"]) == 3 and all(t > 0 for t in r["step_s_all"])
            assert {"DDP", "FSDP-compiler", "FSDP-compiler same remat", "zshard/FULL_SHARD"} == set(r["step_ratio"]), name
    for name in ("zshard/NO_SHARD", "zshard/FULL_SHARD", "zshard/HYBRID_SHARD"):
        assert abs(rows[name]["model_state"]["ratio"] - 1) <= 0.01, name
    # sharding shows in the numbers: 8-way sharded state is 1/8 of the replicated one,
    # and the communication lands on the axes each scheme uses
    ddp, fsdp, full, hyb = (rows[n] for n in ("DDP", "FSDP-compiler", "zshard/FULL_SHARD", "zshard/HYBRID_SHARD"))
    # (within 1e-4: Adam's step count, 4 bytes, stays replicated)
    assert fsdp["model_state"]["measured"] * 8 == pytest.approx(ddp["model_state"]["measured"], rel=1e-4)
    assert full["model_state"]["measured"] * 8 == pytest.approx(ddp["model_state"]["measured"], rel=1e-2)
    assert set(ddp["comm_bytes"]) == {"world"} and set(full["comm_bytes"]) == {"world"}
    assert set(hyb["comm_bytes"]) == {"shard", "replica"}
    assert any(k.startswith("all-gather/") for k in fsdp["collectives"])  # the compiler inserted the gathers
    # ZeRO-3 moves 3 Psi against DDP's 2 Psi (arXiv 1910.02054 section 7); zshard matches its formula
    # at most the formula: gathered per parameter, XLA drops a backward re-gather the recompute
    # does not read (seen on Q: 448 of 1,290,240 bytes, the sent bytes of two 64-float gathers)
    assert 0.999 * full["comm_formula"]["world"] <= full["comm_bytes"]["world"] <= full["comm_formula"]["world"]
    # the printed table and the files
    assert "| zshard/FULL_SHARD |" in stdout and "### Targets" in stdout
    assert "GPU section skipped" in stdout  # the suite runs on CPU
    names = {t["name"] for t in res["targets"]}
    # like with like: each zshard policy against the compiler peer at the same recomputation policy
    assert full["remat"] == "block" and full["prefetch"] == 0 and rows["zshard/FULL_SHARD remat=none"]["remat"] == "none"
    assert full["same_remat_peer"] == "FSDP-compiler remat=block"
    assert rows["zshard/FULL_SHARD remat=none"]["same_remat_peer"] == "FSDP-compiler"
    assert {"Q zshard/FULL_SHARD step time / FSDP-compiler remat=block", "Q zshard/FULL_SHARD remat=none step time / FSDP-compiler",
            "Q zshard/FULL_SHARD (prefetch=0) temp: gathered units beyond activations",
            "Q zshard/FULL_SHARD prefetch=1 temp: gathered units beyond activations",
            "Q zshard/FULL_SHARD tensor=2 temp / zshard/FULL_SHARD temp"} <= names, names
    # the policies are real: recomputing each block adds its forward FLOPs again, for the peer and for zshard
    # (Q: 1.20x for the peer, the embeddings, head and optimizer dilute it; S: 1.23x)
    assert rows["FSDP-compiler remat=block"]["flops"] > 1.1 * fsdp["flops"], (rows["FSDP-compiler remat=block"]["flops"], fsdp["flops"])
    assert full["flops"] > 1.1 * rows["zshard/FULL_SHARD remat=none"]["flops"]
    # zshard: recomputing blocks saves temp; prefetch holds more gathered units at once, never fewer
    assert full["per_device_bytes"]["temp"] < rows["zshard/FULL_SHARD remat=none"]["per_device_bytes"]["temp"]
    assert full["per_device_bytes"]["temp"] <= rows["zshard/FULL_SHARD prefetch=1"]["per_device_bytes"]["temp"]
    assert full["unit_bytes"] == 4 * (12 * 64 * 64 + 10 * 64)  # one gathered GPT block, d_model 64 (no qkv bias; no padding)
    # tensor parallelism inside FSDP (1x4x2, the GPT's TP plan): the activations' all-reduces land on tensor,
    # the state is the formula's, the gathered block halves (its four matrices split; norms and the proj bias not)
    tp = rows["zshard/FULL_SHARD tensor=2"]
    assert set(tp["comm_bytes"]) == {"shard", "tensor"} and tp["comm_bytes"]["tensor"] > 0, tp["comm_bytes"]
    assert abs(tp["model_state"]["ratio"] - 1) <= 0.01
    assert tp["unit_bytes"] == 4 * ((12 * 64 * 64 + 4 * 64) // 2 + 6 * 64)  # split: the matrices and fc.bias; 6 x 64 not
    assert "| zshard/FULL_SHARD tensor=2 |" in stdout
    assert (out / "bench-peers.png").stat().st_size > 10_000
    assert (out / "bench.md").read_text().strip() in stdout
    assert stdout.count("| zshard/FULL_SHARD |") == 1 and "| zshard/FULL_SHARD |" not in stderr  # each table printed once


def test_formulas():
    # Korthikanti et al. 2022 section 4 saved set with full recomputation, fp32, GELU (f = 4h): L*s*b*h + s*b*(8h + 2f) + a*s^2*b
    s, b, h, a, L, V = 4, 1, 8, 2, 3, 10
    gelu, glu = (activation_bytes(h, L, a, 4 * h, V, s, b, glu=g) for g in (False, True))
    assert gelu == {"block": 4 * (L * s * b * h + s * b * 16 * h + a * s * s * b)}
    assert glu["block"] - gelu["block"] == 4 * 2 * s * b * 4 * h
    # the step's moments (train.scale.moment_bytes), elements: layer inputs, softmax copies, the unit, [s, f] and [s, h] buffers
    f, P, Pout = 4 * h, 100, 30
    m = moment_bytes(h, L, a, f, V, s, b, glu=True, psi_layer=P, psi_mlp_out=Pout, tied=False)
    inputs, soft = L * s * b * h, a * s * s * b
    assert m == {"mlp": 4 * (inputs + 2 * soft + P - Pout + 8 * s * b * f + 13 * s * b * h),
                 "attention": 4 * (inputs + 3 * soft + P - Pout + s * b * f + 10 * s * b * h),
                 "forward": 4 * (inputs + 2 * soft + P + h * V + 4 * s * b * h),
                 "head": 4 * (inputs + 3 * s * b * V + h * V + 4 * s * b * h)}
    g = moment_bytes(h, L, a, f, V, s, b, glu=False, psi_layer=P, psi_mlp_out=Pout, tied=True)
    # a tied embedding's gradient held; GELU: the whole unit, 2 [s, f] and 12 [s, h] (SwiGLU: 8 and 13)
    assert g["mlp"] - m["mlp"] == 4 * (h * V + Pout - 6 * s * b * f - s * b * h)
    t = moment_bytes(h, L, a, f, V, s, b, glu=True, psi_layer=P, psi_mlp_out=Pout, tied=False, tensor=2)
    assert t["mlp"] == 4 * (inputs + 2 * soft / 2 + P - Pout + 8 * s * b * f / 2 + (9 + 4 / 2) * s * b * h)
    assert g["attention"] - m["attention"] == 4 * h * V and g["forward"] == m["forward"] and g["head"] == m["head"]
    form = {"state": 10.0, "grad_shard": 1.0}
    assert expected_peak(form, {"mlp": 20.0, "attention": 22.0, "forward": 21.0, "head": 5.0}) == (33.0, "attention")
    assert memory_formula(psi=800, shards=8) == {"state": 1200.0, "grad_shard": 400.0, "total": 1600.0}
    # HYBRID_SHARD_OPT: parameters over 8, Adam moments over 64
    g = memory_formula(psi=800, shards=8, opt_shards=64)
    assert g["state"] == 4 * 800 / 8 + 2 * 4 * 800 / 64 and g["grad_shard"] == 4 * 800 / 64  # reduce-scattered over R*S in backward
    assert train_flops_per_token(100, 2, 8, 16) == 600 + 12 * 2 * 8 * 16
    assert median_ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0


def test_bad_input(capsys):
    """Refused by bench_main in this process (exit 2, the flag named): no subprocess to import jax for it."""
    for argv, needle in ((["--configs", "S,X"], "unknown configuration 'X'"), (["--repeats", "0"], "--repeats 0")):
        with pytest.raises(SystemExit) as e:
            bench_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and "python -m train.bench: error: " in err, err[-1000:]
