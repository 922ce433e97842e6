"""Functions for ``python -m zshard.verify tests.verify_cases:NAME`` (used by tests/test_verify.py).

Each returns ``(model_or_builder, tx, loss_fn, batch)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train.model import GPT, GPTConfig, cross_entropy_loss

CFG = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2)


def token_batch(batch: int = 8):
    tokens = np.random.default_rng(0).integers(0, 256, size=(batch, CFG.seq_len + 1), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]  # int32 [B, T] each


def gpt():
    """The reference GPT, built under jit by zshard (a callable), AdamW: must pass."""
    return (lambda: GPT(CFG, rngs=nnx.Rngs(0))), optax.adamw(1e-3), cross_entropy_loss, token_batch()


def batch_centered_loss(model, batch):
    """Cross-entropy of logits centred by their mean over the batch: a whole-batch statistic."""
    inputs, targets = batch
    logits = model(inputs).astype(jnp.float32)  # [B, T, V]
    logits = logits - logits.mean(axis=0, keepdims=True)  # under zshard: the mean of this device's slice only
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def gpt_batch_statistic():
    """The same GPT (a built module) with a loss that reads a global batch statistic: must fail."""
    return GPT(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-3), batch_centered_loss, token_batch()
