"""Fused projections: an ``nnx.LinearGeneral`` with several output axes (``wqkv`` ``[C, nkv,
rep + 2, hs]``, ``w_gate_up`` ``[C, 2, F]``) run with a backward that reads the kernel in place.

Autodiff's input gradient of such a layer is a dot contracting several axes of the kernel as its
right operand; XLA's dot canonicalisation (``DotDecomposer``: a right operand as ``[contracting,
non-contracting]``) then copies the gathered kernel transposed to ``[prod(out), C]``, and XLA:CPU
made that copy right after the re-gather and held it beside the kernel through the recomputed
attention (docs/memory.md, "The scale table": Llama-7B on 64 devices, live / formula 1.067).
Here the input gradient takes the kernel as its *left* operand, ``[C, prod(out)]``, the
canonical order already; the cotangent ``[tokens, prod(out)]`` is transposed instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["fused_projection"]



@jax.custom_vjp
def _fused_dot(x, kernel):
    """``x`` (..., C) . ``kernel`` [C, *out] -> (..., *out), contracting ``C``."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _fused_dot_fwd(x, kernel):
    return _fused_dot(x, kernel), (x, kernel)


def _fused_dot_bwd(res, g):
    x, kernel = res
    lead, out = tuple(range(x.ndim - 1)), tuple(range(1, kernel.ndim))
    # dx with the kernel on the left: (C, *out) is already the [non-contracting, contracting]
    # order XLA's dot canonicalisation wants of a left operand, so the kernel is read in place.
    # On the right (autodiff's order) XLA copies it transposed to [prod(out), C] first.
    dxt = jax.lax.dot_general(kernel, g, ((out, tuple(range(x.ndim - 1, g.ndim))), ((), ())))  # [C, *lead]
    dk = jax.lax.dot_general(x, g, ((lead, lead), ((), ())))  # [C, *out]: the kernel's own order
    return jnp.moveaxis(dxt, 0, -1).astype(x.dtype), dk.astype(kernel.dtype)


_fused_dot.defvjp(_fused_dot_fwd, _fused_dot_bwd)


def fused_projection(layer: nnx.LinearGeneral, x: jax.Array) -> jax.Array:
    """``layer(x)`` for an ``nnx.LinearGeneral`` over the last axis (``kernel`` [C, *out], float,
    any sharding): ``x`` (..., C) -> (..., *out) in the promoted dtype, the same values and
    gradients, with a backward that never copies the kernel transposed (module docstring)."""
    bias = layer.bias[...] if layer.bias is not None else None
    x, kernel, bias = layer.promote_dtype((x, layer.kernel[...], bias), dtype=layer.dtype)
    out = _fused_dot(x, kernel)
    return out if bias is None else out + bias

