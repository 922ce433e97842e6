"""Two models written as public model zoos write them, trained on every strategy.

- ``TinyLlama``: RMSNorm, causal attention, SwiGLU, dropout with the module's own RNG
  stream; its blocks are built stacked with ``nnx.vmap`` and run by the model's own
  ``nnx.scan`` with ``nnx.remat`` around each block.
- ``TinyResNet``: convolutions with BatchNorm (local statistics, as in DDP without
  SyncBatchNorm) in residual blocks held by an ``nnx.List``.

Reference: :func:`test_model_state.dp_reference`, the data-parallel step emulated device by
device on one device (device ``d`` draws dropout from ``fold_in(key, d)``; BatchNorm
statistics averaged over devices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPEATED_MODEL_PATH, built
from flax import nnx
from test_model_state import assert_close, dp_reference, run

import zshard

# By default each model on the strategies whose forward and backward differ: NO_SHARD (nothing gathered),
# SHARD_GRAD_OP 4x2 (gathered once, kept through backward), FULL_SHARD 1x8 (gathered again in backward)
# and HYBRID_SHARD 2x4 (gathered over shard, the gradient shard all-reduced over replica); the other two
# (conftest.REPEATED_MODEL_PATH) -m exhaustive.
STRATEGIES = [
    pytest.param(strategy, shape, id=strategy, marks=pytest.mark.exhaustive if strategy in REPEATED_MODEL_PATH else ())
    for strategy, shape in [("NO_SHARD", (2, 4)), ("SHARD_OPT", (1, 8)), ("SHARD_GRAD_OP", (4, 2)), ("FULL_SHARD", (1, 8)),
                            ("HYBRID_SHARD", (2, 4)), ("HYBRID_SHARD_ZERO2", (2, 4))]
]

V, D, H, L, T = 32, 16, 2, 3, 8


class LlamaBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(D, rngs=rngs)
        self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * H, D // H), 3, axis=2)
        mask = jnp.tril(jnp.ones((t, t), bool))
        x = x + self.drop(self.out(jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(b, t, D)))
        h = self.mlp_norm(x)
        return x + self.drop(self.down(jax.nn.silu(self.gate(h)) * self.up(h)))


class TinyLlama(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def layers(rngs):
            return LlamaBlock(rngs=rngs)

        self.layers = layers(rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_layers(x, block):
            return nnx.remat(lambda blk, h: blk(h))(block, x)

        return self.head(self.norm(run_layers(self.embed(tokens), self.layers)))


def lm_loss(model, batch):
    tokens, targets = batch
    logp = jax.nn.log_softmax(model(tokens))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


class ResNetBlock(nnx.Module):
    def __init__(self, c: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(c, rngs=rngs)
        self.conv2 = nnx.Conv(c, c, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(c, rngs=rngs)

    def __call__(self, x):
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        return jax.nn.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.blocks = nnx.List([ResNetBlock(8, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def image_loss(model, batch):
    images, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


def llama_batches(n):
    rng = np.random.default_rng(0)
    tok = [rng.integers(0, V, (16, T + 1), dtype=np.int32) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tok]


def image_batches(n):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((16, 6, 6, 3)).astype(np.float32), rng.integers(0, 5, (16,), dtype=np.int32)) for _ in range(n)]


def make_llama():
    return TinyLlama(rngs=nnx.Rngs(0, dropout=7))


def make_resnet():
    return TinyResNet(rngs=nnx.Rngs(0))


@functools.cache
def llama_reference():
    """``(losses, model)`` of :func:`dp_reference` on 8 emulated devices; computed once per
    module (read-only: the tests compare against it), not once per strategy."""
    return dp_reference(make_llama, optax.adamw(3e-3), lm_loss, llama_batches(2), 8)


@functools.cache
def resnet_reference():
    """As :func:`llama_reference`, for the ResNet."""
    return dp_reference(make_resnet, optax.sgd(0.05, momentum=0.9), image_loss, image_batches(2), 8)


@pytest.mark.parametrize("strategy,shape", STRATEGIES)
def test_llama_style_model_with_its_own_scan_remat_and_dropout(strategy, shape):
    tx = optax.adamw(3e-3)
    plan = zshard.init(make_llama, tx, zshard.make_mesh(*shape), strategy=strategy, abstract=True).plan
    assert any(u.layers == L for u in plan.units)  # the stacked blocks are one unit, gathered per layer
    losses, state = run(built(make_llama), tx, lm_loss, llama_batches(2), strategy, shape)
    ref_losses, ref_model = llama_reference()
    assert_close(losses, ref_losses, zshard.unshard(state), ref_model)


@pytest.mark.parametrize("strategy,shape", STRATEGIES)
def test_resnet_style_model_with_batchnorm(strategy, shape):
    losses, state = run(built(make_resnet), optax.sgd(0.05, momentum=0.9), image_loss, image_batches(2), strategy, shape)
    ref_losses, ref_model = resnet_reference()
    assert_close(losses, ref_losses, zshard.unshard(state), ref_model)
