"""``zshard.make_forward``: a sharded forward with per-row outputs, units gathered just in time
or the whole model gathered once per call."""

import numpy as np
import optax
import pytest
from conftest import ResMLP
from flax import nnx

import zshard
from zshard.report import parse_collectives


def _state(strategy, shape):
    return zshard.init(ResMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), zshard.make_mesh(*shape), strategy=strategy)


X = np.random.default_rng(0).standard_normal((16, 13)).astype(np.float32)


@pytest.mark.parametrize("gather_once", [False, True], ids=["per-unit", "gather-once"])
@pytest.mark.parametrize("strategy,shape", [("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4)), ("NO_SHARD", (2, 4))])
def test_forward_equals_the_plain_model(strategy, shape, gather_once):
    want = np.asarray(ResMLP(rngs=nnx.Rngs(0))(X))
    fwd = zshard.make_forward(lambda model, x, scale: {"y": model(x) * scale}, gather_once=gather_once)
    out = fwd(_state(strategy, shape), X, np.float32(2.0))["y"]
    assert out.shape == (16, 3) and out.sharding.spec[0] == ("replica", "shard")  # rows split over the devices
    np.testing.assert_allclose(np.asarray(out), 2 * want, rtol=1e-6, atol=1e-6)


def test_gather_once_gathers_every_parameter_once_and_per_unit_per_call():
    state = _state("FULL_SHARD", (1, 8))
    n_params = len(state.plan.layouts)
    counts = {}
    for once in (False, True):
        text = zshard.make_forward(lambda m, x: m(x), gather_once=once).lower(state, X).compile().as_text()
        counts[once] = sum(c.trips for c in parse_collectives(text, state.plan.mesh) if c.kind == "all-gather")
    assert counts[True] == n_params, counts  # one all-gather per parameter, nothing per unit call
    assert counts[False] == n_params, counts  # forward only: each unit gathered once, no re-gather


def test_forward_refuses_scalar_outputs_and_uneven_rows():
    state = _state("FULL_SHARD", (1, 8))
    with pytest.raises(TypeError, match="scalar.*make_eval_step"):
        zshard.make_forward(lambda m, x: m(x).sum())(state, X)
    with pytest.raises(ValueError, match=r"args\[0\].*divide by the 8 devices"):
        zshard.make_forward(lambda m, x: m(x))(state, X[:12])
    with pytest.raises(TypeError, match="callable"):
        zshard.make_forward(3)
