"""find_units: the wrap policy -> module paths of the block units."""

import functools
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ResBlock, ResMLP
import zshard
from zshard.params.units import UnitWarning, find_units, path_str


class Inner(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


class Outer(nnx.Module):
    def __init__(self, rngs):
        self.inner = Inner(rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.inner(self.norm(x))


class Nested(nnx.Module):
    """Outer blocks that contain Inner modules, and one Inner outside any Outer."""

    def __init__(self, rngs):
        self.stem = Inner(rngs)
        self.layers = nnx.List([Outer(rngs) for _ in range(3)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class NotInModel(nnx.Module):
    pass


@pytest.fixture(scope="module")
def mlp():
    return ResMLP(n_blocks=4, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def nested():
    return Nested(nnx.Rngs(0))


def test_default_finds_list_elements(mlp):
    assert find_units(mlp) == [("blocks", i) for i in range(4)]


def test_default_on_gpt():
    from train.model import GPT, GPTConfig

    model = nnx.eval_shape(lambda: GPT(GPTConfig(seq_len=16, d_model=32, n_layers=3, n_heads=2), rngs=nnx.Rngs(0)))
    assert find_units(model) == [("blocks", i) for i in range(3)]


def test_default_nested_lists(nested):
    assert find_units(nested) == [("layers", i) for i in range(3)]


def test_unit_class(mlp):
    assert find_units(mlp, ResBlock) == [("blocks", i) for i in range(4)]


def test_unit_linear_class_finds_every_linear(mlp):
    got = find_units(mlp, nnx.Linear)
    expected = {("inp",), ("head",)} | {("blocks", i, "lin") for i in range(4)}
    assert set(got) == expected and len(got) == len(expected)


def test_unit_tuple_of_classes(nested):
    got = find_units(nested, (Inner, nnx.LayerNorm))
    expected = {("stem",)} | {("layers", i, "inner") for i in range(3)} | {("layers", i, "norm") for i in range(3)}
    assert set(got) == expected and len(got) == len(expected)


def test_nested_matches_keep_outermost(nested):
    # Inner occurs inside every Outer: only the Outer (and the stem Inner outside) remain
    got = find_units(nested, (Outer, Inner))
    assert set(got) == {("stem",)} | {("layers", i) for i in range(3)}
    assert len(got) == 4
    # same for the Linear inside ResBlock
    mlp = ResMLP(n_blocks=2, rngs=nnx.Rngs(0))
    assert set(find_units(mlp, (ResBlock, nnx.Linear))) == {("inp",), ("head",), ("blocks", 0), ("blocks", 1)}


def test_missing_class_names_present_classes(mlp):
    with pytest.raises(ValueError) as e:
        find_units(mlp, NotInModel)
    msg = str(e.value)
    assert "NotInModel" in msg
    for present in ("Linear", "ResBlock"):
        assert present in msg


def test_missing_class_in_tuple(nested):
    with pytest.raises(ValueError) as e:
        find_units(nested, (NotInModel,))
    msg = str(e.value)
    assert "NotInModel" in msg and "Outer" in msg and "Inner" in msg


@pytest.mark.parametrize("bad", ["Block", 3.5, 0, True, (ResBlock, "x"), ()])
def test_bad_policy_type(mlp, bad):
    with pytest.raises(ValueError):
        find_units(mlp, bad)


def test_path_str():
    assert path_str(()) == "root"
    assert path_str(("blocks", 0, "attn")) == "blocks.0.attn"


def test_callable_policy(mlp):
    lins = [("blocks", i, "lin") for i in range(len(mlp.blocks))]
    assert find_units(mlp, lambda path, m: isinstance(m, nnx.Linear) and path[0] == "blocks") == lins
    with pytest.raises(ValueError, match="selected no submodule"):
        find_units(mlp, lambda path, m: False)
    with pytest.raises(ValueError, match="overlapping units 'blocks.0' and 'blocks.0.lin'"):
        find_units(mlp, lambda path, m: path[:1] == ("blocks",) and len(path) >= 2)


def test_size_based_policy(mlp):
    # ResMLP 13 -> 19 -> 3: inp 266, blocks.i.lin 380 each, head 60 parameters
    lins = [("blocks", i, "lin") for i in range(len(mlp.blocks))]
    assert find_units(mlp, 300) == lins
    assert find_units(mlp, 60) == [*lins, ("head",), ("inp",)]  # graph order
    with pytest.raises(ValueError, match="the largest holds 380"):
        find_units(mlp, 10_000)


def _mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


@functools.cache
def _sgd_reference():
    """3 SGD steps of the 2-block ``ResMLP`` on one device, computed once: the cases differ only on the zshard side (the unit policy)."""
    import optax
    from conftest import mlp_batches, mse_loss, reference_run

    return reference_run(_mlp, optax.sgd(0.1), mse_loss, mlp_batches(3))


@pytest.mark.parametrize("policy", [None, ResBlock, (ResBlock, nnx.Linear), 60, "callable"], ids=["default", "class", "tuple", "size", "callable"])
def test_every_policy_trains_like_the_reference(policy):
    import optax
    from conftest import mlp_batches, mse_loss, reference_run, zshard_run

    import zshard

    if policy == "callable":
        policy = lambda path, m: isinstance(m, nnx.Linear)  # noqa: E731
    make = _mlp
    data = mlp_batches(3)
    want = _sgd_reference()
    for strategy, mesh in (("FULL_SHARD", (1, 8)), ("HYBRID_SHARD", (2, 4))):
        got = zshard_run(make, optax.sgd(0.1), zshard.make_mesh(*mesh), strategy, mse_loss, data, unit=policy)
        np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
        for path, ref in want.params.items():
            np.testing.assert_allclose(got.params[path], ref, rtol=1e-5, atol=1e-6, err_msg=str(path))


# --- the default policy leaving blocks in the root unit: warned once, naming unit= / nnx.List -------------------


class Down(nnx.Module):
    def __init__(self, d_in, d_out, rngs):
        self.conv = nnx.Conv(d_in, d_out, (3, 3), rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.conv(x))


class Up(nnx.Module):
    def __init__(self, d_in, d_out, rngs):
        self.conv = nnx.ConvTranspose(d_in, d_out, (3, 3), rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.conv(x))


class TinyUNet(nnx.Module):
    """Every stage a different class or width: no repeated blocks for the default policy."""

    def __init__(self, rngs):
        self.down = Down(3, 8, rngs)
        self.mid = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.up = Up(16, 3, rngs)

    def __call__(self, x):
        h = self.down(x)
        return self.up(jnp.concatenate([h, self.mid(h)], -1))


class Attributes(nnx.Module):
    """Two blocks of one class as separate attributes, not in an nnx.List."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(13, 19, rngs=rngs)
        self.block0, self.block1 = ResBlock(19, rngs=rngs), ResBlock(19, rngs=rngs)
        self.head = nnx.Linear(19, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block1(self.block0(self.inp(x))))


def _init_warnings(model_cls):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        state = zshard.init(lambda: model_cls(nnx.Rngs(0)), optax.adam(1e-3), zshard.make_mesh(1, 8), abstract=True)
    return state, [str(w.message) for w in got if issubclass(w.category, UnitWarning)]


def test_a_model_without_units_is_warned_once_at_init():
    state, got = _init_warnings(TinyUNet)
    assert [u.path for u in state.plan.units] == [()]  # it still runs: one root unit
    assert len(got) == 1 and "found no units in TinyUNet" in got[0] and "unit=" in got[0], got
    assert _init_warnings(TinyUNet)[1] == []  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model whose blocks are found: nothing to say
        zshard.init(lambda: ResMLP(n_blocks=2, rngs=nnx.Rngs(0)), optax.adam(1e-3), zshard.make_mesh(1, 8), abstract=True)


def test_blocks_kept_as_attributes_are_named_with_the_fix():
    state, got = _init_warnings(Attributes)
    assert len(got) == 1, got
    assert "block0, block1 are 2 modules of class ResBlock kept as separate attributes" in got[0], got[0]
    assert "nnx.List" in got[0] and "unit=ResBlock" in got[0]
    assert find_units(nnx.eval_shape(lambda: Attributes(nnx.Rngs(0))), ResBlock) == [("block0",), ("block1",)]  # the fix it names works
