"""zshard: ZeRO-3 / FSDP memory sharding for JAX with explicit device meshes.

    mesh  = zshard.make_mesh(replica=2, shard=4)
    state = zshard.init(model, optax.adamw(3e-4), mesh, strategy="HYBRID_SHARD")
    step  = zshard.make_train_step(loss_fn)
    state, metrics = step(state, batch)
    model = zshard.unshard(state)

Also public, for applications built on zshard (the ``train/`` package uses nothing else):
``Checkpointer`` (asynchronous save / restore with an ``extra`` record), ``fetch_params``
(one logical parameter at a time on the host), ``parse_collectives`` (the collectives of a
compiled program's HLO, by mesh axis), ``parse_mesh`` (``"RxS"`` or a preset name),
``path_str`` (the dotted parameter path of ``init(params=...)``) and the submodule
``zshard.distributed`` (``initialize``: ``jax.distributed`` start-up) and the submodule
``zshard.formulas`` (the memory and communication formulas, also in closed form for
``python -m train.scale``). For long sequences
(docs/long-sequences.md): ``attention`` (exact on a sequence split over the ``context`` axis)
and ``positions`` (each local token's global position). For mixtures of experts: ``moe`` (routed
experts as grouped matmuls, dispatched by all-to-all when split over the ``expert`` axis). For the GPU program on any machine:
``gpu_devices`` (a compile-only topology of H100 / H200 / A100 from XLA's target specs), the
submodule ``zshard.gpu`` (``GPU_COMPILER_OPTIONS``, ``TARGETS``, ``platform`` of a mesh) and
``parse_overlap`` (each collective of a compiled program: async or not, compute between start and done).
"""

from zshard import distributed, formulas, gpu
from zshard.attention import attention
from zshard.moe import moe
from zshard.checkpoint import Checkpointer, export, load_params, restore, save
from zshard.programs.evaluate import EvalStep, make_eval_step, make_forward
from zshard.gpu import gpu_devices
from zshard.mesh.mesh import make_mesh, parse_mesh
from zshard.wire.precision import MixedPrecision
from zshard.wire.quant import Quant
from zshard.report import Report, parse_collectives, parse_overlap, report
from zshard.context.sequence import positions
from zshard.plan.state import Plan, ShardedState, init, unshard
from zshard.programs.intercept import device_key
from zshard.programs.step import TokenMean, TrainStep, make_train_step
from zshard.mesh.strategy import Strategy
from zshard.params.units import path_str
from zshard.plan.weights import fetch_params

__all__ = [
    "Checkpointer",
    "MixedPrecision",
    "Plan",
    "Quant",
    "Report",
    "ShardedState",
    "Strategy",
    "TokenMean",
    "TrainStep",
    "attention",
    "device_key",
    "distributed",
    "formulas",
    "EvalStep",
    "export",
    "fetch_params",
    "gpu",
    "gpu_devices",
    "init",
    "load_params",
    "make_eval_step",
    "make_forward",
    "make_mesh",
    "make_train_step",
    "moe",
    "parse_collectives",
    "parse_mesh",
    "parse_overlap",
    "path_str",
    "positions",
    "report",
    "restore",
    "save",
    "unshard",
]
