"""Quantized collectives (ZeRO++ qwZ / qgZ, zshard/wire/quant.py): the formats, bit identity of
quantize-then-gather and gather-then-quantize, the error of each collective, the bytes in the
HLO the step emits and compiles, every strategy, scan, prefetch, remat, accumulation, tensor
pieces, the report, checkpoints, and bad input before compiling."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ResMLP, built, gpt_batches, mlp_batches, mse_loss, reference_run, rel_l2, state_copy
from flax import nnx
from optim_cases import Net
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from train.model import GPT, GPTConfig
from zshard.wire import quant
from zshard.params.flat import ParamLayout
from zshard.wire.quant import Quant
from zshard.inspection.hlo import _computations, parse_collectives

B = 32  # block of the step tests: every matrix of the tiny GPT has at least 32 elements per device
INT8 = Quant("int8", block=B)
ALL = zshard.MixedPrecision(gather_format=INT8, reduce_format=INT8)  # shard axes only
HYB = zshard.MixedPrecision(gather_format=INT8, reduce_format=INT8, replica_format=INT8)


def gpt():
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2), rngs=nnx.Rngs(0))


DATA = gpt_batches(4, batch=16)
Q16 = Quant("int8", 16)  # ResMLP(13 -> 19 -> 3): its 13x19 and 19x19 kernels have 31 and 46 elements per device
MLP_ALL = zshard.MixedPrecision(gather_format=Q16, reduce_format=Q16)
MLP_HYB = zshard.MixedPrecision(gather_format=Q16, reduce_format=Q16, replica_format=Q16)
MLP_DATA = mlp_batches(5, batch=16)


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


def mlp32():
    return ResMLP(13, 32, 3, n_blocks=2, rngs=nnx.Rngs(0))


def mlp64():
    return ResMLP(13, 64, 3, n_blocks=2, rngs=nnx.Rngs(0))  # 13x64: 832 elements, padded to 1024


@functools.cache
def mlp_reference(tx_name="adam"):
    tx = optax.adam(1e-2) if tx_name == "adam" else optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    return reference_run(mlp, tx, mse_loss, MLP_DATA)


@functools.cache
def _mlp_step(options: tuple = ()):
    """``make_train_step(mse_loss, **dict(options))``, one object per set of options: a program the
    strategy cases and the checkpoint test both run is traced and compiled once."""
    return zshard.make_train_step(mse_loss, **dict(options))


ADAM = optax.adam(1e-2)  # one object: a plan holds its tx, and a state of another plan traces the step again


@functools.cache
def _placed_once(strategy: str, shape: tuple, mp):
    return zshard.init(built(mlp), ADAM, zshard.make_mesh(*shape), strategy=strategy, mixed_precision=mp)


def _placed(strategy: str, shape: tuple, mp):
    """A fresh copy (a step donates its input) of ``mlp`` placed once per strategy, mesh and precision with
    ``ADAM``: the copies share its plan, so a test training one with another's ``_mlp_step`` runs that test's
    traced and compiled program (a plan is hashed by identity: each ``zshard.init`` traces the step anew)."""
    return state_copy(_placed_once(strategy, shape, mp))


def _train(state, step, data=DATA):
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


# --- formats and bad input, before anything compiles -------------------------------------------------


def test_formats_and_bad_input_are_refused_by_name():
    assert Quant("int8").block == 256 and Quant("float8_e4m3fn", block=None).label == "float8_e4m3fn/tensorwise"
    assert zshard.MixedPrecision(gather_format="int8").gather_format == Quant("int8", 256)
    with pytest.raises(ValueError, match="unknown format; choose one of 'int8', 'int4', 'float8_e4m3fn', 'float8_e5m2'"):
        Quant("int3")
    with pytest.raises(ValueError, match="gather_format='fp8'.*unknown format"):
        zshard.MixedPrecision(gather_format="fp8")
    with pytest.raises(TypeError, match="reduce_format=8"):
        zshard.MixedPrecision(reduce_format=8)
    for block in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="block must be a positive integer"):
            Quant("int8", block=block)
    with pytest.raises(ValueError, match="int4 packs two values per byte, so the block must be even"):
        Quant("int4", block=33)
    # error feedback is built for reduce_format only (tests/test_feedback.py): refused elsewhere, never ignored
    with pytest.raises(ValueError, match="replica_format=Quant.'int4', error_feedback=True.*shard-axis gradient all-to-all only"):
        zshard.MixedPrecision(replica_format=Quant("int4", error_feedback=True))
    with pytest.raises(ValueError, match="error feedback corrects gradient quantization"):
        zshard.MixedPrecision(gather_format=Quant("int8", error_feedback=True))
    # an integer reduction without dequantization: the sum would wrap
    for dtype in ("int8", "int4", "int32"):
        with pytest.raises(ValueError, match="summed in integers wrap.*reduce_format=zshard.Quant"):
            zshard.MixedPrecision(reduce_dtype=dtype)
    # a block that does not divide the buffer: the padding it needs is named
    with pytest.raises(ValueError, match="1000 elements does not split into blocks of 256 .int8/256.; pad it to 1024"):
        quant.quantize(jnp.zeros(1000), Quant("int8"))


def test_formats_that_apply_to_nothing_are_refused_before_compiling():
    mesh = zshard.make_mesh(2, 4)
    init = functools.partial(zshard.init, gpt, optax.sgd(0.1), mesh, abstract=True)
    with pytest.raises(ValueError, match="gather_format=int8/32.*NO_SHARD keeps every parameter whole.*replica_format"):
        init(strategy="NO_SHARD", mixed_precision=zshard.MixedPrecision(gather_format=INT8))
    with pytest.raises(ValueError, match="reduce_format=int8/32.*SHARD_OPT keeps every parameter whole"):
        init(strategy="SHARD_OPT", mixed_precision=zshard.MixedPrecision(reduce_format=INT8))
    with pytest.raises(ValueError, match="replica_format=int8/32.*FULL_SHARD splits the parameters over every mesh axis"):
        init(strategy="FULL_SHARD", mixed_precision=zshard.MixedPrecision(replica_format=INT8))
    with pytest.raises(ValueError, match=r"gather_format=int8/4096\) quantizes no parameter: the largest, head.kernel "
                                         r"\[32, 256\], has 2048 elements on each of 4 devices"):
        init(strategy="HYBRID_SHARD", mixed_precision=zshard.MixedPrecision(gather_format=Quant("int8", 4096)))


def test_padding_keeps_blocks_inside_shards_and_changes_nothing_without_formats():
    mesh = zshard.make_mesh(2, 4)
    plain = zshard.init(gpt, optax.sgd(0.1), mesh, strategy="HYBRID_SHARD_OPT", abstract=True).plan
    q = zshard.init(gpt, optax.sgd(0.1), mesh, strategy="HYBRID_SHARD_OPT", abstract=True, mixed_precision=HYB).plan
    cov = quant.coverage(q)
    assert cov["gather"]["quantized"] and cov["gather"]["fallback"]  # matrices quantized, norms and biases not
    assert all(p.endswith(("bias", "scale")) for p in cov["gather"]["fallback"])
    for path, rec in q.layouts.items():
        name = zshard.path_str(path)
        if name in cov["replica"]["quantized"]:  # the replica all-to-all splits each [n_pad/4] over 2 replicas
            assert rec.padded % (8 * B) == 0, name
        elif name in cov["gather"]["quantized"]:
            assert rec.padded % (4 * B) == 0, name
        else:  # norms and biases: padded as without formats
            assert rec.padded == plain.layouts[path].padded, name


# --- bit identity and error, one collective at a time -------------------------------------------------


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
def test_quantize_then_gather_is_gather_then_quantize_bitwise(n_dev):
    mesh = jax.make_mesh((n_dev,), ("shard",), devices=jax.devices()[:n_dev], axis_types=(jax.sharding.AxisType.Explicit,))
    fmts = [Quant("int8", 16), Quant("int4", 16), Quant("float8_e4m3fn", 16), Quant("float8_e5m2", None), Quant("int8", None)]
    rng = np.random.default_rng(n_dev)
    shapes = [(7, 37), (13, 19), (1, 1001)]  # odd sizes: 259, 247, 1001 elements, zero-padded
    values = []
    for shape in shapes:
        rec = ParamLayout.build(("w",), shape, np.float32, n_dev * 16)
        values.append(rec.to_storage((rng.standard_normal(shape) * 3).astype(np.float32)))

    def body(*shards):
        out = []
        for x in shards:
            full = jax.lax.all_gather(x, "shard", axis=0, tiled=True)  # [n_pad/N] --all_gather--> [n_pad]
            for f in fmts:
                payload, scales = quant.quantize(x, f, ("shard",))
                payload = jax.lax.all_gather(payload, "shard", axis=0, tiled=True)  # quantize, then gather
                p2, s2 = quant.quantize(full, f)  # gather, then quantize
                got = quant.all_gather(x, ("shard",), f, jnp.float32)
                want = quant.dequantize(p2, s2, f, jnp.float32)
                same = jnp.all(payload == p2) & jnp.all(jax.lax.bitcast_convert_type(got, jnp.int32) ==
                                                         jax.lax.bitcast_convert_type(want, jnp.int32))
                if f.block:
                    same &= jnp.all(jax.lax.all_gather(scales, "shard", axis=0, tiled=True) == s2)
                out.append(same[None])
        return out

    n_out = len(shapes) * len(fmts)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("shard"),) * len(shapes), out_specs=[P("shard")] * n_out))
    outs = fn(*[jax.device_put(v, NamedSharding(mesh, P("shard"))) for v in values])
    assert all(bool(np.all(o)) for o in outs), [bool(np.all(o)) for o in outs]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.cache
def _collective_errors() -> dict:
    """Relative L2 error of each quantized collective on N(0, 1) data, 8 devices, 2^17 elements
    (numbers in docs/quantized.md)."""
    mesh = jax.make_mesh((8,), ("shard",), axis_types=(jax.sharding.AxisType.Explicit,))
    fmts = [Quant("int8", 256), Quant("int8", None), Quant("int4", 256), Quant("float8_e4m3fn", 256),
            Quant("float8_e4m3fn", None), Quant("float8_e5m2", 256)]
    n = 8 * 256 * 64
    g = np.random.default_rng(0).standard_normal((8, n)).astype(np.float32)  # one gradient per device

    def body(x):
        x = x[0]
        out = [jax.lax.all_gather(x[: n // 8].astype(jnp.bfloat16), "shard", axis=0, tiled=True).astype(jnp.float32)]
        for f in fmts:
            out += [quant.all_gather(x[: n // 8], ("shard",), f, jnp.float32), quant.reduce_scatter(x, ("shard",), f),
                    quant.all_reduce(x, ("shard",), f)]
        return [o[None] for o in out]

    outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("shard"), out_specs=[P("shard")] * (1 + 3 * len(fmts))))(
        jax.device_put(g, NamedSharding(mesh, P("shard")))
    )
    outs = [np.asarray(o) for o in outs]
    shards, total = g[:, : n // 8].reshape(-1), g.sum(0)
    errors = {("bfloat16", "gather"): _rel(outs[0][0], shards)}
    for i, f in enumerate(fmts):
        gathered, scattered, reduced = outs[1 + 3 * i : 4 + 3 * i]
        errors[f.label, "gather"] = _rel(gathered[0], shards)
        errors[f.label, "reduce_scatter"] = _rel(np.asarray(scattered).reshape(-1), total)
        errors[f.label, "all_reduce"] = _rel(reduced[0], total)
    return errors


@pytest.mark.parametrize("label,bound", [
    ("int8/256", 0.01), ("int8/tensorwise", 0.0125), ("float8_e4m3fn/256", 0.03), ("float8_e4m3fn/tensorwise", 0.035),
    ("float8_e5m2/256", 0.06), ("int4/256", 0.14),
])
def test_error_of_each_collective_is_bounded(label, bound):
    # Measured (8 devices, N(0,1)): int8/256 0.70% (all-reduce, two roundings: 0.99%); e4m3 blocks 2.61%,
    # tensorwise 2.64% (3 mantissa bits: its relative rounding error does not depend on the scale); e5m2
    # 5.2%; int4/256 12.7%; bf16 gather 0.17%. The all-reduce quantizes twice: up to sqrt(2) times more.
    err = _collective_errors()
    assert err["bfloat16", "gather"] <= 0.002
    assert err[label, "gather"] <= bound and err[label, "reduce_scatter"] <= bound, err
    assert err[label, "all_reduce"] <= 1.5 * bound, err
    if label.startswith("float8_e4m3fn/"):
        assert err["float8_e4m3fn/256", "gather"] <= err["float8_e4m3fn/tensorwise", "gather"]


def test_gradient_all_to_all_sums_dequantized_blocks_in_fp32():
    # what each device receives is the fp32 sum of every device's dequantized chunk: an integer
    # psum_scatter of the same payload wraps (int4 values sum past 7)
    mesh = jax.make_mesh((8,), ("shard",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = Quant("int4", 16)
    g = np.random.default_rng(1).standard_normal((8, 8 * 64)).astype(np.float32)

    def body(x):
        return quant.reduce_scatter(x[0], ("shard",), f)[None]

    got = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("shard"), out_specs=P("shard")))(
        jax.device_put(g, NamedSharding(mesh, P("shard")))))
    roundtrip = jax.jit(lambda x: quant.dequantize(*quant.quantize(x, f), f, jnp.float32))  # one compile, not one per op
    per_device = np.stack([np.asarray(roundtrip(x)) for x in g])
    np.testing.assert_allclose(got.reshape(-1), per_device.sum(0), rtol=1e-6, atol=1e-6)


# --- the step's program: bytes in the HLO ---------------------------------------------------------------


def _shapes(hlo: str) -> dict:
    """Instruction name -> its result shape text, in an HLO module."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\S+|\([^)]*\)) ", hlo, re.M)}


def _collectives(hlo: str, op: str) -> list[tuple[str, list[str]]]:
    """``(result shape, operand shapes)`` of every ``op`` instruction (emitted or compiled HLO)."""
    shapes, out = _shapes(hlo), []
    for m in re.finditer(rf"= (\S+|\([^)]*\)) {op}\(([^)]*)\)", hlo):
        operands = [a.strip().split()[-1].lstrip("%") for a in m.group(2).split(",")]
        out.append((m.group(1), [shapes.get(a, a) for a in operands]))
    return out


@functools.cache
def _full_shard_program():
    state = zshard.init(built(mlp64), optax.sgd(0.1), zshard.make_mesh(1, 8), strategy="FULL_SHARD", mixed_precision=ALL)
    lowered = zshard.make_train_step(mse_loss).lower(state, mlp_batches(1, batch=16)[0])
    return state, lowered.as_text(dialect="hlo"), lowered.compile().as_text()


def test_hlo_gathers_u8_blocks_and_f32_scales_and_reduces_by_all_to_all():
    state, emitted, compiled = _full_shard_program()
    cov, N = quant.coverage(state.plan), 8
    recs = {zshard.path_str(p): r for p, r in state.plan.layouts.items()}
    quantized = [recs[p] for p in cov["gather"]["quantized"]]
    for text in (emitted, compiled):  # as zshard emits it, and as XLA:CPU compiled it: u8 stays u8
        gathers = _collectives(text, "all-gather")
        payloads = {r.split("[")[0] + "[" + r.split("[")[1].split("]")[0] + "]" for r, _ in gathers if r.startswith("u8")}
        for rec in quantized:  # per parameter: u8[n_pad/N] -> u8[n_pad] and f32[n_pad/(N B)] -> f32[n_pad/B]
            assert f"u8[{rec.padded}]" in payloads, rec.path
            assert any(r.startswith(f"f32[{rec.padded // B}]") for r, _ in gathers), rec.path
        for r, ops in gathers:
            if r.startswith("u8"):
                n = int(re.match(r"u8\[(\d+)\]", r).group(1))
                assert ops[0].startswith(f"u8[{n // N}]"), (r, ops)
        # gradients: an all-to-all of u8 blocks (and their scales); never an integer reduce-scatter or all-reduce
        a2a = _collectives(text, "all-to-all")
        assert sum("u8[" in r for r, _ in a2a) >= len(cov["reduce"]["quantized"]), a2a
        for op in ("reduce-scatter", "all-reduce"):
            assert not [r for r, _ in _collectives(text, op) if re.search(r"\b[us](4|8|16|32)\[", r)], op
        # the fallback parameters (norms, biases) are reduce-scattered in fp32 as without formats
        assert len(_collectives(emitted, "reduce-scatter")) == len(cov["reduce"]["fallback"])
    # bytes one device sends: per quantized parameter, u8[n_pad] payload + f32[n_pad/B] scales per gather,
    # n_pad (1 + 4/B) (N-1)/N against 4 n_pad (N-1)/N for fp32 (blocks: forward and backward; the root once)
    gathers = _collectives(emitted, "all-gather")
    count = lambda shape: sum(r.startswith(shape + "{") for r, _ in gathers)  # noqa: E731
    passes = lambda rec: 1 if rec.unit == "root" else 2  # noqa: E731
    for n in {r.padded for r in quantized}:
        assert count(f"u8[{n}]") == sum(passes(r) for r in quantized if r.padded == n), n
        assert count(f"f32[{n // B}]") >= count(f"u8[{n}]"), n  # its scales (a bias may share the shape)
    payload = sum(int(re.match(r"u8\[(\d+)\]", r).group(1)) for r, _ in gathers if r.startswith("u8"))
    assert payload == sum(r.padded * passes(r) for r in quantized)
    ring = (N - 1) / N
    u8_names = set(re.findall(r"^\s*%?([\w.\-]+) = u8\[\d+\]\S* all-gather\(", emitted, re.M))
    u8_sent = sum(c.sent_bytes * c.trips for c in parse_collectives(emitted, state.plan.mesh) if c.name in u8_names)
    assert u8_sent == pytest.approx(payload * ring)  # u8: one byte per element on the wire
    assert payload * (1 + 4 / B) / (4 * payload) == pytest.approx(0.28125)  # Psi (1 + 4/B) against 4 Psi


def test_no_formats_emit_no_quantized_op():
    # formats None: the program is the one without formats (the numbers of 7 strategies, bf16 and
    # accumulation, were compared bitwise with the code before formats: docs/quantized.md)
    mp = zshard.MixedPrecision(param_dtype="bfloat16")
    state = zshard.init(built(mlp), optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", mixed_precision=mp)
    hlo = zshard.make_train_step(mse_loss).lower(state, MLP_DATA[0]).as_text(dialect="hlo")
    assert " all-to-all(" not in hlo and " u8[" not in hlo and "bitcast-convert(" not in hlo
    assert state.plan.layouts == zshard.init(mlp, optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD",
                                             abstract=True).plan.layouts


# --- numbers: the quantized gather is exactly fake-quantized weights -----------------------------------


def _fake_quant(plan, fmt, params: dict) -> dict:
    """Each parameter ``fmt`` quantizes, as the gather hands it to the model: ``[n_pad]`` blocks
    quantized and dequantized, padding dropped (one device)."""
    out = {}
    for path, w in params.items():
        rec = plan.layouts[path]
        if quant.quantizes(fmt, rec, plan.num_shards):  # straight through: the value quantized, the gradient w's
            w = w + jax.lax.stop_gradient(rec.from_storage(quant.dequantize(*quant.quantize(rec.to_storage(w), fmt), fmt, w.dtype)) - w)
        out[path] = w
    return out


def test_gather_format_is_fake_quantized_weights_with_a_straight_through_gradient():
    # odd sizes (13 -> 19 -> 3): every quantized matrix is padded to a multiple of N*B = 128
    make = mlp
    fmt = Quant("int8", 16)
    mp = zshard.MixedPrecision(gather_format=fmt)
    state = zshard.init(built(make), optax.sgd(0.05), zshard.make_mesh(1, 8), strategy="FULL_SHARD", mixed_precision=mp)
    plan = state.plan
    assert {zshard.path_str(p) for p in plan.layouts} - set(quant.coverage(plan)["gather"]["quantized"]) == {
        "inp.bias", "blocks.0.lin.bias", "blocks.1.lin.bias", "head.bias", "head.kernel"}  # 57 elements: 8 per device
    data = mlp_batches(3, batch=16)
    model = make()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def ref_step(params, batch):  # one device: the forward sees fake-quantized weights, SGD updates the masters
        flat = nnx.to_flat_state(params)
        def loss(values):
            wq = _fake_quant(plan, fmt, values)
            ps = nnx.from_flat_state([(p, v.replace(wq[p])) for p, v in flat])
            return mse_loss(nnx.merge(graphdef, ps, rest), batch)
        values = {p: v.get_value() for p, v in flat}
        l, g = jax.value_and_grad(loss)(values)
        return l, nnx.from_flat_state([(p, v.replace(values[p] - 0.05 * g[p])) for p, v in flat])

    step = zshard.make_train_step(mse_loss, prefetch=1)
    for batch in data:
        want, params = ref_step(params, batch)
        state, m = step(state, batch)
        assert float(m["loss"]) == pytest.approx(float(want), rel=1e-5)
    got = dict(nnx.to_flat_state(nnx.state(zshard.unshard(state), nnx.Param)))
    for path, v in nnx.to_flat_state(params):
        assert rel_l2(got[path].get_value(), v.get_value()) <= 1e-5, path


# --- every strategy, scan, prefetch, remat, accumulation, tensor pieces --------------------------------

@pytest.mark.parametrize("strategy,shape,mp,options", [
    ("FULL_SHARD", (1, 8), MLP_ALL, dict(prefetch=1)),
    ("SHARD_GRAD_OP", (2, 4), MLP_ALL, dict(remat="none")),
    ("HYBRID_SHARD", (2, 4), MLP_HYB, dict(remat="dots")),
    ("HYBRID_SHARD", (2, 4), MLP_HYB, dict(grad_accum=2)),  # the replica all-reduce once per step, quantized
    ("HYBRID_SHARD_ZERO2", (2, 4), MLP_HYB, dict()),
    ("HYBRID_SHARD_OPT", (2, 4), MLP_HYB, dict(prefetch=1)),  # into the optimizer slices, quantized
    ("NO_SHARD", (2, 4), zshard.MixedPrecision(replica_format=Q16), dict()),
    ("SHARD_OPT", (2, 4), zshard.MixedPrecision(param_dtype="bfloat16", replica_format=Q16), dict()),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_every_strategy_trains_close_to_one_device(strategy, shape, mp, options):
    state = _placed(strategy, shape, mp)
    step = _mlp_step(tuple(sorted(options.items())))
    colls = parse_collectives(step.lower(state, MLP_DATA[0]).as_text(dialect="hlo"), state.plan.mesh)
    expect = {"FULL_SHARD": {"shard"}, "SHARD_GRAD_OP": {"world"}, "NO_SHARD": {"world"}, "SHARD_OPT": {"world"}}
    assert {c.axis for c in colls if c.kind == "all-to-all"} == expect.get(strategy, {"shard", "replica"})
    _, losses = _train(state, step, MLP_DATA)
    # quantization moves the losses a little, never far (int8 blocks of 16 here; bf16 compute for SHARD_OPT)
    want = mlp_reference().losses
    np.testing.assert_allclose(losses, want, rtol=1e-2)
    assert losses != want and losses[-1] < losses[0]


def mlp_scan():
    """Two 19-wide blocks stacked (``nnx.vmap``) and run by ``nnx.scan``: one stacked unit, [2, 361] kernels."""
    return Net(13, 19, 3, layers=2, rngs=nnx.Rngs(0))


def test_scanned_blocks_quantize_every_layer():
    # a stacked unit's gathers and gradient all-to-alls quantized inside the loop body (this was a scanned GPT,
    # d 32, 2 layers, int8/32: the same stacked-unit path; its step and reference compiles took 4.4 s)
    state = zshard.init(built(mlp_scan), optax.adamw(3e-3), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", mixed_precision=MLP_HYB)
    step = zshard.make_train_step(mse_loss)
    hlo = step.lower(state, MLP_DATA[0]).as_text(dialect="hlo")
    comps = _computations(hlo)
    inside, todo = set(), re.findall(r"body=%?([\w.\-]+)", hlo)  # the scan's loop body and what it calls
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo += [c for line in comps.get(name, []) for c in re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", line)]
    body = "\n".join(line for name in inside for line in comps.get(name, []))
    assert re.search(r"= u8\[\d+\]\S* all-gather\(", body) and re.search(r"u8\[[\d,]+\]\S* all-to-all\(", body)
    want = reference_run(mlp_scan, optax.adamw(3e-3), mse_loss, MLP_DATA[:3]).losses
    _, losses = _train(state, step, MLP_DATA[:3])
    np.testing.assert_allclose(losses, want, rtol=5e-3)


def test_parameters_split_over_tensor_quantize_each_piece():
    make = mlp32
    plan = {"blocks.*.lin.kernel": -1, "blocks.*.lin.bias": 0}  # column-parallel blocks: [32, 16] pieces
    state = zshard.init(built(make), optax.adam(1e-2), zshard.make_mesh(1, 4, tensor=2), strategy="FULL_SHARD",
                        tensor_parallel=plan, mixed_precision=MLP_ALL)
    split = {zshard.path_str(p) for p in state.plan.tensor_split}
    assert split & set(quant.coverage(state.plan)["gather"]["quantized"]) == {"blocks.0.lin.kernel", "blocks.1.lin.kernel"}
    step = zshard.make_train_step(mse_loss)
    hlo = step.lower(state, MLP_DATA[0]).as_text(dialect="hlo")
    assert _collectives(hlo, "all-to-all") and any(r.startswith("u8") for r, _ in _collectives(hlo, "all-gather"))
    _, losses = _train(state, step, MLP_DATA)
    np.testing.assert_allclose(losses, reference_run(make, optax.adam(1e-2), mse_loss, MLP_DATA).losses, rtol=1e-2)


def test_global_view_optimizer_reads_the_padded_shards():
    # a chain that needs the global view (clip_by_global_norm inside it) on parameters padded for blocks
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    state = zshard.init(built(mlp), tx, zshard.make_mesh(1, 8), strategy="FULL_SHARD", mixed_precision=MLP_ALL)
    assert state.plan.opt_view is not None
    _, losses = _train(state, zshard.make_train_step(mse_loss), MLP_DATA)
    np.testing.assert_allclose(losses, mlp_reference("clipped").losses, rtol=1e-2)


# --- the report, checkpoints ---------------------------------------------------------------------------


def test_report_shows_each_axis_with_its_format_against_the_formula():
    make = built(mlp64)
    state = zshard.init(make, optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", mixed_precision=MLP_HYB)
    plain = zshard.init(make, optax.sgd(0.1), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    step = zshard.make_train_step(mse_loss)
    rq, rp = (zshard.report(step, s, MLP_DATA[0]) for s in (state, plain))
    assert rq.moves == {"shard": "gather int8/16, reduce int8/16", "replica": "reduce int8/16"}
    assert rp.moves == {"shard": "gather float32, reduce float32", "replica": "reduce float32"}
    for axis in ("shard", "replica"):
        assert rq.comm_bytes_per_step[axis]["ratio"] == pytest.approx(1.0, abs=0.02), axis
        # int8 blocks of 16 against fp32: (1 + 4/16) / 4 = 0.31 of the bytes, the biases apart
        assert 0.3 < rq.comm_bytes_per_step[axis]["measured"] / rp.comm_bytes_per_step[axis]["measured"] < 0.36, axis
    assert rq.quantized["replica"]["format"] == "int8/16" and "head.bias" in rq.quantized["replica"]["fallback"]
    assert {c["kind"] for c in rq.collectives} >= {"all-to-all"} and rp.quantized is None
    table = rq.table()
    assert "gather int8/16, reduce int8/16 |" in table and "| replica | int8/16 | 4 | " in table


def test_checkpoints_store_the_same_logical_arrays_with_or_without_formats(tmp_path):
    tx = ADAM
    state = _placed("HYBRID_SHARD", (2, 4), MLP_HYB)
    step = _mlp_step((("remat", "dots"),))  # test_every_strategy_...[HYBRID_SHARD-2x4-mp2-options2]'s program, its plan
    state, _ = _train(state, step, MLP_DATA[:2])
    zshard.save(state, tmp_path / "ckpt")
    # restored without formats (another padding), and back with them: the same numbers
    restore = functools.partial(zshard.restore, tmp_path / "ckpt", model=mlp, tx=tx)
    plain, _ = restore(zshard.make_mesh(1, 8), strategy="FULL_SHARD")
    assert any(plain.plan.layouts[p].padded != r.padded for p, r in state.plan.layouts.items())
    again, _ = restore(zshard.make_mesh(2, 4), strategy="HYBRID_SHARD", mixed_precision=MLP_HYB)
    want = nnx.to_flat_state(nnx.state(zshard.unshard(state), nnx.Param))
    for restored in (plain, again):
        got = dict(nnx.to_flat_state(nnx.state(zshard.unshard(restored), nnx.Param)))
        for path, v in want:
            np.testing.assert_array_equal(got[path].get_value(), v.get_value())
    _, a = _train(state, step, MLP_DATA[2:4])
    _, b = _train(again, step, MLP_DATA[2:4])
    assert a == b  # resumed with the formats: the same losses, bit for bit


@pytest.mark.parametrize("fmt", [Quant("int4", 16), Quant("float8_e4m3fn", 16), Quant("float8_e5m2", None),
                                 Quant("int8", None)], ids=lambda f: f.label)
def test_compiled_collectives_move_one_byte_or_half_a_byte_per_element(fmt):
    # XLA:CPU widens fp8 collectives to f16 and int4 to s8 while compiling; the u8 bitcast keeps
    # bits/8 bytes per element on the wire, in the program as compiled: no silent fallback
    N, n = 8, 8 * 16 * 8  # 1024 elements, blocks of 16 inside each shard
    mesh = jax.make_mesh((N,), ("shard",), axis_types=(jax.sharding.AxisType.Explicit,))

    def body(x):
        x = x[0]
        return (quant.all_gather(x[: n // N], ("shard",), fmt, jnp.float32)[None],
                quant.reduce_scatter(x, ("shard",), fmt)[None])

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("shard"), out_specs=(P("shard"), P("shard"))))
    compiled = fn.lower(jax.ShapeDtypeStruct((N, n), jnp.float32, sharding=NamedSharding(mesh, P("shard")))).compile().as_text()
    width = n * fmt.bits // 8  # payload bytes of the whole buffer
    arrays = lambda shapes: [(dt, int(np.prod([int(d) for d in dims.split(",") if d]))) for shape in shapes  # noqa: E731
                             for dt, dims in re.findall(r"\b(\w+)\[([\d,]*)\]", shape.split("{")[0] if "(" not in shape else shape)]
    gathers, a2a = _collectives(compiled, "all-gather"), _collectives(compiled, "all-to-all")
    # the weight gather: u8[n/N] -> u8[n] (int4: n/2), f32 scales [n/(N B)] -> [n/B] (tensorwise: none, a pmax)
    assert [(r.split("{")[0], ops[0].split("{")[0]) for r, ops in gathers if r.startswith("u8")] == [
        (f"u8[{width}]", f"u8[{width // N}]")]
    scales = n // fmt.block if fmt.block else 0
    assert sorted(arrays([r for r, _ in gathers])) == sorted([("u8", width)] + ([("f32", scales)] if scales else []))
    # the gradient: one all-to-all (XLA:CPU combines payload and scales in one tuple): u8 chunks of
    # width/N, f32 scales of n/(N B) per chunk (tensorwise: one per chunk)
    got = arrays([r for r, _ in a2a])
    assert sorted(got) == sorted([("u8", width // N)] * N + [("f32", (scales or N) // N)] * N), got
    every = [r for op in ("all-gather", "all-to-all", "reduce-scatter", "all-reduce") for r, _ in _collectives(compiled, op)]
    assert not [r for r in every if re.search(r"\b(f16|s8|s4|u4|bf16|f8e4m3fn|f8e5m2)\[", r)], every  # nothing widened
    reduces = [r for op in ("reduce-scatter", "all-reduce") for r, _ in _collectives(compiled, op)]
    assert reduces == ([] if fmt.block else ["f32[]"]) or all(r.startswith("f32[") for r in reduces), reduces  # the pmax only
    # the report's reader counts the same bytes: payload 1 byte (int4: half) per element, ring
    ring = (N - 1) / N
    want = ring * (2 * width + 4 * (2 * scales if scales else N)) + 2 * ring * 4 * len(reduces)
    assert sum(c.sent_bytes * c.trips for c in parse_collectives(compiled, mesh)) == pytest.approx(want)
