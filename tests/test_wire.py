"""The wire and the gradient exit as components: one collective at a time on 8 emulated devices.

Each test runs one collective of zshard/wire/collectives.py or zshard/wire/grad_exit.py under
``jax.shard_map`` on the ``2 x 4`` mesh and compares it with a numpy reference (plain, quantized,
error feedback, the three replica reductions), and where it moves quantized bytes, the bytes its
traced collectives carry against :func:`zshard.wire.quant.wire_bytes` (ZeRO++, arXiv 2306.10209
section 3). Also: the mesh-axes record (zshard/mesh/axes.py), the wire records the planner resolves
(zshard/wire/wire.py), and no import cycle among zshard's modules. Nothing here compiles a train step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from zshard.mesh.axes import MeshAxes
from zshard.wire.collectives import gather_params
from zshard.params.flat import ParamLayout
from zshard.wire.grad_exit import GradExit, reduce_grads
from zshard.wire.quant import Quant, wire_bytes
from zshard.mesh.strategy import ReplicaReduce
from zshard.wire.wire import UnitComm, resolve_wire

ROOT = Path(__file__).resolve().parent.parent
WORLD = ("replica", "shard")
SHAPE = (16, 32)  # 512 elements: 64 per device, two blocks of 32 per device
B = 32


@pytest.fixture(scope="module")
def mesh():
    return zshard.make_mesh(2, 4)


def _rec(axes, multiple=8 * B):
    return ParamLayout.build(("w",), SHAPE, jnp.float32, multiple, axes=axes)


def _comm(rec, reduce=ReplicaReduce.NONE, shard_axes=WORLD, replica_axes=(), mp=None, parts=1, world=8):
    mp = mp or zshard.MixedPrecision()
    num = 8 if shard_axes == WORLD else 4
    wire = resolve_wire(rec, mp, shard_axes, replica_axes, num, world)
    return UnitComm(shard_axes, replica_axes, reduce, parts, mp, wires={rec.path: wire})


def _blocks_np(x: np.ndarray, qmax: float = 127.0):
    """numpy's int8 absmax block quantization of ``x [..., n]``, dequantized (ZeRO++ section 3.1)."""
    blocks = x.astype(np.float32).reshape(x.shape[:-1] + (-1, B))
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    q = np.round(np.clip(blocks / scale, -qmax, qmax))
    return (q * scale).reshape(x.shape).astype(np.float32)


# --- the mesh-axes record -----------------------------------------------------------------------------


def test_mesh_axes_record_answers_every_axis_question(mesh):
    axes = MeshAxes.of(mesh)
    assert (axes.replica, axes.shard, axes.context, axes.tensor) == (2, 4, 1, 1)
    assert axes.names == WORLD and axes.data_axes == WORLD and axes.world == 8 and not axes.tensor_enabled
    ctx = MeshAxes(1, 2, context=2, tensor=2)
    assert ctx.names == ("replica", "shard", "context", "tensor") and ctx.data_axes == ("replica", "shard", "context")
    assert ctx.manual_axes == ctx.data_axes and ctx.world == 4 and ctx.rows == 2 and ctx.tensor_enabled
    assert ctx.with_context(("shard",)) == ("shard", "context") and axes.with_context(("shard",)) == ("shard",)
    assert ctx.size(("shard", "tensor")) == 4
    with pytest.raises(ValueError, match="shard=0 must be a positive integer"):
        MeshAxes(1, 0)
    with pytest.raises(ValueError, match="tensor=2 but the axes"):
        MeshAxes(1, 2, tensor=2, names=WORLD)


# --- the wire records ---------------------------------------------------------------------------------


def test_the_wire_record_holds_a_format_only_where_it_quantizes():
    mp = zshard.MixedPrecision(param_dtype="bfloat16", gather_format=Quant("int8", B),
                               reduce_format=Quant("int4", B, error_feedback=True))
    w = resolve_wire(_rec(WORLD), mp, WORLD, (), 8, 8)
    assert w.gather_format == Quant("int8", B) and w.reduce_format.name == "int4" and w.residual
    assert w.gather_dtype == jnp.bfloat16 and w.reduce_dtype == jnp.bfloat16 and not w.pieces
    bias = ParamLayout.build(("b",), (64,), jnp.float32, 8 * B, axes=WORLD)  # rank 1: never quantized
    wb = resolve_wire(bias, mp, WORLD, (), 8, 8)
    assert wb.gather_format is None and wb.reduce_format is None and not wb.residual
    small = resolve_wire(_rec(WORLD), zshard.MixedPrecision(gather_format=Quant("int8", 128)), WORLD, (), 8, 8)
    assert small.gather_format is None  # 64 elements per device: fewer than one block of 128
    hybrid = resolve_wire(_rec(("shard",)), zshard.MixedPrecision(replica_format="int8"), ("shard",), ("replica",), 4, 8)
    assert hybrid.replica_format is None and hybrid.vary_axes == ("shard", "replica")  # 512/8 = 64 < 256


# --- one collective against numpy ---------------------------------------------------------------------


def _run(mesh, fn, in_specs, out_specs, *args):
    return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))(*args))


def test_gather_is_the_concatenation_of_the_shards(mesh):
    rec = _rec(WORLD)
    comm = _comm(rec, mp=zshard.MixedPrecision(param_dtype="bfloat16"))
    x = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)
    stored = jax.device_put(np.asarray(rec.to_storage(x)), NamedSharding(mesh, P(WORLD)))
    out = _run(mesh, lambda b: gather_params([rec], [b], comm)[0][None], P(WORLD), P(WORLD), stored)
    assert out.dtype == jnp.bfloat16 and out.shape == (8,) + SHAPE
    np.testing.assert_array_equal(out, np.broadcast_to(x.astype(jnp.bfloat16), (8,) + SHAPE))  # every device, whole


def test_quantized_gather_is_blockwise_int8_and_moves_its_formula_bytes(mesh):
    rec = _rec(WORLD)
    comm = _comm(rec, mp=zshard.MixedPrecision(gather_format=Quant("int8", B)))
    x = np.random.default_rng(1).normal(size=SHAPE).astype(np.float32)
    stored = jax.device_put(np.asarray(rec.to_storage(x)), NamedSharding(mesh, P(WORLD)))
    fn = jax.shard_map(lambda b: gather_params([rec], [b], comm)[0][None], mesh=mesh, in_specs=P(WORLD), out_specs=P(WORLD))
    out = np.asarray(jax.jit(fn)(stored))
    np.testing.assert_allclose(out[3], _blocks_np(x.reshape(-1)).reshape(SHAPE), rtol=0, atol=1e-6)
    # what the all-gathers carry, per device, gathered: u8 payload + f32 scales = wire_bytes(int8, n)
    eqns = [e for e in jax.make_jaxpr(fn)(stored).eqns[0].params["jaxpr"].eqns if e.primitive.name == "all_gather"]
    moved = sum(8 * np.prod(e.invars[0].aval.shape) * e.invars[0].aval.dtype.itemsize for e in eqns)
    assert moved == wire_bytes(Quant("int8", B), rec.padded, jnp.float32) == 512 + 4 * 512 / B


@pytest.mark.parametrize("reduce", [ReplicaReduce.NONE, ReplicaReduce.PER_UNIT, ReplicaReduce.TO_SLICES])
def test_the_gradient_exit_sums_every_device(mesh, reduce):
    # NONE: FULL_SHARD's reduce-scatter over the world; PER_UNIT: HYBRID_SHARD's reduce-scatter over
    # shard then all-reduce of the shard over replica; TO_SLICES: HYBRID_SHARD_OPT's reduce-scatter over
    # shard then over replica, into the optimizer slice [n_pad/(R S)] (opt_axes = (shard, replica)).
    hybrid = reduce is not ReplicaReduce.NONE
    shard_axes, replica_axes = (("shard",), ("replica",)) if hybrid else (WORLD, ())
    rec = _rec(shard_axes)
    comm = _comm(rec, reduce, shard_axes, replica_axes, parts=2 if reduce is ReplicaReduce.TO_SLICES else 1)
    g = np.random.default_rng(2).normal(size=(8,) + SHAPE).astype(np.float32)  # device d's own gradient
    grads = jax.device_put(g, NamedSharding(mesh, P(WORLD)))
    dtypes = [jnp.float32] if reduce is ReplicaReduce.TO_SLICES else None
    out_spec = {ReplicaReduce.NONE: P(WORLD), ReplicaReduce.PER_UNIT: P("shard"), ReplicaReduce.TO_SLICES: P(("shard", "replica"))}[reduce]
    out = _run(mesh, lambda x: reduce_grads([rec], [x[0]], comm, dtypes)[0], P(WORLD), out_spec, grads)
    want = np.asarray(rec.to_storage(g.sum(0)))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_quantized_exit_with_error_feedback_keeps_what_the_wire_dropped(mesh):
    rec = _rec(WORLD)
    comm = _comm(rec, mp=zshard.MixedPrecision(reduce_format=Quant("int8", B, error_feedback=True)))
    assert comm.exit == GradExit(ReplicaReduce.NONE, (), 1, True) and comm.wire(rec).residual
    rng = np.random.default_rng(3)
    g = rng.normal(size=(8,) + SHAPE).astype(np.float32)
    r = (0.01 * rng.normal(size=(8, rec.padded))).astype(np.float32)  # each device's residual [n_pad]
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(WORLD)))  # noqa: E731

    def body(x, e):
        (shard,), (new,) = reduce_grads([rec], [x[0]], comm, residuals=[e[0]])
        return shard, new[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(WORLD), P(WORLD)), out_specs=(P(WORLD), P(WORLD))))
    shard, new = (np.asarray(a) for a in fn(put(g), put(r)))
    x = np.stack([np.asarray(rec.to_storage(g[d])) for d in range(8)]) + r  # [8, n_pad]: g + e
    deq = _blocks_np(x)
    np.testing.assert_allclose(new, x - deq, rtol=0, atol=1e-6)  # e' = x - dequantize(quantize(x))
    np.testing.assert_allclose(shard, deq.sum(0), rtol=1e-5, atol=1e-5)  # the fp32 sum of the dequantized chunks


# --- the import graph ---------------------------------------------------------------------------------


def test_no_import_cycle_in_zshard():
    # collectives <-> quant <-> precision was one (a function-local import hid it); function-local
    # imports count here too
    mods = {}
    for p in (ROOT / "zshard").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for m, p in mods.items():
        deps = set()
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.startswith("zshard"):
                deps |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
        graph[m] = {d for d in deps if d in mods and d not in (m, "zshard")}
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            assert state.get(d) != "open", f"import cycle: {' -> '.join(path + [m, d])}"
            if d not in state:
                visit(d, path + [m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
