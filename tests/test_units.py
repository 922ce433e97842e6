"""find_units: the wrap policy -> module paths of the block units."""

import pytest
from flax import nnx

from conftest import ResBlock, ResMLP
from zshard.units import find_units, path_str


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


@pytest.mark.parametrize("bad", ["Block", 3, (ResBlock, "x"), ()])
def test_bad_policy_type(mlp, bad):
    with pytest.raises(ValueError):
        find_units(mlp, bad)


def test_path_str():
    assert path_str(()) == "root"
    assert path_str(("blocks", 0, "attn")) == "blocks.0.attn"
