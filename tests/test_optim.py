"""Every Optax transformation, exactly, on shards (zshard.optim.optim_global), against ``nnx.Optimizer``
on one device: the model of ``optim_cases`` has uneven sizes, 1-D, 2-D, scalar and stacked
(``nnx.vmap``-built, ``nnx.scan``-run) parameters; 10 steps on each strategy."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from conftest import ResMLP, built, mlp_batches, mse_loss, reference_run, rel_l2, zshard_run
from flax import nnx
from optim_cases import net

import zshard
from zshard.report import optimizer_report, parse_collectives

STEPS = 10


def by_path(params):
    """multi_transform labels by path and ndim: the root's kernels Muon, the stacked blocks LAMB,
    everything else SGD with a schedule."""

    def label(path, x):
        name = jax.tree_util.keystr(path)
        if "blocks" in name:
            return "lamb"
        return "muon" if x.ndim == 2 else "sgd"

    return jax.tree_util.tree_map_with_path(label, params)


TXS = {
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), 3),
    "lamb": lambda: optax.lamb(1e-2, weight_decay=1e-2),
    "lars": lambda: optax.lars(0.1),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),  # factors [13, 19] and [2, 19, 19]
    "muon": lambda: optax.contrib.muon(1e-2),  # 2-D kernels (and the [2, 19] stacked bias); Adam for the rest
    "multi_steps": lambda: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), 3),
    "multi_transform": lambda: optax.multi_transform(
        {
            "muon": optax.contrib.muon(1e-2),
            "lamb": optax.lamb(1e-2),
            "sgd": optax.sgd(optax.cosine_decay_schedule(0.1, STEPS), momentum=0.9),
        },
        by_path,
    ),
    # noise of variance 1 (the update's scale): the test of its draw below compares with this run
    "add_noise": lambda: optax.chain(optax.add_noise(1.0, 0.55, key=7), optax.sgd(1e-2)),
    "masked_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(0.05),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, STEPS), mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    ),
}

# Every optimizer runs on 1x8 FULL_SHARD or 2x4 HYBRID_SHARD (Adafactor and Muon on both); the
# other strategies each get at least one, so every way the optimizer state is split is covered
# (compile time: one step compile per case). add_noise on FULL_SHARD: the test further below.
CASES = [
    ("clip_by_global_norm", "HYBRID_SHARD", (2, 4)),
    ("apply_if_finite", "FULL_SHARD", (1, 8)),
    ("lamb", "HYBRID_SHARD", (2, 4)),
    ("lars", "SHARD_OPT", (2, 4)),
    ("adafactor", "FULL_SHARD", (1, 8)),
    ("adafactor", "HYBRID_SHARD", (2, 4)),
    ("muon", "FULL_SHARD", (1, 8)),
    ("muon", "HYBRID_SHARD", (2, 4)),
    ("multi_steps", "SHARD_GRAD_OP", (1, 8)),
    ("multi_transform", "NO_SHARD", (2, 4)),
    ("add_noise", "SHARD_OPT", (2, 4)),
    ("masked_schedule", "HYBRID_SHARD_ZERO2", (2, 4)),
]
# Cases whose chain starts with clip_by_global_norm(0.05) on each step's gradient: the test
# checks that clipping is active there (the reference's raw gradient norms exceed 0.05).
CLIPPED = ("clip_by_global_norm", "apply_if_finite", "masked_schedule")


def batches(name):
    data = mlp_batches(STEPS)
    if name == "apply_if_finite":  # one poisoned step: skipped by both optimizers
        x, y = data[3]
        data[3] = (np.full_like(x, np.nan), y)
    return data


@functools.cache
def _reference(name):
    """One device's run of ``TXS[name]``, once for the cases that share the optimizer."""
    return reference_run(net, TXS[name](), mse_loss, batches(name))


@functools.cache
def _run(name, strategy, mesh):
    """zshard's run of ``TXS[name]`` on ``strategy`` and ``mesh`` (one eager model), once for the tests that read it."""
    return zshard_run(built(net), TXS[name](), zshard.make_mesh(*mesh), strategy, mse_loss, batches(name))


@pytest.mark.parametrize("name,strategy,mesh", CASES, ids=[f"{n}-{s}-{m[0]}x{m[1]}" for n, s, m in CASES])
def test_optimizer_matches_single_device(name, strategy, mesh):
    want = _reference(name)
    got = _run(name, strategy, mesh)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)  # NaN where the reference has NaN
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
    if name in CLIPPED:  # every finite raw gradient norm exceeds 0.05: clip_by_global_norm(0.05) clips each step
        assert min(g for g in want.grad_norms if np.isfinite(g)) > 0.05, want.grad_norms
    for path, ref in want.params.items():
        assert got.params[path].shape == ref.shape, path
        assert np.all(np.isfinite(got.params[path])), path
        assert rel_l2(got.params[path], ref) <= 1e-5, (path, rel_l2(got.params[path], ref))


@pytest.mark.parametrize("name", sorted(TXS))
def test_each_case_leaves_the_elementwise_path(name):
    state = zshard.init(net, TXS[name](), zshard.make_mesh(1, 8), abstract=True)
    assert state.plan.opt_view is not None


@pytest.mark.parametrize("strategy,mesh", [
    ("SHARD_OPT", (2, 4)),  # the run of the case add_noise-SHARD_OPT-2x4: its optimizer slices are 1/8, over replica x shard
    # the same optimizer path on the same 8-way slices (FULL_SHARD's optimizer axes are shard's 8 devices):
    # its own compile of another step program, -m exhaustive
    pytest.param("FULL_SHARD", (1, 8), marks=pytest.mark.exhaustive),
], ids=["SHARD_OPT-2x4", "FULL_SHARD-1x8"])
def test_add_noise_is_the_single_device_noise_and_reproducible(strategy, mesh):
    """add_noise draws each element's noise from the counter of its logical index (threefry,
    partitionable): the same numbers as the single-device run, so independent per element
    and per device, and reproducible for a key; another key gives other numbers. The key-7 single-device
    run is ``_reference("add_noise")``, the one the case add_noise-SHARD_OPT-2x4 compares with."""
    data = batches("add_noise")
    got = _run("add_noise", strategy, mesh)
    want = _reference("add_noise")
    other = reference_run(net, optax.chain(optax.add_noise(1.0, 0.55, key=8), optax.sgd(1e-2)), mse_loss, data)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    for p, ref in want.params.items():
        assert rel_l2(got.params[p], ref) <= 1e-5, p
    kernel = ("blocks", "lin", "kernel")
    assert rel_l2(other.params[kernel], want.params[kernel]) > 1e-3


def test_clip_norm_of_the_step_equals_the_chain_form():
    # the chain form: the case clip_by_global_norm-HYBRID_SHARD-2x4's run (clip_by_global_norm(0.05), adamw(1e-2))
    data = batches("clip_by_global_norm")
    chain = _run("clip_by_global_norm", "HYBRID_SHARD", (2, 4))
    state = zshard.init(built(net), optax.adamw(1e-2), zshard.make_mesh(2, 4), strategy="HYBRID_SHARD")
    step = zshard.make_train_step(mse_loss, clip_norm=0.05)
    for b in data:
        state, _ = step(state, b)
    got = zshard.unshard(state)
    flat = {p: np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(got, nnx.Param).to_pure_dict())}
    for path, ref in jax.tree_util.tree_leaves_with_path(nnx.state(chain.model, nnx.Param).to_pure_dict()):
        assert rel_l2(flat[path], ref) <= 1e-5, path


# ---- what the compiled step holds ------------------------------------------------------


def _collectives(tx, strategy="FULL_SHARD", mesh=(1, 8)):
    make = lambda: ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))  # noqa: E731
    state = zshard.init(make, tx, zshard.make_mesh(*mesh), strategy=strategy, abstract=True)  # compiled only
    hlo = zshard.make_train_step(mse_loss).lower(state, mlp_batches(1)[0]).compile().as_text()
    return state, parse_collectives(hlo, state.plan.mesh)


def _summary(colls):
    out = {}
    for c in colls:
        k = (c.kind, c.axis)
        out[k] = out.get(k, 0) + c.buffer_bytes * c.trips
    return out


@pytest.mark.parametrize("strategy,mesh", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4))])
def test_elementwise_chain_adds_no_collective_and_a_global_norm_adds_one_scalar(strategy, mesh):
    _, sgd = _collectives(optax.sgd(0.1), strategy, mesh)
    elementwise = optax.chain(optax.clip(0.5), optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
    state, chain = _collectives(elementwise, strategy, mesh)
    assert state.plan.opt_view is None  # today's path: Optax on the local slices
    assert sorted((c.kind, c.axis, c.buffer_bytes) for c in chain) == sorted((c.kind, c.axis, c.buffer_bytes) for c in sgd)
    state, clipped = _collectives(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), strategy, mesh)
    assert state.plan.opt_view is not None
    want = _summary(sgd)
    axis = "shard"  # the optimizer axes: (replica, shard) with replica 1, or shard
    want[("all-reduce", axis)] = want.get(("all-reduce", axis), 0) + 4  # one f32 scalar (XLA may combine it)
    assert _summary(clipped) == want


def test_muon_gathers_each_matrix_once_and_the_report_counts_it():
    state, colls = _collectives(optax.contrib.muon(1e-3))
    opt = [c for c in colls if c.phase == "optimizer"]
    matrices = [s for u in state.plan.units for s in u.slots if len(s.shape) == 2]
    assert sorted(c.buffer_bytes for c in opt if c.kind == "all-gather") == sorted(4 * s.padded for s in matrices)
    rep = optimizer_report(state)
    assert rep["path"] == "global view (scale_by_muon)"
    assert rep["collectives"] == [{"kind": "all-gather", "axis": "shard", "count": len(matrices), "bytes": rep["formula"]}]
    assert rep["measured"] == rep["formula"] == sum(4 * s.padded * 7 / 8 for s in matrices)


def _peak(tx, blocks, d=96):
    make = lambda: ResMLP(16, d, 8, n_blocks=blocks, rngs=nnx.Rngs(0))  # noqa: E731
    state = zshard.init(make, tx, zshard.make_mesh(1, 8), abstract=True)  # compiled only
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((16, 16)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32))
    ma = zshard.make_train_step(mse_loss).lower(state, batch).compile().memory_analysis()
    return ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes


def test_muon_peak_is_adamw_plus_one_matrix_update_not_the_model():
    """Per-device peak of a Muon step minus AdamW's: at most what one whole-matrix Muon update
    needs on one device (Newton-Schulz temporaries, compiled alone) plus the gathered matrix,
    and it does not grow with the number of matrices."""
    d = 96
    matrix = d * d * 4
    tx = optax.contrib.muon(1e-3)
    one = {"w": jax.ShapeDtypeStruct((d, d), jnp.float32)}
    single = jax.jit(tx.update).lower(one, jax.eval_shape(tx.init, one), one).compile().memory_analysis().temp_size_in_bytes
    # 2 and 4 blocks (it was 3 and 6: two blocks more per program compiled, four compiles): a step that held every
    # gathered matrix at once would grow by a matrix per block, 2 matrices from 2 to 4 blocks, more than the one allowed
    extra = {n: _peak(optax.contrib.muon(1e-3), n) - _peak(optax.adamw(1e-3), n) for n in (2, 4)}
    assert extra[2] <= single + matrix, (extra, single)
    assert extra[4] <= extra[2] + matrix, extra  # 2 more 96x96 matrices: no more than one matrix more


# ---- refused before compiling -------------------------------------------------------------


def test_a_side_effecting_transformation_is_refused_by_name():
    def log_norm():
        def update(updates, state, params=None):
            jax.debug.callback(lambda n: None, optax.global_norm(updates))
            return updates, state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    with pytest.raises(ValueError, match=r"optax transformation .* has side effects .*remove it"):
        zshard.init(net, optax.chain(log_norm(), optax.adam(1e-3)), zshard.make_mesh(1, 8), abstract=True)


def test_grad_norm_square_is_not_shared_with_adams_and_materialised():
    """The step's gradient-norm metric (``zshard.optim.optim.global_norm``) squares every gradient
    shard, and so does Adam's second moment; XLA's CSE merged the two squares and materialised
    the shared one whole (Llama-70B HYBRID_SHARD 8x8: two ``[80, n_pad/8]`` squares, 28.19 GB;
    the scale table's peak fell 160.41 -> 150.80 GB with the barrier, docs/memory.md). Here one
    AdamW update and the norm of a stacked ``[80, 2**14]`` gradient, compiled together: the old
    form holds the square (5 MiB of temp), ``global_norm`` holds none of it."""
    from zshard.optim.optim import global_norm  # noqa: PLC0415

    g = jax.ShapeDtypeStruct((80, 1 << 14), jnp.float32)
    square = 4 * 80 * (1 << 14)
    tx = optax.adamw(1e-4)

    one_device = types.SimpleNamespace(tensor=1, grad_axes=())  # the two fields global_norm reads off a Plan

    def old_norm(grads, plan):
        return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(grads)))

    def temp(norm):
        def step(p, grad, s):
            u, s = tx.update(grad, s, p)
            return optax.apply_updates(p, u), s, norm({"w": grad}, one_device)

        compiled = jax.jit(step, donate_argnums=(0, 2)).lower(g, g, jax.eval_shape(tx.init, g)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(old_norm) >= square  # the check can fail: the shared square is materialised without the barrier
    assert temp(global_norm) < square // 100
