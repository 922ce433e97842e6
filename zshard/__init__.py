"""zshard: ZeRO-3 / FSDP memory sharding for JAX with explicit device meshes.

    mesh  = zshard.make_mesh(replica=2, shard=4)
    state = zshard.init(model, optax.adamw(3e-4), mesh, strategy="HYBRID_SHARD")
    step  = zshard.make_train_step(loss_fn)
    state, metrics = step(state, batch)
    model = zshard.unshard(state)
"""

from zshard.checkpoint import export, load_params, restore, save
from zshard.evaluate import EvalStep, make_eval_step, make_forward
from zshard.mesh import make_mesh
from zshard.precision import MixedPrecision
from zshard.report import Report, report
from zshard.state import Plan, ShardedState, init, unshard
from zshard.intercept import device_key
from zshard.step import TokenMean, TrainStep, make_train_step
from zshard.strategy import Strategy

__all__ = [
    "MixedPrecision",
    "Plan",
    "Report",
    "ShardedState",
    "Strategy",
    "TokenMean",
    "TrainStep",
    "device_key",
    "EvalStep",
    "export",
    "init",
    "load_params",
    "make_eval_step",
    "make_forward",
    "make_mesh",
    "make_train_step",
    "report",
    "restore",
    "save",
    "unshard",
]
