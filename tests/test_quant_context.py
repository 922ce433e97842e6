"""Quantized collectives (zshard/wire/quant.py) on a mesh with a ``context`` axis: the context devices
are data devices of the FULL_SHARD world, so the int8 weight gathers and the int8 gradient
all-to-all run over ``(replica, shard, context)``; numbers near one device, bytes in the HLO."""

import numpy as np
import optax
from conftest import ResMLP, mlp_batches, mse_loss, reference_run, run_steps
from flax import nnx

import zshard
from zshard.inspection.hlo import parse_collectives
from zshard.wire.quant import Quant

Q16 = Quant("int8", 16)
DATA = mlp_batches(5, batch=16)


def mlp():
    return ResMLP(13, 19, 3, n_blocks=2, rngs=nnx.Rngs(0))


def test_int8_gathers_and_gradients_on_a_context_mesh_train_close_to_one_device():
    mesh = zshard.make_mesh(1, 4, context=2)
    mp = zshard.MixedPrecision(gather_format=Q16, reduce_format=Q16)
    state = zshard.init(mlp, optax.adam(1e-2), mesh, strategy="FULL_SHARD", mixed_precision=mp)
    step = zshard.make_train_step(mse_loss, sequence_axis=(None, None))  # no sequence: rows over context too, on purpose
    emitted = step.lower(state, DATA[0]).as_text(dialect="hlo")
    colls = parse_collectives(emitted, state.plan.mesh)
    axes = {c.axis for c in colls if c.kind in ("all-gather", "all-to-all")}
    assert axes == {"shard+context"}, axes  # every device of the 1x4x2 mesh: shard and context together
    groups = {c.group_size for c in colls if c.kind == "all-to-all"}
    assert groups == {8}, groups
    assert " u8[" in emitted and [c for c in colls if c.kind == "all-to-all"]  # the formats did not fall back
    _, losses, _ = run_steps(step, state, DATA)
    want = reference_run(mlp, optax.adam(1e-2), mse_loss, DATA).losses
    np.testing.assert_allclose(losses, want, rtol=1e-2)  # as test_quant's FULL_SHARD 1x8 row
    assert losses != want and losses[-1] < losses[0]
