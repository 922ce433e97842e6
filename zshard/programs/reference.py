"""The single-device reference every sharded result is compared with: one plain
``nnx.Optimizer`` step, jitted (``python -m zshard.verify``'s runs and the test suite's,
tests/conftest.py). No mesh, no collective.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import optax
from flax import nnx, traverse_util

from zshard.programs.step import TokenMean

__all__ = ["mean_loss", "reference_step"]


def reference_step(loss_fn: Callable) -> Callable:
    """The single-device reference every sharded result is compared with (this module's runs and
    the test suite's, tests/conftest.py): one plain ``nnx.Optimizer`` step, jitted.

    Returns:
      ``step(model, opt, batch) -> (loss, grad_norm, rms)``, updating ``model`` and ``opt`` in
      place: the scalar mean loss (``loss_fn``'s, a ``TokenMean`` divided out), the gradient's
      global L2 norm (``optax.tree.norm``) and, per parameter path (a tuple), its gradient's RMS
      per element over the whole gradient's (fp32; :data:`zshard.verify.NO_SIGNAL`).
    """
    loss_of = mean_loss(loss_fn)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_of)(model, batch)
        opt.update(model, grads)
        flat = traverse_util.flatten_dict(nnx.to_pure_dict(grads))
        sq = {p: jnp.sum(jnp.square(g.astype(jnp.float32))) for p, g in flat.items()}
        total = jnp.sqrt(sum(sq.values()) / sum(g.size for g in flat.values()))  # whole gradient, RMS per element
        return loss, optax.tree.norm(grads), {p: jnp.sqrt(s / flat[p].size) / total for p, s in sq.items()}

    return step


def mean_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` as a scalar mean: ``TokenMean(sum, count)`` -> ``sum / count``."""

    def loss(model, batch):
        out = loss_fn(model, batch)
        if isinstance(out, TokenMean):
            return out.total / out.count
        return out

    return loss
