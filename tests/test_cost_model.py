"""The planner's cost model (train/planning): each term against arithmetic written out here, the
bottleneck's name, the profiles, the formula traffic, and one tiny compiled report through it."""

from __future__ import annotations

import math

import pytest

from train.planning import (Workload, axis_link, collective_seconds, formula_traffic, load_profile, predict, profile_names,
                            step_flops, traffic_of_report)
from train.planning.profiles import FIELDS, profile_dir

TOY = """name = "toy"
description = "round numbers"
peak_flops = 100e12
hbm_bytes = 80e9
hbm_bandwidth = 1e12
intra_node_bandwidth = 100e9
inter_node_bandwidth = {inter}
devices_per_node = 4
matmul_fraction = 0.5
intra_node_fraction = 0.5
inter_node_fraction = 1.0
async_collectives = {overlap}

[sources]
""" + "".join(f'{k} = "arithmetic"\n' for k in FIELDS)


@pytest.fixture
def toy(tmp_path):
    def make(inter="10e9", overlap="true"):
        path = tmp_path / f"toy-{inter}-{overlap}.toml"
        path.write_text(TOY.format(inter=inter, overlap=overlap))
        return load_profile(path)
    return make


# N = 1e9 multiplying parameters, 10 layers of width 1024, 80 sequences of 1000 tokens, block remat, on 2 x 4 devices
W = Workload(params=10**9, layers=10, d_model=1024, attn_width=1024, seq_len=1000, global_batch=80, remat="block")
MESH = {"replica": 2, "shard": 4}
TRAFFIC = [{"kind": "all-gather", "axis": "shard", "count": 20, "bytes": 2e9},
           {"kind": "reduce-scatter", "axis": "shard", "count": 10, "bytes": 2e9},
           {"kind": "all-reduce", "axis": "replica", "count": 10, "bytes": 1e9}]


def test_step_flops_by_hand():
    f = step_flops(W, devices=8)
    # 80 x 1000 tokens over 8 devices: 10,000 tokens each. Attention forward (model) 4 L d T = 4 * 10 * 1024 * 1000
    # = 40,960,000 per token; causal: 20,480,000 executed. Block remat recomputes 2N + 20,480,000.
    # MFU's model FLOPs: 6N + 12 L H Q T with the causal half, 6N + 6 L H Q T = 6.06144e13 (the attention executed)
    assert f["model"] == pytest.approx((6e9 + 3 * 20_480_000) * 10_000)
    assert f["forward"] == pytest.approx((2e9 + 20_480_000) * 10_000)  # 2.02048e13
    assert f["recompute"] == pytest.approx((2e9 + 20_480_000) * 10_000)
    assert f["backward"] == pytest.approx((4e9 + 40_960_000 + 2e9 + 20_480_000) * 10_000)  # 6.06144e13
    assert f["executed"] == pytest.approx(f["forward"] + f["backward"])
    none = step_flops(Workload(**{**W.__dict__, "remat": "none"}), devices=8)
    dots = step_flops(Workload(**{**W.__dict__, "remat": "dots"}), devices=8)
    assert none["recompute"] == 0 and dots["recompute"] == pytest.approx(20_480_000 * 10_000)
    assert none["model"] == f["model"] == dots["model"]  # MFU never counts the recomputation
    assert none["model"] == pytest.approx(none["executed"])  # nothing recomputed: the model FLOPs are the executed ones
    full = step_flops(Workload(**{**W.__dict__, "causal": False}), devices=8)  # no mask: the attention counted whole
    assert full["model"] == pytest.approx((6e9 + 3 * 40_960_000) * 10_000)  # 6.12288e13


MFU_CASES = [  # (workload, mesh, strategy): dense and MoE, causal or not, each remat, attention-heavy, communicating
    (dict(params=10**9, layers=10, d_model=1024, attn_width=1024, seq_len=32768, global_batch=8, remat="none"), {"shard": 1}, "FULL_SHARD"),
    (dict(params=10**9, layers=10, d_model=1024, attn_width=1024, seq_len=32768, global_batch=8, remat="none", causal=False),
     {"shard": 1}, "FULL_SHARD"),
    (W.__dict__, MESH, "HYBRID_SHARD"),
    (dict(params=7 * 10**9, layers=32, d_model=4096, attn_width=4096, kv_width=1024, seq_len=8192, global_batch=64, remat="dots"),
     {"replica": 1, "shard": 8, "tensor": 2}, "FULL_SHARD"),
    (dict(params=3 * 10**9, state_params=30 * 10**9, expert_params=27 * 10**9, n_experts=128, top_k=8, layers=48, d_model=2048,
          attn_width=4096, kv_width=512, seq_len=4096, global_batch=16, remat="block"), {"replica": 1, "shard": 4, "expert": 2},
     "FULL_SHARD"),
]


@pytest.mark.parametrize("name", profile_names())
def test_mfu_never_exceeds_the_matmul_fraction(name):
    # MFU's model FLOPs are at most the executed ones (the causal half, no recomputation), so MFU <= matmul_fraction
    # on every profile; with nothing recomputed, communicated or stored, it is the matmul fraction itself
    p = load_profile(name)
    for shape, mesh, strategy in MFU_CASES:
        w = Workload(**shape)
        pr = predict(w, formula_traffic(w, mesh, strategy), p, mesh, strategy=strategy)
        assert 0 < pr.mfu <= p.matmul_fraction * (1 + 1e-12), (name, shape, pr.mfu)
        bare = predict(w, [], p, {"shard": 1}, state_bytes=0.0)
        assert bare.mfu <= p.matmul_fraction * (1 + 1e-12)
        if w.remat in ("none", "offload"):
            assert bare.mfu == pytest.approx(p.matmul_fraction)


def test_links_inside_and_across_nodes(toy):
    p = toy()
    # 4 devices per node: shard (devices 0..3) stays in node 0 at 100e9 * 0.5; replica (devices 0, 4) crosses,
    # one member per node: min(50e9, 1 * 10e9 * 1.0)
    shard, replica = axis_link("shard", MESH, p), axis_link("replica", MESH, p)
    assert (shard["crosses_nodes"], shard["bandwidth"]) == (False, 50e9)
    assert (replica["crosses_nodes"], replica["members_per_node"], replica["bandwidth"]) == (True, 1, 10e9)
    # shard = 8 over 2 nodes of 4: 4 members per node share 4 network links: min(50e9, 4 * 10e9) = 40e9
    wide = axis_link("shard", {"replica": 1, "shard": 8}, p)
    assert (wide["nodes"], wide["members_per_node"], wide["bandwidth"]) == (2, 4, 40e9)
    assert axis_link("world", MESH, p)["axes"] == ["replica", "shard"]
    assert collective_seconds("all-reduce", "replica", 1e9, MESH, p) == pytest.approx(0.1)
    # all-to-all over 8 devices on 2 nodes: 4 of the 7 peers remote, 4/7 of the bytes over the 10e9 link
    assert collective_seconds("all-to-all", "shard", 7e9, {"shard": 8}, p) == pytest.approx(max(3e9 / 50e9, 4e9 / 10e9))
    with pytest.raises(ValueError, match="'tensor'"):
        axis_link("tensor", MESH, p)


def test_predict_each_term_by_hand(toy):
    pr = predict(W, TRAFFIC, toy(), MESH, strategy="HYBRID_SHARD")
    F, B = 2.02048e13 / 5e13, 6.06144e13 / 5e13  # executed FLOPs over 100e12 * 0.5: 0.404096 s, 1.212288 s
    assert (pr.forward_s, pr.backward_s) == (pytest.approx(F), pytest.approx(B))
    # seconds: all-gather shard 2e9 / 50e9 = 0.04 (half forward, half backward: HYBRID_SHARD re-gathers),
    # reduce-scatter shard 0.04, all-reduce replica 1e9 / 10e9 = 0.1 (across nodes).
    assert pr.comm_s == {"shard": pytest.approx(0.08), "replica": pytest.approx(0.1)}
    # 10 units a pass. Forward, NVLink: 0.02 / 10 + 9 * max(0, 0.002 - F / 10) = 0.002.
    # Backward: NVLink 0.06 -> 0.006; network 0.1 -> 0.01 + 9 * max(0, 0.01 - B / 10) = 0.01, the larger: 0.01.
    assert pr.exposed_s == {"shard": pytest.approx(0.002), "replica": pytest.approx(0.01)}
    # optimizer: 12 Psi / S = 3e9 bytes of state per device; reads and writes 2 x 3e9 + gradients 1e9 at 1e12 B/s
    assert pr.memory_s == pytest.approx(0.007)
    step = F + B + 0.002 + 0.01 + 0.007  # 1.635384 s
    assert pr.step_s == pytest.approx(step)
    assert pr.tokens_per_s_per_device == pytest.approx(10_000 / step)
    assert pr.mfu == pytest.approx(6.06144e13 / (step * 100e12))  # 0.3706
    assert pr.bottleneck == "compute"
    # collectives that never overlap compute (XLA:CPU): all exposed, 0.08 + 0.1 s
    sync = predict(W, TRAFFIC, toy(overlap="false"), MESH, strategy="HYBRID_SHARD")
    assert sync.step_s == pytest.approx(F + B + 0.08 + 0.1 + 0.007) and sync.exposed_s == sync.comm_s


def test_accumulation_leaves_the_replica_all_reduce_after_the_loop(toy):
    # 4 micro-batches: HYBRID_SHARD all-reduces the accumulated shard over replica once, after the backward
    # (zshard.ReplicaReduce.PER_STEP): its 0.1 s exposed whole; the shard traffic still pipelines over 40 units
    w = Workload(**{**W.__dict__, "accumulation": 4})
    pr = predict(w, TRAFFIC, toy(), MESH, strategy="HYBRID_SHARD")
    assert pr.exposed_s["replica"] == pytest.approx(0.1)
    assert pr.exposed_s["shard"] == pytest.approx(0.02 / 40 + 0.06 / 40)  # forward and backward pipelines, one unit each
    assert pr.step_s == pytest.approx(pr.compute_s + 0.1 + 0.002 + pr.memory_s)


def test_bottleneck_names_the_axis_or_memory(toy):
    slow = predict(W, TRAFFIC, toy(inter="1e6"), MESH, strategy="HYBRID_SHARD")  # 1e9 bytes at 1 MB/s: 1000 s
    assert slow.bottleneck == "replica" and slow.exposed_s["replica"] > 900
    assert predict(W, TRAFFIC, toy(), MESH, strategy="HYBRID_SHARD", state_bytes=1e13).bottleneck == "memory"
    mesh = {"replica": 1, "shard": 2, "tensor": 4}
    tp = [{"kind": "all-reduce", "axis": "tensor", "count": 50, "bytes": 1e11}]  # 2 s on NVLink, never hidden
    pr = predict(W, tp, toy(), mesh, strategy="FULL_SHARD")
    assert pr.exposed_s["tensor"] == pytest.approx(2.0) and pr.bottleneck == "tensor"
    assert pr.step_s == pytest.approx(pr.compute_s + 2.0 + pr.memory_s)


def test_formula_traffic_by_hand():
    w = Workload(params=10**9, layers=10, d_model=1024, attn_width=1024, seq_len=1000, global_batch=8, remat="block")
    full = {t["kind"]: (t["axis"], t["bytes"]) for t in formula_traffic(w, {"replica": 1, "shard": 8})}
    # bf16 gathers forward and backward 2 * 1e9 * 2 * 7/8; fp32 reduce-scatter 1e9 * 4 * 7/8
    assert full == {"all-gather": ("shard", pytest.approx(3.5e9)), "reduce-scatter": ("shard", pytest.approx(3.5e9))}
    assert {t["axis"] for t in formula_traffic(w, MESH)} == {"world"}
    hyb = {(t["kind"], t["axis"]): t["bytes"] for t in formula_traffic(w, MESH, "HYBRID_SHARD")}
    assert hyb == {("all-gather", "shard"): pytest.approx(3e9), ("reduce-scatter", "shard"): pytest.approx(3e9),
                   ("all-reduce", "replica"): pytest.approx(2 * 1e9 / 4 * 4 * 0.5)}
    tp = {(t["kind"], t["axis"]): t["bytes"] for t in formula_traffic(w, {"replica": 1, "shard": 4, "tensor": 2})}
    # 8 sequences over 4 data devices: X = 2 * 1000 * 1024 * 2 bytes; 5 all-reduces per block (block remat) x 10 blocks
    assert tp[("all-reduce", "tensor")] == pytest.approx(50 * 2 * 4_096_000 * 0.5)
    assert tp[("all-gather", "shard")] == pytest.approx(2 * 0.5e9 * 2 * 0.75)  # each device gathers its half
    with pytest.raises(ValueError, match="FULL_SHARD"):
        formula_traffic(w, MESH, "ZERO9")


def test_profiles_load_with_sources():
    assert set(profile_names()) >= {"a100", "cpu", "h100", "h200"}
    h100, h200, a100 = (load_profile(n) for n in ("h100", "h200", "a100"))
    assert (h100.peak_flops, h100.hbm_bandwidth, h100.intra_node_bandwidth, h100.hbm_bytes) == (989e12, 3.35e12, 450e9, 80e9)
    assert (h200.peak_flops, h200.hbm_bandwidth, h200.hbm_bytes) == (989e12, 4.8e12, 141e9)
    assert (a100.peak_flops, a100.hbm_bandwidth, a100.intra_node_bandwidth) == (312e12, 2.039e12, 300e9)
    for p in (h100, h200, a100, load_profile("cpu")):
        assert set(p.sources) >= set(FIELDS) and all(p.sources[k].strip() for k in FIELDS)
        assert 0 < p.matmul_fraction <= 1 and p.devices_per_node >= 1
    assert h100.async_collectives and not load_profile("cpu").async_collectives  # XLA:CPU runs collectives alone


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError) as e:
        load_profile("h900")
    assert "'h900'" in str(e.value) and all(n in str(e.value) for n in ("a100", "cpu", "h100", "h200"))
    bad = tmp_path / "bad.toml"
    bad.write_text(TOY.format(inter="10e9", overlap="true").replace("matmul_fraction = 0.5", "matmul_fraction = 1.5"))
    with pytest.raises(ValueError, match="matmul_fraction = 1.5"):
        load_profile(bad)
    bad.write_text(TOY.format(inter="10e9", overlap="true").replace('peak_flops = "arithmetic"\n', ""))
    with pytest.raises(ValueError, match="no \\[sources\\] entry for peak_flops"):
        load_profile(bad)
    bad.write_text(TOY.format(inter="10e9", overlap="true").replace("hbm_bandwidth = 1e12\n", ""))
    with pytest.raises(ValueError, match="missing hbm_bandwidth"):
        load_profile(bad)
    bad.write_text(TOY.format(inter="10e9", overlap='"yes"'))
    with pytest.raises(ValueError, match="async_collectives = 'yes': true or false"):
        load_profile(bad)
    with pytest.raises(ValueError, match="no such file"):
        load_profile(tmp_path / "absent.toml")
    assert (profile_dir() / "h100.toml").is_file()


def test_workload_errors():
    with pytest.raises(ValueError, match="remat='full'.*none, block, dots, offload"):
        Workload(params=1, layers=1, d_model=1, attn_width=1, seq_len=1, global_batch=1, remat="full")
    with pytest.raises(ValueError, match="global_batch=6 does not divide into accumulation=4"):
        Workload(params=1, layers=1, d_model=1, attn_width=1, seq_len=1, global_batch=6, accumulation=4)


def test_a_compiled_report_through_the_model():
    """One tiny compile: the report's collectives feed the model, and the formula's bytes are the
    report's plus the root unit's second gather (gathered once and kept: the formula counts two)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import zshard
    from train.model import GPTConfig, build_model, cross_entropy_loss

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, scan=True)
    mesh = zshard.make_mesh(1, 8)
    state = zshard.init(lambda: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-3), mesh, strategy="FULL_SHARD", abstract=True)
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    rep = zshard.report(zshard.make_train_step(cross_entropy_loss), state, (tokens, tokens))
    traffic = traffic_of_report(rep)
    assert {(t["kind"], t["axis"]) for t in traffic} >= {("all-gather", "shard"), ("reduce-scatter", "shard")}
    w = Workload.of_config(cfg, global_batch=8)
    assert w.state_params == rep.num_params and w.params == rep.num_params - 64 * 32 - 16 * 32  # less the token and position tables
    formula = {t["kind"]: t["bytes"] for t in formula_traffic(w, dict(rep.mesh), gather_bytes=4)}
    measured = {t["kind"]: t["bytes"] for t in traffic}
    root = next(u["params"] for u in rep.units if u["layers"] == 1 and not u["name"].startswith("blocks"))
    assert measured["reduce-scatter"] == pytest.approx(formula["reduce-scatter"], rel=0.02)
    assert measured["all-gather"] == pytest.approx(formula["all-gather"] - root * 4 * 7 / 8, rel=0.02)
    pr = predict(w, traffic, load_profile("cpu"), dict(rep.mesh), state_bytes=rep.model_state_bytes["measured"]["total"])
    assert pr.step_s > pr.compute_s > 0 and math.isfinite(pr.mfu) and pr.bottleneck in ("compute", "memory", "shard")


# Published FSDP runs, each with its model shape, parameters N (multiplying) and Psi (all), sequence, GPUs,
# micro-batch x accumulation, checkpointing, mixed precision and the published MFU and tokens/s per GPU:
# - MosaicML llm-foundry, scripts/train/benchmarking/README.md (tables "H100 80GB BF16" and "A100 80GB with 1600
#   Gbps node-node interconnect"), shapes from scripts/train/yamls/pretrain/mpt-*.yaml (tied embeddings: N = Psi =
#   NumParams); DEFAULT mixed precision gathers bf16 and reduces fp32, PURE both bf16.
# - torchtitan, docs/performance.md (64 A100 80GB, FSDP2, bf16 parameters, fp32 reduction): Llama 2 70B at
#   4096 tokens, local batch 2, full checkpointing; Llama 3 8B at 8192 tokens, local batch 1, selective op
#   checkpointing (taken as "dots"). Their N: 80 x (2 x 8192^2 + 2 x 8192 x 1024 + 3 x 8192 x 28672 + 2 x 8192)
#   + 8192 + 32000 x 8192 = 68,714,504,192 (Psi adds the 32000 x 8192 table); 32 x (2 x 4096^2 + 2 x 4096 x 1024
#   + 3 x 4096 x 14336 + 2 x 4096) + 4096 + 128256 x 4096 = 7,504,924,672 (Psi adds the 128256 x 4096 table).
def _mpt(n, layers, d, batch, k, remat):
    return dict(params=n, layers=layers, d_model=d, attn_width=d, seq_len=2048, global_batch=batch, accumulation=k, remat=remat)


PUBLISHED = [  # (name, by, profile, workload, GPUs, (gather, reduce bytes), MFU %, tokens/s per GPU)
    ("MPT-7B, 8 x H100, micro-batch 6, no checkpointing", "MosaicML", "h100", _mpt(6658859008, 32, 4096, 48, 1, "none"), 8,
     (2, 4), 46.44, 10643),
    ("MPT-70B, 64 x H100, micro-batch 8 x 4, checkpointing", "MosaicML", "h100", _mpt(64862437376, 80, 8192, 2048, 4, "block"),
     64, (2, 4), 42.57, 1039),
    ("MPT-30B, 8 x A100, micro-batch 3 x 21, checkpointing", "MosaicML", "a100", _mpt(29975214080, 48, 7168, 504, 21, "block"),
     8, (2, 4), 55.3, 916),
    ("MPT-70B, 64 x A100, micro-batch 8 x 4, checkpointing, PURE", "MosaicML", "a100",
     _mpt(64862437376, 80, 8192, 2048, 4, "block"), 64, (2, 2), 53.33, 410),
    ("Llama 2 70B, 64 x A100, 2 x 4096 tokens, full checkpointing", "torchtitan", "a100",
     dict(params=68714504192, state_params=68976648192, layers=80, d_model=8192, attn_width=8192, kv_width=1024, seq_len=4096,
          global_batch=128, remat="block"), 64, (2, 4), 50.5, 353),
    ("Llama 3 8B, 64 x A100, 1 x 8192 tokens, selective op checkpointing", "torchtitan", "a100",
     dict(params=7504924672, state_params=8030261248, layers=32, d_model=4096, attn_width=4096, kv_width=1024, seq_len=8192,
          global_batch=64, remat="dots"), 64, (2, 4), 58.2, 2973),
]


def published_mfu_here(shape: dict, mfu: float) -> float:
    """A published MFU (%) in this model's FLOP count: both sources count PaLM's ``6 N' + 12 L H Q T`` per token
    (attention whole; ``N'`` every parameter: MosaicML's tied models have no other, torchtitan's count includes the
    embedding table, ``state_params``), ``train.planning`` counts ``6 N + 6 L H Q T`` (causal half, ``N`` multiplying)."""
    w = Workload(**shape)
    theirs = 6 * w.psi + 12 * w.layers * w.attn_width * w.seq_len
    return mfu * (step_flops(w)["model"] / w.tokens) / theirs


def published_rows() -> list[str]:
    """The rows of docs/planning.md's comparison table, predicted from the formulas' traffic."""
    rows = []
    for name, by, prof, shape, gpus, (g, r), mfu, tps in PUBLISHED:
        w = Workload(**shape)
        mesh = {"replica": 1, "shard": gpus}
        pr = predict(w, formula_traffic(w, mesh, gather_bytes=g, reduce_bytes=r), load_profile(prof), mesh)
        tokens = pr.tokens_per_s_per_device
        rows.append(f"| {name} | {by} | {tps:,} | {tokens:,.0f} | {(tokens - tps) / tps:+.0%} | {mfu:.2f}% | "
                    f"{published_mfu_here(shape, mfu):.1f}% | {pr.mfu:.1%} | {pr.bottleneck} |")
    return rows


def test_published_mfu_converts_as_the_throughput_says():
    # the published MFU in this count is the published tokens/s x this model's FLOPs per token over the peak (each source's
    # peak is the profile's: 989 / 312 TFLOP/s), up to the rounding of the published numbers
    for name, by, prof, shape, gpus, _, mfu, tps in PUBLISHED:
        w = Workload(**shape)
        assert published_mfu_here(shape, mfu) / 100 == pytest.approx(
            tps * step_flops(w)["model"] / w.tokens / load_profile(prof).peak_flops, rel=2e-3), name


def test_published_runs_in_the_docs():
    from conftest import ROOT

    page = (ROOT / "docs" / "planning.md").read_text()
    missing = [row for row in published_rows() if row not in page]
    assert not missing, "docs/planning.md's comparison table is stale; its rows now read:\n" + "\n".join(published_rows())


def test_plan_refuses_an_unknown_profile_before_compiling(capsys):
    from train import plan

    for flags, want in ((["--profile", "h900"], "--profile: hardware profile 'h900': unknown; choose one of a100, cpu, h100, h200"),
                        (["--devices-per-node", "0"], "--devices-per-node 0: must be positive")):
        with pytest.raises(SystemExit):
            plan.main(["--model", "gpt2-124m", "--mesh", "1x8", *flags])
        assert want in capsys.readouterr().err


def test_a_mixture_of_experts_counts_the_active_experts():
    from train.model import MoEConfig

    cfg = MoEConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, n_experts=4, top_k=1,
                    d_expert=16, scan=True)
    w = Workload.of_config(cfg, global_batch=8)
    # per layer 4 experts of 3 x 32 x 16 = 1536 parameters; a token multiplies 1 of them: 3 idle x 1536 x 2 layers
    idle = 3 * 1536 * 2
    assert w.state_params - w.params == idle + 64 * 32  # and the untied embedding table, a lookup


def test_calibrate_writes_a_profile_that_loads(tmp_path, capsys):
    from train.planning import calibrate

    out = tmp_path / "cpu.toml"
    assert calibrate.main(["--rounds", "1", "--size", "64", "--collective-mib", "0.25", "--copy-mib", "0.25", "--out", str(out)]) == 0
    p = load_profile(out)
    assert p.name == "cpu" and p.devices_per_node == 8 and not p.async_collectives and p.matmul_fraction == 1.0
    assert p.peak_flops > 0 and p.intra_node_bandwidth == p.inter_node_bandwidth > 0 and p.hbm_bandwidth > 0
    assert p.sources["peak_flops"].startswith("measured ") and "calibrate --rounds 1 --size 64 --collective-mib 0.25 --copy-mib 0.25 (" in p.sources["peak_flops"]
    assert f"wrote {out}" in capsys.readouterr().out
