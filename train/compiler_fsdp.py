"""The compiler-sharded FSDP train step: ``jax.jit`` with FSDP ``NamedSharding``s, the MaxText way.

Each parameter and its Adam moments are sharded on their largest dimension divisible by the
device count, over every mesh axis; the compiler (XLA's SPMD partitioner) adds the all-gathers
and reduce-scatters. This is the peer zshard is measured against by ``python -m train.bench``
(``train/bench/peers.py``: its FSDP-compiler and DDP rows) and ``python -m train.plan --peer``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from train.model import cross_entropy_loss

__all__ = ["fsdp_jit"]


def _fsdp_spec(shape, world: int, axes):
    """MaxText-style FSDP: shard the largest dimension divisible by ``world`` over ``axes``."""
    dims = sorted((d for d in range(len(shape)) if shape[d] % world == 0 and shape[d] > 0), key=lambda d: -shape[d])
    if not dims:
        return P()
    spec = [None] * len(shape)
    spec[dims[0]] = axes
    return P(*spec)


def _policy(remat):
    """The ``jax.checkpoint`` policy of a plain peer's block for zshard's remat names
    (``zshard.make_train_step(remat=...)``): ``"block"`` saves nothing (recompute the block),
    ``"dots"`` the matmul outputs (``dots_saveable``, as zshard's ``"dots"``)."""
    match remat:
        case "block":
            return None
        case "dots":
            return jax.checkpoint_policies.dots_saveable
        case _:
            raise ValueError(f"remat={remat!r}: the plain peers know 'none', 'block' and 'dots'")


class _Block(nnx.Module):
    """A block as zshard runs a unit: its floating input cast to the compute dtype (as
    ``zshard.MixedPrecision(param_dtype=...)`` casts a unit's inputs: the token embedding's
    output is float32, ``nnx.Embed``'s dtype) and, with ``remat``, under ``jax.checkpoint``
    (``nnx.remat``; ``"block"``: each block's input saved, the block recomputed in backward, zshard's
    default). Wraps one block of a list, or the stacked blocks of a scanned model (``nnx.scan``
    then slices this module like the stack: each layer is checkpointed alone)."""

    def __init__(self, block, remat, dtype):
        self.block, self.remat, self.dtype = block, remat != "none", dtype
        self.policy = _policy(remat) if self.remat else None

    def __call__(self, x):
        if self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(self.dtype)
        if not self.remat:
            return self.block(x)
        return nnx.remat(lambda blk, x: blk(x), policy=self.policy)(self.block, x)


def fsdp_jit(graphdef, params, tx, mesh, mode="fsdp", remat="none", compute_dtype=None, loss_fn=cross_entropy_loss,
             compiler_options=None):
    """The plain peers' train step: ``jax.jit`` of ``(params, opt_state, batch) -> (params,
    opt_state, loss)`` over an NNX model's ``(graphdef, params)`` (arrays or
    ``jax.ShapeDtypeStruct``: nothing is allocated).

    Args:
      mode: ``"fsdp"`` (each parameter and its Adam moments sharded on their largest dimension
        divisible by the device count over every mesh axis, MaxText style: the compiler adds
        all-gathers and reduce-scatters), ``"ddp"`` (replicated, batch split) or ``"reference"``
        (one device).
      remat: ``"none"`` (every activation saved), ``"block"`` or ``"dots"`` (each block, listed
        or stacked, under ``jax.checkpoint`` with zshard's policy of that name).
      compute_dtype: e.g. ``bfloat16``: the floating parameters are cast to it inside the loss
        and so is each block's input (fp32 masters and Adam moments, the compute in
        ``compute_dtype``; the gradients reach the masters in fp32 through the cast's transpose),
        as ``zshard.MixedPrecision(param_dtype=...)`` does per unit.
      loss_fn: ``loss_fn(model, batch)`` -> scalar.
      compiler_options: XLA options of the jit (``jax.jit(compiler_options=...)``), e.g. the
        GPU profile zshard's step compiles with.

    Returns:
      ``(jitted, (param_shardings, opt_shardings, batch_sharding), abstract_opt_state)``.
    """
    if remat != "none":
        _policy(remat)  # an unknown name fails here, before tracing
    abs_opt = jax.eval_shape(tx.init, params)
    axes = tuple(mesh.axis_names)
    if mode == "reference":
        dev = SingleDeviceSharding(mesh.devices.flat[0])
        spec_of = lambda x: dev  # noqa: E731
        b_sh = out_sh = dev
    else:
        world = mesh.size
        spec_of = lambda x: NamedSharding(mesh, P() if mode == "ddp" else _fsdp_spec(x.shape, world, axes))  # noqa: E731
        b_sh, out_sh = NamedSharding(mesh, P(axes)), NamedSharding(mesh, P())
    p_sh, o_sh = jax.tree.map(spec_of, params), jax.tree.map(spec_of, abs_opt)

    def step(params, opt_state, batch):
        def loss_of(p):
            if compute_dtype is not None:  # bf16 compute, fp32 masters
                p = jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
            model = nnx.merge(graphdef, p)
            if compute_dtype is not None:  # the blocks compute in compute_dtype from the first one on
                for name in ("embed", "wte", "wpe"):  # nnx.Embed's lookup returns its `dtype` (float32 by default)
                    if isinstance(getattr(model, name, None), nnx.Embed):
                        getattr(model, name).dtype = compute_dtype  # the module itself: a tied head reads its table
            if remat != "none" or compute_dtype is not None:  # the model calls each block (a loop or nnx.scan): wrap them
                blocks = model.blocks
                model.blocks = [_Block(b, remat, compute_dtype) for b in blocks] if isinstance(blocks, (list, nnx.List)) \
                    else _Block(blocks, remat, compute_dtype)
            return loss_fn(model, batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, in_shardings=(p_sh, o_sh, (b_sh, b_sh)), out_shardings=(p_sh, o_sh, out_sh), donate_argnums=(0, 1),
                     compiler_options=compiler_options)
    return jitted, (p_sh, o_sh, b_sh), abs_opt
