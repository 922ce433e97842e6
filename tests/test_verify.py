"""``python -m zshard.verify``: passes on the reference GPT, reports the mismatch of a loss that
reads a whole-batch statistic, refuses bad input with status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zshard
from verify_cases import CFG, token_batch
from zshard.verify import FLOOR_FACTOR, NO_SIGNAL, TOLERANCE, VerifyResult, load_function, main, verify

ROOT = Path(__file__).resolve().parent.parent


def test_reference_gpt_passes_from_the_command_line():
    """The real entry point in a fresh process (it sets up its own 2x4 = 8 CPU devices)."""
    res = subprocess.run([sys.executable, "-m", "zshard.verify", "tests.verify_cases:gpt", "--strategy", "HYBRID_SHARD",
                          "--mesh", "2x4", "--steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "HYBRID_SHARD on 2x4" in res.stdout and "float32: tolerance 1e-05" in res.stdout
    assert res.stdout.rstrip().endswith("PASS") and "MISMATCH" not in res.stdout


def test_whole_batch_statistic_is_reported_as_a_mismatch(capsys):
    assert main(["tests.verify_cases:gpt_batch_statistic", "--strategy", "FULL_SHARD", "--mesh", "1x8", "--steps", "2"]) == 1
    text = capsys.readouterr().out
    assert "largest loss difference:" in text and "MISMATCH" in text and "FAIL" in text


def test_result_numbers():
    from train.model import GPT, cross_entropy_loss

    # a built module (copied, not compiled); the builder path: test_a_built_module_with_rng_state_works_like_a_builder
    good = verify(GPT(CFG, rngs=nnx.Rngs(0)), optax.sgd(0.1), cross_entropy_loss, token_batch(),
                  strategy="SHARD_GRAD_OP", mesh=zshard.make_mesh(4, 2), steps=2)
    assert good.passed and good.dtype == "float32" and good.tolerance == TOLERANCE["float32"] == 1e-5
    assert len(good.losses) == 2 and good.max_loss_diff <= 1e-5 and good.worst_param[1] <= 1e-5
    assert set(good.param_diffs) == set(good.initial_diffs) and max(good.initial_diffs.values()) <= 1e-6
    assert good.losses[1][1] < good.losses[0][1]  # the reference trains


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("no_colon", "expected MODULE:FUNCTION"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz': ModuleNotFoundError"),
        ("tests.verify_cases:nothing", "has no function 'nothing'; callables there:"),
        (f"{ROOT / 'tests' / 'verify_cases.py'}:gpt_missing", "has no function 'gpt_missing'"),
        ("tests.verify_cases:batch_centered_loss", "batch_centered_loss"),  # called with no arguments: TypeError
        ("tests.verify_cases:token_batch", "expected the 4-tuple (model_or_builder, tx, loss_fn, batch)"),
    ],
)
def test_bad_input_exits_2(spec, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main([spec, "--mesh", "1x8", "--steps", "1"])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_bad_mesh_and_strategy_exit_2(capsys):
    for argv, needle in ((["--mesh", "4x4"], "needs 16 devices"), (["--strategy", "ZERO9"], "unknown strategy 'ZERO9'"),
                         (["--steps", "0"], "--steps 0")):
        with pytest.raises(SystemExit) as e:
            main(["tests.verify_cases:gpt", *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_load_function_from_a_file():
    fn = load_function(str(ROOT / "tests" / "verify_cases.py") + ":gpt")
    assert len(fn()) == 4


class _Shifted(nnx.Module):
    """Logits plus one shared shift: softmax cross-entropy ignores it, so its true gradient is
    zero (as an attention key bias's); the computed one is rounding noise."""

    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 5, rngs=rngs)
        self.shift = nnx.Param(jnp.zeros((1,)))

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.head(x) + self.shift[...]


def _shifted_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_a_parameter_without_gradient_signal_is_judged_on_its_own_scale():
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 5, 16).astype(np.int32))
    res = verify(_Shifted(nnx.Rngs(0)), optax.adam(1e-2), _shifted_loss, batch,
                 strategy="FULL_SHARD", mesh=zshard.make_mesh(1, 8), steps=3)
    assert res.no_signal == ("shift",), res.no_signal  # every other parameter has a real gradient
    assert res.passed, res.table()
    assert "no gradient signal (reference gradient at rounding level" in res.table() and "shift" in res.table()
    assert res.probe_signal["shift"] <= FLOOR_FACTOR * NO_SIGNAL and res.param_diffs["shift"] <= res.no_signal_limit("shift")


class _DropoutMLP(nnx.Module):
    """A residual MLP holding RNG state: ``nnx.Dropout`` keeps its own ``nnx.Rngs`` (a key and a
    ``uint32[]`` count), carried by zshard as replicated variables. Rate 0: no mask is drawn."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(6, 16, rngs=rngs)
        self.fc = nnx.Linear(16, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.0, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        return self.out(h + self.drop(nnx.gelu(self.fc(h))))


def test_a_built_module_with_rng_state_works_like_a_builder():
    """A built module (not a builder): the sharded step donates its state, which once deleted the
    module's own RNG arrays that the single-device reference then read (``RuntimeError: Array has
    been deleted with shape=uint32[]``). Both runs now get copies; the user's module is untouched."""
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(16, 6)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32))
    model = _DropoutMLP(nnx.Rngs(0))
    before = {p: np.array(v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    built = verify(model, optax.adam(1e-2), _shifted_loss, batch, strategy="FULL_SHARD", mesh=zshard.make_mesh(2, 4), steps=2)
    assert built.passed, built.table()
    builder = verify(lambda: _DropoutMLP(nnx.Rngs(0)), optax.adam(1e-2), _shifted_loss, batch, strategy="FULL_SHARD",
                     mesh=zshard.make_mesh(2, 4), steps=2)
    # A builder's parameters are initialised under jit, a built module's eagerly: XLA may round
    # the two by an ulp apart (it does at the suite's --xla_backend_optimization_level=0), so the
    # two runs agree to rounding, not bit for bit; the reference is the same eager model in both.
    assert [b for _, b in built.losses] == [b for _, b in builder.losses]
    np.testing.assert_allclose(built.losses, builder.losses, rtol=1e-6)
    assert builder.passed and built.param_diffs.keys() == builder.param_diffs.keys()
    for path, var in nnx.to_flat_state(nnx.state(model)):  # nothing deleted, parameters unchanged
        value = var.get_raw_value()
        assert not value.is_deleted(), path
        if path in before:
            np.testing.assert_array_equal(np.asarray(value), before[path])
    assert int(model.drop.rngs.count[...]) == 0


def test_init_does_not_alias_a_built_modules_rng_state():
    """``zshard.init(module)`` copies the module's non-parameter variables: a train step, which
    donates its state, leaves the module's RNG key and count alive."""
    model = _DropoutMLP(nnx.Rngs(0))
    state = zshard.init(model, optax.sgd(0.1), zshard.make_mesh(1, 8))
    zshard.make_train_step(_shifted_loss)(state, (np.ones((8, 6), np.float32), np.zeros(8, np.int32)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        assert not var.get_raw_value().is_deleted(), path


class _TinyBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.0, rngs=rngs)  # rate 0, as in the report: RNG state, no mask

    def __call__(self, x, mask):
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.fc2(nnx.gelu(self.fc1(self.ln2(x)))))


class _TinyTransformer(nnx.Module):
    """A plain pre-LN causal transformer: embedding, learned positions, 2 blocks, an untied head."""

    def __init__(self, vocab=50, d=32, T=12, *, rngs):
        self.emb = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jnp.zeros((T, d)))
        self.blocks = nnx.List([_TinyBlock(d, rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.emb(tokens) + self.pos[...][: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def _token_loss(model, batch):
    inputs, targets = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()


def test_adam_rounding_on_a_tiny_transformer_passes():
    """A user's report: a plain transformer with chain(clip_by_global_norm, adamw) failed on a bias
    (losses within 4e-7, fc1/bias 6.8e-5 > 1e-5). Adam's first steps are ~lr * sign(g), so a
    parameter whose gradient is near zero turns fp32 rounding of the gradient's sum into
    differences far above 1e-5 on any other summation order. The reference against its own
    twin from initial parameters 1 ulp apart measures that floor; zshard stays within it."""
    tokens = np.random.default_rng(0).integers(0, 50, size=(16, 13), dtype=np.int32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))
    # a built module: copied to the shards (no initialiser compiled, twice with the probe of the two key biases
    # without gradient signal); the builder path: test_a_built_module_with_rng_state_works_like_a_builder
    res = verify(_TinyTransformer(rngs=nnx.Rngs(0)), tx, _token_loss, (tokens[:, :-1], tokens[:, 1:]),
                 strategy="HYBRID_SHARD", mesh=zshard.make_mesh(2, 4), steps=4)
    assert res.passed, res.table()
    path, diff = res.worst_param
    assert diff > res.tolerance, res.table()  # the old fixed 1e-5 would have failed this run
    assert diff <= res.param_limit == FLOOR_FACTOR * res.param_floor[1], res.table()
    assert res.max_loss_diff <= 1e-6 and res.worst_initial[1] <= 1e-6
    assert "rounding floor" in res.table() and res.table().endswith("PASS")


def test_per_device_dropout_still_fails_and_names_the_rng_state():
    """Dropout draws its mask on each device's slice, not the single-device run's: a real
    difference, far above the rounding floor (the twin draws the same masks as the reference)."""
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(16, 6)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32))
    model = _DropoutMLP(nnx.Rngs(0))
    model.drop.rate = 0.5
    res = verify(model, optax.adam(1e-2), _shifted_loss, batch, strategy="FULL_SHARD", mesh=zshard.make_mesh(1, 8), steps=2)
    assert not res.passed
    assert res.loss_floor <= 1e-6 and res.loss_diffs[0] > 100 * res.loss_limit, res.table()
    assert res.rng_state == ("drop/rngs/count", "drop/rngs/key"), res.rng_state
    text = res.table()
    assert "FAIL" in text and "step-1 loss differs already" in text and "drop/rngs/count" in text
    assert "dropout masks" in text and "whole-batch statistics" in text


def _result(**kw):
    base = dict(strategy="FULL_SHARD", mesh=(1, 8), dtype="float32", tolerance=1e-5, losses=[(1.0, 1.0), (0.9, 0.9)],
                loss_diffs=[1e-7, 2e-7], param_diffs={"a": 1e-6, "b": 3e-6}, initial_diffs={"a": 0.0, "b": 0.0},
                floor_losses=[1e-7, 3e-7], floor_params={"a": 2e-6, "b": 5e-6})
    return VerifyResult(**{**base, **kw})


def test_limits_and_causes_follow_what_was_measured():
    """Built by hand (nothing compiled): limit = max(tolerance, FLOOR_FACTOR x the twin's floor),
    and each failure names what differs."""
    assert _result().passed and _result().causes() == []
    assert _result().param_limit == 2e-5 and _result().loss_limit == 1e-5  # max(1e-5, 4 x 5e-6), max(1e-5, 4 x 3e-7)
    assert _result(param_diffs={"a": 1e-6, "b": 1.5e-5}).passed  # above the tolerance, within 4x the floor
    only_params = _result(param_diffs={"a": 1e-6, "b": 3e-5})
    assert not only_params.passed and len(only_params.causes()) == 1
    assert "only parameters differ (3.0e-05 at b, 6x the rounding floor 5.0e-06 at b)" in only_params.causes()[0]
    assert "losses agree to 2.0e-07" in only_params.causes()[0] and "MISMATCH" in only_params.table()
    later = _result(loss_diffs=[1e-7, 1e-3], param_diffs={"a": 1e-6, "b": 1e-2})
    assert later.causes()[0].startswith("the losses agree at step 1 and differ from step 2 (1.0e-03)")
    assert "whole-batch statistics" in later.causes()[0] and len(later.causes()) == 1
    first = _result(loss_diffs=[1e-3, 1e-3])
    assert "step-1 loss differs already" in first.causes()[0] and "dropout" not in first.causes()[0]  # no RNG state
    initial = _result(initial_diffs={"a": 1e-4, "b": 0.0})
    assert not initial.passed and initial.causes()[0].startswith("the initial parameters differ (1.0e-04 at a)")
    no_twin = _result(floor_losses=[], floor_params={}, param_diffs={"a": 1e-6, "b": 1.5e-5})
    assert no_twin.param_limit == 1e-5 and not no_twin.passed
    nan = _result(param_diffs={"a": float("nan"), "b": 0.0})
    assert not nan.passed and nan.worst_param[0] == "a"


def test_a_wrong_update_of_a_parameter_without_gradient_signal_fails():
    """Built by hand (nothing compiled). A parameter whose reference gradient is rounding noise was
    "not judged" (any final value passed); now it passes only within FLOOR_FACTOR x the larger of
    the twin's difference and the reference's own movement there, and only if zshard's own gradient
    there is at rounding level too."""
    base = dict(no_signal=("s",), param_diffs={"a": 1e-6, "b": 3e-6, "s": 0.9}, floor_params={"a": 2e-6, "b": 5e-6, "s": 0.6},
                moved={"a": 1e-2, "b": 1e-2, "s": 1.0})
    noise = _result(**base)  # Adam's lr-sized rounding steps: 0.9 of a parameter that moved 1.0 of its norm
    assert noise.passed and noise.no_signal_limit("s") == FLOOR_FACTOR * 1.0, noise.table()
    assert "s 9.0e-01 (limit 4.0e+00; gradient 0.0e+00) ok" in noise.table()
    sgd = _result(**{**base, "param_diffs": {"a": 1e-6, "b": 3e-6, "s": 0.5}, "floor_params": {"a": 2e-6, "b": 5e-6, "s": 1e-7},
                     "moved": {"a": 1e-2, "b": 1e-2, "s": 1e-6}})  # the reference barely moved it; zshard moved it far
    assert not sgd.passed and sgd.worst_no_signal[0] == "s", sgd.table()
    assert "parameter s has no gradient signal in the reference" in sgd.causes()[0] and "MISMATCH" in sgd.table()
    grad = _result(**base, probe_signal={"s": 3e-2})  # within its value limit, but zshard gives it a real gradient
    assert not grad.passed and "zshard's gradient there is 3.0e-02" in grad.causes()[0], grad.table()
    assert _result(**base, probe_signal={"s": 1e-7}).passed
