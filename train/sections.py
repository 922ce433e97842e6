"""The nine sections of ``python -m train``'s configuration: one dataclass per TOML table.

``[model]``, ``[data]``, ``[mesh]``, ``[optimizer]``, ``[training]``, ``[precision]``,
``[checkpoint]``, ``[distributed]``, ``[logging]``; the string under each field is its documentation (and its
``--help`` text, read by :func:`train.flags.field_docs`). A field's flag is ``--field-name``
unless its metadata names another (``--model`` for ``model.preset``). The whole run, its
cross-field checks and its derived values are :class:`train.config.Config`; files and flags
are ``train/flags.py``.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "TrainingConfig",
]


def _flag(name: str, flag: str | None = None) -> dict:
    return {"flag": flag or "--" + name.replace("_", "-")}


@dataclasses.dataclass
class ModelConfig:
    """``[model]``: the model's shape (``train/model.py``: a byte-level GPT preset, or a zoo model)."""

    preset: str = dataclasses.field(default="tiny", metadata=_flag("preset", "--model"))
    """model preset of train/model.py: the byte-level GPTs nano (d 64, 2 layers), tiny (128, 4), small (256, 6), medium (512, 8, scanned) (a token file's --vocab-size is their vocabulary); or a zoo model of train.model.PLAN_PRESETS (python -m train.plan's): gpt2-124m, gpt2-1.5b, llama-1b, llama-7b, llama-70b, llama-3-8b, llama-3.2-1b, qwen3-30b-a3b, deepseek-v3, with its own vocabulary (bytes fit under it; --vocab-size at most it)"""
    seq_len: int = 128
    """tokens (bytes) per sequence; also the size of the model's position table"""
    scan: bool | None = None
    """stack the blocks (nnx.vmap) and run them with nnx.scan (compile time flat in depth); unset: the preset's choice"""
    init_from: str | None = None
    """Hugging Face model directory (config.json + safetensors) or a python -m train run folder (its weights: model.safetensors or its latest checkpoint) to start from; its model replaces the preset (vocab_size >= 256 for byte data); stored absolute in OUT/config.toml"""


@dataclasses.dataclass
class DataConfig:
    """``[data]``: the corpus, bytes or a token file (``train/data.py``)."""

    path: str | None = dataclasses.field(default=None, metadata=_flag("path", "--data"))
    """text file, or folder of text files (concatenated in sorted path order), to train on (bytes; the last 10% held out; a relative path is taken from the working directory); or a pre-tokenised .bin / .npy token file with --vocab-size; unset: the Python stdlib's .py sources, first 8 MiB"""
    eval_batches: int = 8
    """held-out batches (of training.batch_size sequences) per evaluation"""
    vocab_size: int | None = None
    """tokens in the vocabulary of a token file (--data FILE.bin or FILE.npy, nanoGPT layout); required for one, and the model's vocab_size; every token must be < it; unset for text (bytes, 256)"""
    token_dtype: str | None = None
    """dtype of a .bin token file: uint16 or uint32 (raw tokens, no header); unset: uint16 as nanoGPT (a .npy carries its own)"""


@dataclasses.dataclass
class MeshConfig:
    """``[mesh]``: devices, the ``(replica, shard[, expert][, context][, tensor])`` mesh and the sharding strategy."""

    devices: int = 8
    """devices per process: N emulated CPU devices; on an accelerator, the first N (at most) of its devices"""
    shape: str | None = dataclasses.field(default=None, metadata=_flag("shape", "--mesh"))
    """REPLICAxSHARD (e.g. 2x4), REPLICAxSHARDxTENSOR (e.g. 1x4x2) or a preset of meshes/*.toml (e.g. cpu-2x4); unset: 1xN (N devices on shard, or N/tensor), or processes x devices per process"""
    tensor: int | None = None
    """devices of the tensor axis (tensor parallelism, innermost: the model's plan splits its layers over them: column- and row-parallel projections, the vocabulary); unset or 1: none; --mesh RxSxT sets it too"""
    expert: int | None = None
    """devices of the expert axis (expert parallelism, after shard: the batch is split over replica x shard x expert, the dense parameters sharded over shard x expert, each MoE layer's experts split over expert, E / expert whole experts per device, tokens sent to their experts by all-to-all; needs a mixture of experts (--model qwen3-30b-a3b or deepseek-v3, or model.init_from a Qwen3-MoE or Mixtral checkpoint) whose expert count it divides: train.models.expert_plan); unset or 1: none"""
    context: int | None = None
    """devices of the context axis (context parallelism, between shard and tensor: each sequence is split over them in the head-tail order, the rows over replica x shard; model.seq_len must divide by 2 x context; docs/long-sequences.md); unset or 1: none"""
    strategy: str | None = None
    """sharding strategy (FSDP names; file alias: sharding_strategy): NO_SHARD, SHARD_OPT, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, HYBRID_SHARD_OPT; unset: FULL_SHARD, or zero_stage's"""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage, an alias of strategy (file alias: [zero_optimization] stage): 0 NO_SHARD, 1 SHARD_OPT, 2 SHARD_GRAD_OP, 3 FULL_SHARD"""
    unit: str = "blocks"
    """wrap policy: blocks (each transformer block a unit; embeddings, final norm and head form the root unit, gathered for the step) or ends (the embedding and the head are units too, gathered only where used: train.model.units_with_ends)"""
    offload: str | None = None
    """host offload (docs/offload.md): optimizer (the AdamW moments in pinned host memory, 8 bytes per parameter / shard devices, moved to the device for the update) or optimizer+master (the fp32 masters too, a bf16 copy on the device; needs training.param_dtype = bfloat16); unset: everything in device memory"""


@dataclasses.dataclass
class OptimizerConfig:
    """``[optimizer]``: AdamW (b1 0.9, b2 0.95), linear warmup, cosine decay to ``lr / 10``."""

    lr: float = 3e-3
    """peak learning rate (per step, dimensionless)"""
    warmup: int | None = None
    """linear warmup, steps (step t uses lr * (t + 1) / (warmup + 1)); unset: 10% of training.steps (at most steps - 1)"""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on kernels and embeddings (not on norms or biases)"""
    clip_norm: float | None = None
    """clip the gradient to this global L2 norm (exact over all shards); unset: no clipping"""


@dataclasses.dataclass
class TrainingConfig:
    """``[training]``: steps, batch, precision, evaluation."""

    steps: int = 300
    """optimizer steps"""
    batch_size: int = 16
    """GLOBAL batch, sequences per step (split over all devices x grad_accum micro-batches)"""
    grad_accum: int = 1
    """gradient accumulation: micro-batches per optimizer step"""
    param_dtype: str | None = None
    """mixed precision: dtype of the all-gather and of the compute, float32 or bfloat16 (masters stay float32)"""
    reduce_dtype: str | None = None
    """mixed precision: dtype of the gradient reduce-scatter / all-reduce (unset: param_dtype)"""
    skip_nonfinite: bool = False
    """skip the update of a step whose loss or gradient is NaN/inf; otherwise such a step stops the run"""
    remat: str = "block"
    """activation checkpointing in each block: block (recompute the block), dots (save matmul outputs), none (save all)"""
    prefetch: int | None = None
    """units whose all-gather may be issued ahead of the unit computing (0: off; unset: zshard.make_train_step's default, 0 on CPU and 1 on GPU/TPU)"""
    hpz: bool = False
    """ZeRO++ hpZ (DeepSpeed zero_hpz_partition_size = the shard size): each block keeps its 1/shard slice of the gathered weights from forward, and backward gathers it over shard only (inside a node): no backward gather over replica, 1/shard of the weights more memory; FULL_SHARD with mesh replica > 1 and shard > 1 only (docs/quantized.md)"""
    seed: int = 0
    """seed of the initial weights, of the batches and of sampling"""
    eval_every: int = 100
    """steps between held-out evaluations (0: only before the first and after the last step)"""
    fit_check: bool = True
    """before the first step, refuse (exit 2) a run whose compiled step needs more memory per device than a device has (GPU: memory_stats bytes_limit; CPU: the host's memory shared by its emulated devices), naming the numbers and the fixes"""
    watchdog: float = 60.0
    """seconds: the least time a part of the loop (a step, an evaluation, a sample, a checkpoint save) may take before the run stops with an error naming the step and the process (exit 124); each may take 10 x the median of its earlier durations (the first: 10 x the compile time); 0: no watchdog"""


@dataclasses.dataclass
class PrecisionConfig:
    """``[precision]``: quantized collectives (ZeRO++ qwZ / qgZ, ``zshard.Quant``, docs/quantized.md)."""

    gather_format: str | None = None
    """int8, int4, float8_e4m3fn or float8_e5m2: the parameter all-gathers over the shard axes move quantized blocks, dequantized to param_dtype (masters unchanged); unset: param_dtype"""
    reduce_format: str | None = None
    """int8, int4, float8_e4m3fn or float8_e5m2: the gradient reduction over the shard axes is an all-to-all of quantized blocks, summed in float32; unset: a reduce-scatter in reduce_dtype"""
    replica_format: str | None = None
    """the same for the gradient reduction over the replica axis (HYBRID_SHARD*, NO_SHARD, SHARD_OPT: the all-reduce); unset: reduce_dtype"""
    error_feedback: bool = False
    """with reduce_format: each device adds the residual its last quantized gradient dropped before quantizing the next (error feedback: EF-SGD, LoCo); costs 4 bytes per quantized parameter element on every device (float32, in the checkpoints)"""
    block: int = dataclasses.field(default=256, metadata=_flag("block", "--quant-block"))
    """elements per float32 scale of every format (ZeRO++ block quantization); 0: one scale per tensor (tensorwise)"""


@dataclasses.dataclass
class CheckpointConfig:
    """``[checkpoint]``: saving and exact resume, by ``train/checkpointing.py``."""

    ckpt_every: int = 0
    """steps between checkpoints in OUT/checkpoints/<step>, and after the last step (0: none)"""
    keep: int | None = None
    """checkpoints kept, the newest (unset: all)"""
    resume: bool = False
    """continue from the newest complete checkpoint in OUT/checkpoints (same batches, same losses)"""
    preempt_grace: float | None = None
    """seconds from a SIGTERM / SIGUSR1 within which the step in flight must finish and its checkpoint be complete; past it the run removes the half-written checkpoint and exits 143 (the previous one stays the latest); unset: no limit (the scheduler's kill ends it)"""


@dataclasses.dataclass
class DistributedConfig:
    """``[distributed]``: ``jax.distributed`` for multi-host runs (``zshard.distributed.initialize``, docs/multihost.md)."""

    coordinator: str | None = None
    """HOST:PORT of process 0, reachable from every process; unset: $ZSHARD_COORDINATOR, the cluster's (SLURM / Open MPI), or one process"""
    num_processes: int | None = None
    """processes (hosts) in the run, the same on all; unset: $ZSHARD_NUM_PROCESSES or the cluster's"""
    process_id: int | None = None
    """this process's rank, 0 .. num_processes - 1; unset: $ZSHARD_PROCESS_ID or the cluster's"""


@dataclasses.dataclass
class LoggingConfig:
    """``[logging]``: where the run writes, what it watches."""

    out: str | None = None
    """output directory: metrics.jsonl, summary.json, config.toml, samples.txt, tb/, model.safetensors (created after validation); unset: a new runs/<date-time> folder, runs/latest pointing at it (--resume: runs/latest)"""
    overwrite: bool = False
    """replace the files of an earlier run in OUT (without it a run never writes into an OUT that holds one; --resume continues it)"""
    report: bool = False
    """print zshard.report (memory and collective bytes of the compiled step) and store it in summary.json"""
    tensorboard: bool = True
    """write TensorBoard event files under OUT/tb"""
    sample_every: int = 0
    """steps between text samples (0: only after the last step)"""
    prompt: str | None = None
    """text the samples start from; unset: the first min(64, seq_len / 2) bytes of the held-out split"""
    sample_tokens: int = 128
    """tokens (bytes) generated per sample; 0: no samples (no OUT/samples.txt, no generation programs compiled)"""
    temperature: float = 0.8
    """sampling temperature; 0: greedy (argmax)"""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "mesh": MeshConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "precision": PrecisionConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
    "logging": LoggingConfig,
}