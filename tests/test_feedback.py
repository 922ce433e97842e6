"""Error feedback for quantized gradient reductions (``reduce_format=zshard.Quant(..., error_feedback=True)``,
zshard/wire/quant.py ``reduce_scatter_feedback``, [Note: error feedback] in zshard/wire/collectives.py): the
residual is exactly what the quantizer dropped, in the collective and in the step (FULL_SHARD 1x8,
HYBRID_SHARD 2x4 with scan and gradient accumulation), the first step is bitwise the step without
feedback, checkpoints store the residuals bit for bit and reset them with a warning where they do
not fit, and what is refused is refused by name before compiling. The training gap is measured by
``python -m train.bench`` section 5, not here."""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import built, gpt_batches
from flax import nnx, traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zshard
from train.model import GPT, GPTConfig, cross_entropy_loss
from zshard.wire import quant
from zshard.wire.quant import Quant

B = 32  # every matrix of the tiny GPT has at least 32 elements per device
INT4 = Quant("int4", block=B)
EF = zshard.MixedPrecision(reduce_format=Quant("int4", block=B, error_feedback=True))
NO_EF = zshard.MixedPrecision(reduce_format=INT4)
LR = 1.0  # plain SGD: the update is -LR times the reduced gradient, so the step's gradient is read back exactly
DATA = gpt_batches(2, batch=16)


def gpt(scan=False):
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, scan=scan), rngs=nnx.Rngs(0))


def _host(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


@functools.cache
def _run(mesh_shape=(1, 8), strategy="FULL_SHARD", grad_accum=1, scan=False, mp=EF, steps=2, prefetch=1):
    """``(plan, snapshots, losses, final state)``: each snapshot the host copy of
    ``(params, feedback)`` before a step, the last one after the last step."""
    mesh = zshard.make_mesh(*mesh_shape)
    state = zshard.init(built(gpt, scan), optax.sgd(LR), mesh, strategy=strategy, mixed_precision=mp)
    step = zshard.make_train_step(cross_entropy_loss, grad_accum=grad_accum, prefetch=prefetch)
    snaps, losses = [], []
    for b in DATA[:steps]:
        snaps.append((_host(state.params), _host(state.feedback)))
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    snaps.append((_host(state.params), _host(state.feedback)))
    return state.plan, snaps, losses, state


@functools.cache
def _grad_fn(scan: bool):
    """One compiled one-device gradient of the mean loss: ``(nnx state of the parameters, batch) -> grads``."""
    graphdef, _, rest = nnx.split(gpt(scan), nnx.Param, ...)
    return jax.jit(lambda params, batch: nnx.grad(lambda m: cross_entropy_loss(m, batch))(nnx.merge(graphdef, params, rest)))


def _reference_grad(plan, params: dict, batch) -> dict:
    """The exact gradient of the global mean loss at ``params`` (stored form), on one device:
    ``path -> logical array``."""
    scan = any(rec.layers for rec in plan.layouts.values())
    flat = traverse_util.flatten_dict(params)
    logical = nnx.from_flat_state([(p, nnx.Param(jnp.asarray(plan.layouts[p].from_storage(flat[p])))) for p in plan.layouts])
    grads = _grad_fn(scan)(logical, jax.tree.map(jnp.asarray, batch))
    return {p: np.asarray(v) for p, v in traverse_util.flatten_dict(nnx.to_pure_dict(grads)).items()}


def _residual_sum(plan, path, fb: dict) -> np.ndarray:
    """``sum over devices`` of a residual ``[..., W * n_pad]`` -> the logical shape."""
    rec = plan.layouts[path]
    x = fb[path].reshape(rec.lead + (plan.world, rec.padded))  # [..., W n_pad] -> [..., W, n_pad]
    return rec.from_storage(x.sum(axis=len(rec.lead)))  # sum over the W devices -> [..., n_pad] -> logical


# --- the collective ----------------------------------------------------------------------------------


def test_the_residual_is_exactly_what_the_quantizer_dropped():
    mesh = zshard.make_mesh(1, 8)
    n, axes = 8 * 4 * B, ("shard",)
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal((8, n)), jnp.float32)  # one gradient [n] per device
    e = jnp.asarray(0.05 * rng.standard_normal((8, n)), jnp.float32)  # and its residual

    def body(g, e):
        shard, new = quant.reduce_scatter_feedback(g[0], e[0], axes, INT4)
        plain = quant.reduce_scatter(g[0] + e[0], axes, INT4)  # the same all-to-all of g + e, without feedback
        return shard[None], new[None], plain[None]

    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("shard")))  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("shard"), P("shard")), out_specs=(P("shard"),) * 3))
    shard, new, plain = fn(put(g), put(e))
    x = g + e
    payload, scales = quant.quantize(x, INT4)  # each device's quantization, on one device
    dropped = x - quant.dequantize(payload, scales, INT4, jnp.float32)
    # to rounding: x - q * s is one fused multiply-add in the compiled program (exact), two roundings here
    chex.assert_trees_all_close(new, dropped, rtol=0, atol=float(2.0**-23 * jnp.abs(x).max()))
    chex.assert_trees_all_equal(shard, plain)  # what goes on the wire is the quantized g + e
    # |residual| <= half a quantum of its block (absmax / 7 / 2: round to nearest), and not nothing
    half = np.repeat(np.asarray(scales), B, axis=-1) / 2
    assert np.all(np.abs(np.asarray(new)) <= half * (1 + 1e-6)) and np.abs(np.asarray(new)).max() > 0.1 * half.max()


# --- the step ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_shape, strategy, grad_accum, scan",
    [((1, 8), "FULL_SHARD", 1, False), ((2, 4), "HYBRID_SHARD", 2, True)],
    ids=["full_shard_1x8", "hybrid_2x4_scan_accum2"],
)
def test_the_step_sends_gradient_plus_residual_and_keeps_what_it_dropped(mesh_shape, strategy, grad_accum, scan):
    """Summed over devices (and micro-batches) the reduction carries ``g + e_old - e_new``
    (telescoping over micro-batches), so the step's gradient, read back from an SGD update, is
    the exact gradient plus the old residuals minus the new ones: the residuals are what the
    quantizer dropped from the gradient the step itself computed."""
    plan, snaps, _, _ = _run(mesh_shape, strategy, grad_accum, scan)
    fb_paths = set(traverse_util.flatten_dict(snaps[0][1]))
    assert fb_paths == {p for p in plan.layouts if plan.layouts[p].trainable and quant.quantizes(INT4, plan.layouts[p], plan.num_shards)}
    assert all(zshard.path_str(p).endswith(("kernel", "embedding")) for p in fb_paths)  # norms and biases have none
    for (params, fb_old), (new_params, fb_new), batch in zip(snaps, snaps[1:], DATA):
        exact = _reference_grad(plan, params, batch)
        flat_old, flat_new = traverse_util.flatten_dict(params), traverse_util.flatten_dict(new_params)
        flat_fb_old, flat_fb_new = traverse_util.flatten_dict(fb_old), traverse_util.flatten_dict(fb_new)
        for path, rec in plan.layouts.items():
            got = (rec.from_storage(flat_old[path]) - rec.from_storage(flat_new[path])) / LR  # the reduced gradient
            want = exact[path]
            if path in fb_paths:
                carried = _residual_sum(plan, path, flat_fb_old) - _residual_sum(plan, path, flat_fb_new)
                assert np.linalg.norm(carried) > 1e-2 * np.linalg.norm(want), path  # int4 drops a lot: a real test
                want = want + carried
            np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(exact[path]).max() + 1e-7, err_msg=zshard.path_str(path))
        assert all(np.all(np.isfinite(x)) for x in flat_fb_new.values())


def test_the_first_step_is_bitwise_the_step_without_feedback():
    """The residuals start at zero, and ``g + 0`` quantizes to what ``g`` does: step 1 with error
    feedback is bitwise the quantized step without it; step 2 is not (the residual is used)."""
    _, with_ef, losses_ef, _ = _run()
    plan, without, losses, _ = _run(mp=NO_EF)
    assert without[0][1] == {} and not plan.mp.error_feedback
    chex.assert_trees_all_equal(with_ef[1][0], without[1][0])  # parameters after step 1
    assert losses_ef[:2] == losses[:2]  # step 2's loss is computed before its update
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(with_ef[2][0]), jax.tree.leaves(without[2][0])))


def test_feedback_state_layout_and_bytes():
    plan, snaps, _, state = _run()
    for path, (shape, spec) in quant.feedback_layout(plan).items():
        rec = plan.layouts[path]
        x = traverse_util.flatten_dict(state.feedback)[path]
        assert x.shape == shape == (8 * rec.padded,) and x.dtype == jnp.float32 and spec == P(("replica", "shard"))
        assert x.sharding.spec == spec and x.addressable_shards[0].data.shape == (rec.padded,)  # [n_pad] per device
    assert quant.feedback_bytes(plan) == sum(4 * plan.layouts[p].padded for p in quant.feedback_layout(plan))
    # without error feedback nothing is added: no residual, the state's specs and leaves as before
    plain = zshard.init(gpt, optax.sgd(LR), zshard.make_mesh(1, 8), abstract=True, mixed_precision=NO_EF)
    assert plain.feedback == {} and quant.feedback_layout(plain.plan) == {} and quant.feedback_bytes(plain.plan) == 0
    assert plain.specs().feedback == {}


def test_error_feedback_is_refused_where_it_is_not_built():
    with pytest.raises(ValueError, match=r"replica_format=Quant\('int4', error_feedback=True\).*shard-axis gradient all-to-all only"):
        zshard.MixedPrecision(replica_format=Quant("int4", error_feedback=True))
    with pytest.raises(ValueError, match="error feedback corrects gradient quantization"):
        zshard.MixedPrecision(gather_format=Quant("int8", error_feedback=True))
    assert not zshard.MixedPrecision().error_feedback and EF.error_feedback  # a format carries it: None has none
    mesh = zshard.make_mesh(2, 4)
    with pytest.raises(ValueError, match="HYBRID_SHARD_OPT reduces gradients into its optimizer slices.*error feedback"):
        zshard.init(gpt, optax.sgd(LR), mesh, strategy="HYBRID_SHARD_OPT", mixed_precision=EF, abstract=True)
    tmesh = zshard.make_mesh(1, 4, tensor=2)
    with pytest.raises(ValueError, match="is split over tensor; error feedback is not built for tensor-parallel"):
        zshard.init(gpt, optax.sgd(LR), tmesh, mixed_precision=EF, abstract=True,
                    tensor_parallel={"blocks.*.mlp.fc.kernel": -1})  # fmt: skip


# --- checkpoints -------------------------------------------------------------------------------------


def test_checkpoints_store_the_residuals_bitwise_and_reset_them_with_a_warning(tmp_path):
    plan, _, _, state = _run()
    mesh = plan.mesh
    want = _host(state.feedback)
    zshard.checkpoint.save(state, tmp_path / "ef")
    ckpt = zshard.checkpoint.Checkpointer(tmp_path / "ef")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a round trip warns of nothing
        restored, _ = ckpt.restore(mesh, model=gpt, tx=optax.sgd(LR), mixed_precision=EF)
    chex.assert_trees_all_equal(_host(restored.feedback), want)
    chex.assert_trees_all_equal(_host(restored.params), _host(state.params))
    # into a state without error feedback: dropped, with a warning naming why
    with pytest.warns(UserWarning, match="error-feedback residuals are not restored; the target has no error feedback"):
        plain, _ = ckpt.restore(mesh, model=gpt, tx=optax.sgd(LR), mixed_precision=NO_EF)
    assert plain.feedback == {}
    chex.assert_trees_all_equal(_host(plain.params), _host(state.params))
    # HYBRID_SHARD 2x4 over the same 8 devices: the same [W n_pad] (device r*4+s takes the rows device r*4+s
    # had, and the blocks sit at the same offsets of [n_pad]): restored bit for bit
    hybrid, _ = ckpt.restore(zshard.make_mesh(2, 4), model=gpt, tx=optax.sgd(LR), strategy="HYBRID_SHARD", mixed_precision=EF)
    chex.assert_trees_all_equal(_host(hybrid.feedback), want)
    # onto 4 devices: other shapes, zeros with a warning
    with pytest.warns(UserWarning, match="saved for another mesh or format.*they start at zero"):
        other, _ = ckpt.restore(zshard.make_mesh(1, 4, devices=jax.devices()[:4]), model=gpt, tx=optax.sgd(LR), mixed_precision=EF)
    assert set(traverse_util.flatten_dict(other.feedback)) == set(traverse_util.flatten_dict(want))
    assert all(x.shape[-1] * 2 == y.shape[-1] and not np.any(x) for x, y in zip(jax.tree.leaves(_host(other.feedback)), jax.tree.leaves(want)))
    # a checkpoint without residuals into a state with error feedback: zeros, with a warning
    zshard.checkpoint.save(plain, tmp_path / "plain")
    with pytest.warns(UserWarning, match="the checkpoint has none .saved without error feedback.: they start at zero"):
        back, _ = zshard.checkpoint.Checkpointer(tmp_path / "plain").restore(mesh, model=gpt, tx=optax.sgd(LR), mixed_precision=EF)
    assert all(not np.any(x) for x in jax.tree.leaves(_host(back.feedback)))


# --- the main job ------------------------------------------------------------------------------------


def test_the_main_job_takes_error_feedback_in_precision():
    from train import config as C  # noqa: PLC0415
    from train.cli import build_parser  # noqa: PLC0415

    cfg = build_parser().parse_args(["--reduce-format", "int4", "--error-feedback"]).run.validate()
    assert cfg.mixed_precision() == zshard.MixedPrecision(reduce_format=Quant("int4", 256, error_feedback=True))
    assert C.Config.from_dict({"precision": {"reduce_format": "int4"}}).validate().mixed_precision() == \
        zshard.MixedPrecision(reduce_format=Quant("int4", 256))
    for raw, needle in (
        ({"precision": {"error_feedback": True}}, r"precision.error_feedback \(--error-feedback\).*set precision.reduce_format too"),
        ({"precision": {"error_feedback": True, "reduce_format": "int4"}, "mesh": {"shape": "2x4", "strategy": "HYBRID_SHARD_OPT"}},
         "precision.error_feedback.*HYBRID_SHARD_OPT reduces gradients into its optimizer slices"),
    ):
        with pytest.raises(C.ConfigError, match=needle):
            C.Config.from_dict(raw).validate()
