"""Mixed precision with PyTorch FSDP's meaning (``torch.distributed.fsdp.MixedPrecision``).

Master parameters and optimizer state stay in their own dtype (fp32) in the shards. The
all-gather moves ``param_dtype`` (bf16 halves the gather bytes) and the unit computes in it;
gradients are reduce-scattered (and all-reduced across replicas) in ``reduce_dtype``, then
cast back to the master dtype for the optimizer; the loss is computed in ``output_dtype``.
Mixed-precision training itself: Micikevicius et al. 2018, arXiv 1710.03740, section 3.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MixedPrecision"]


def _dtype(value, name: str):
    if value is None:
        return None
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError as e:
        raise ValueError(f"MixedPrecision({name}={value!r}): not a dtype; use e.g. 'bfloat16' or 'float32'") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"MixedPrecision({name}={value!r}): must be a floating dtype (bfloat16, float16, float32)")
    if dt.itemsize > 4 and not jax.config.jax_enable_x64:
        raise ValueError(f"MixedPrecision({name}={value!r}): 64-bit floats need jax_enable_x64; use float32 or lower")
    return dt


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the gathered parameters, the gradient reduction and the loss.

    Attributes:
      param_dtype: dtype the FlatParameter is cast to before the all-gather; the unit's
        floating inputs are cast to it too, so it computes in it. ``None``: the master dtype.
      reduce_dtype: dtype of the reduce-scatter / all-reduce of gradients. ``None``: ``param_dtype``
        (FSDP's default), or the master dtype when that is ``None`` too.
      output_dtype: dtype the loss is cast to. ``None``: float32.

    Raises:
      ValueError: a field that is not a floating dtype.
    """

    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, field, _dtype(getattr(self, field), field))

    def gather_dtype(self, master) -> np.dtype:
        """The dtype a FlatParameter of dtype ``master`` is all-gathered in."""
        return self.param_dtype if self.param_dtype is not None and jnp.issubdtype(master, jnp.floating) else np.dtype(master)

    def grad_dtype(self, master) -> np.dtype:
        """The dtype gradients of ``master`` parameters are reduced in."""
        if not jnp.issubdtype(master, jnp.floating):
            return np.dtype(master)
        return self.reduce_dtype or self.param_dtype or np.dtype(master)

    def cast_inputs(self, tree):
        """Floating arrays of ``tree`` cast to ``param_dtype`` (FSDP's ``cast_forward_inputs``)."""
        if self.param_dtype is None:
            return tree
        return jax.tree.map(lambda x: x.astype(self.param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def cast_loss(self, loss):
        return loss.astype(self.output_dtype or jnp.float32)


FULL_PRECISION = MixedPrecision()
