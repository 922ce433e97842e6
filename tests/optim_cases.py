"""A tiny model with every kind of parameter the optimizer must handle exactly.

Uneven sizes (13, 19, 3: none divisible by 2, 4 or 8), 1-D biases, 2-D kernels, a scalar,
and a stacked unit (``nnx.vmap``-built, run with ``nnx.scan``: kernel ``[2, 19, 19]``,
bias ``[2, 19]``).
"""

import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class Net(nnx.Module):
    """13 -> 19 -> (2 stacked blocks) -> x gain -> 3."""

    def __init__(self, d_in: int = 13, d: int = 19, d_out: int = 3, layers: int = 2, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(d_in, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(d, rngs=rngs)

        self.blocks = make(rngs)
        self.gain = nnx.Param(jnp.full((), 1.5))
        self.head = nnx.Linear(d, d_out, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(x, self.blocks) * self.gain)


def net():
    return Net(rngs=nnx.Rngs(0))
