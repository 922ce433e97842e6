"""Checkpoints on Orbax: sharded save, restore onto any mesh and strategy, safetensors export.

What is stored is *logical*, independent of the mesh and the strategy that wrote it: each
parameter under its path in its own shape and dtype (no padding, no flattening), each
optimizer-state leaf of a parameter under the optimizer-state path with the parameter's
shape, the scalar leaves (step counts) as they are, the step, and a JSON record (the
caller's ``extra``: data position, RNG state, run config). A checkpoint written by 1x8
FULL_SHARD restores on 2x4 HYBRID_SHARD, 1x1 or NO_SHARD bit for bit.

Files of one checkpoint directory (Orbax ``CheckpointManager``, one folder per step)::

    DIR/<step>/state/   arrays (Orbax StandardCheckpointHandler, OCDBT + zarr):
        params.<parameter path>                       e.g. params.blocks.0.lin.kernel [19, 19]
        opt_state.<optimizer path>.<parameter path>   e.g. opt_state.0.mu.blocks.0.lin.kernel [19, 19]
        opt_state.<optimizer path>                    e.g. opt_state.0.count [] int32
        step                                          int32 []
    DIR/<step>/meta/    JSON: {"zshard": {...what wrote it...}, "extra": <caller's extra>}

How arrays move (never whole on one device): at save, one jitted program turns every
``[n_pad]`` shard (``[L, n_pad]`` for stacked layers) into its logical array, itself split
over the same mesh axes along a dimension that divides evenly (replicated when none does),
and Orbax writes each device's piece. At restore, Orbax reads each logical array straight
into the *new* mesh's pieces and one jitted program pads and lays them out with the new
plan's ``PartitionSpec``. The new placement comes from :func:`zshard.init` with
``abstract=True`` on the new mesh and strategy, never from the saved sharding.

Writing is asynchronous (Orbax): :meth:`Checkpointer.save` returns once the arrays are
copied to host memory; the files are written in a background thread into
``DIR/<step>.orbax-checkpoint-tmp`` and renamed to ``DIR/<step>`` when complete, so a
process killed while saving leaves only a temporary folder that is never restored from.
"""

from zshard.checkpoint.checkpointer import Checkpointer, restore, save
from zshard.checkpoint.safetensors_export import export, load_params

__all__ = ["Checkpointer", "export", "load_params", "restore", "save"]
