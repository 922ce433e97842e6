"""Mixed precision with PyTorch FSDP's meaning (``torch.distributed.fsdp.MixedPrecision``).

Master parameters and optimizer state stay in their own dtype (fp32) in the shards. The
all-gather moves ``param_dtype`` (bf16 halves the gather bytes) and the unit computes in it;
gradients are reduce-scattered (and all-reduced across replicas) in ``reduce_dtype``, then
cast back to the master dtype for the optimizer; the loss is computed in ``output_dtype``.
Mixed-precision training itself: Micikevicius et al. 2018, arXiv 1710.03740, section 3.
The quantized wire formats of the same collectives (``gather_format``, ``reduce_format``,
``replica_format``: ZeRO++ qwZ / qgZ) are :class:`zshard.wire.quant.Quant`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from zshard.wire.quant import Quant, as_quant

__all__ = ["MixedPrecision"]


def _dtype(value, name: str):
    if value is None:
        return None
    try:
        dt = np.dtype(jnp.dtype(value))
    except TypeError as e:
        raise ValueError(f"MixedPrecision({name}={value!r}): not a dtype; use e.g. 'bfloat16' or 'float32'") from e
    if name == "reduce_dtype" and jnp.issubdtype(dt, jnp.integer):
        raise ValueError(
            f"MixedPrecision(reduce_dtype={value!r}): gradients summed in integers wrap around (an int4 reduce-scatter "
            "errs by 16) and nothing dequantizes them; for integer gradients on the wire use "
            f"reduce_format=zshard.Quant({str(dt) if str(dt) in ('int8', 'int4') else 'int8'!r}, block=256): blocks are "
            "all-to-all-ed quantized, dequantized and summed in float32"
        )
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
      gather_format: a :class:`~zshard.wire.quant.Quant` (or its name): the parameter all-gathers
        over the shard axes move quantized blocks, dequantized to ``param_dtype`` right after
        (ZeRO++ qwZ, forward and backward re-gather; fp32 masters unchanged). ``None``: ``param_dtype``.
      reduce_format: the gradient reduction over the shard axes is an all-to-all of quantized
        blocks, dequantized and summed in fp32, then cast to ``reduce_dtype`` (ZeRO++ qgZ).
        ``None``: a reduce-scatter in ``reduce_dtype``. ``Quant(..., error_feedback=True)``: each
        device adds the residual its previous quantization dropped before quantizing
        (``ShardedState.feedback``, fp32, ``4 n_pad`` bytes per quantized parameter and device).
      replica_format: the gradient reduction over the replica axes (HYBRID_SHARD's all-reduce,
        HYBRID_SHARD_OPT's reduce-scatter, NO_SHARD / SHARD_OPT's all-reduce over all devices)
        likewise: across hosts is where it pays. ``None``: in ``reduce_dtype``.

    Parameters of rank < 2 and matrices with fewer than ``block`` elements per device keep the
    unquantized path (:func:`zshard.wire.quant.quantizes`; ``zshard.report`` lists them).

    Raises:
      ValueError: a dtype field that is not a floating dtype (an integer ``reduce_dtype``: the
        sum would wrap; the message names ``reduce_format``); an unknown format name;
        ``error_feedback`` set on ``gather_format`` or ``replica_format`` (only ``reduce_format``
        takes it).
      TypeError: a format that is not a ``Quant``, a name or ``None``.
    """

    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None
    gather_format: Quant | str | None = None
    reduce_format: Quant | str | None = None
    replica_format: Quant | str | None = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, field, _dtype(getattr(self, field), field))
        for field in ("gather_format", "reduce_format", "replica_format"):
            object.__setattr__(self, field, as_quant(getattr(self, field), field))
        if self.gather_format is not None and self.gather_format.error_feedback:
            raise ValueError("MixedPrecision(gather_format=Quant(..., error_feedback=True)): error feedback corrects "
                             "gradient quantization; set it on reduce_format or replica_format")
        fmt = self.replica_format  # refused, never silently ignored
        if fmt is not None and fmt.error_feedback:
            raise ValueError(
                f"MixedPrecision(replica_format=Quant({fmt.name!r}, error_feedback=True)): error feedback is built for "
                "the shard-axis gradient all-to-all only; set it on reduce_format=zshard.Quant(..., error_feedback=True), "
                "and use replica_format without it (or int8 there: its error is in docs/quantized.md)"
            )

    @property
    def error_feedback(self) -> bool:
        """``reduce_format`` is set with ``error_feedback=True``: the step keeps a residual per
        quantized parameter (``ShardedState.feedback``, :func:`zshard.wire.quant.reduce_scatter_feedback`)."""
        return self.reduce_format is not None and self.reduce_format.error_feedback

    def gather_dtype(self, master) -> np.dtype:
        """The dtype a FlatParameter of dtype ``master`` is all-gathered in."""
        return self.param_dtype if self.param_dtype is not None and jnp.issubdtype(master, jnp.floating) else np.dtype(master)

    @property
    def quantized(self) -> bool:
        """Any wire format is set."""
        return any(f is not None for f in (self.gather_format, self.reduce_format, self.replica_format))

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
