"""Typed, validated configuration of ``python -m train``: dataclasses in sections, TOML files.

A run is described by one :class:`Config`, built from three layers, later ones winning:

1. the defaults of the dataclasses below;
2. a file, ``--config FILE`` (TOML, or JSON for DeepSpeed-style files), one table per
   section (``[model]``, ``[data]``, ``[mesh]``, ``[optimizer]``, ``[training]``,
   ``[checkpoint]``, ``[distributed]``, ``[logging]``);
3. command-line flags: every field has one (``--steps`` or ``--training.steps``).

Names users bring with them are accepted in files (docs/training.md has the table):

- PyTorch FSDP: ``[mesh] sharding_strategy = "FULL_SHARD"`` (also ``SHARD_GRAD_OP``,
  ``NO_SHARD``, ``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``, or the enum's numbers 1-5 as
  Accelerate writes them), an alias of ``mesh.strategy``;
- DeepSpeed: a top-level ``zero_optimization`` table with ``stage = 0..3`` (``[zero_optimization]``
  in TOML, ``{"zero_optimization": {"stage": 3}}`` in JSON), an alias of ``mesh.zero_stage``.

Every problem is a :class:`ConfigError` naming the key (``section.field``), its flag, the
value and the allowed values, raised before jax compiles anything. :meth:`Config.resolved`
gives the configuration with every derived value filled in; :func:`dumps_toml` of it is
what ``python -m train`` writes to ``OUT/config.toml``, and ``--config OUT/config.toml``
repeats the run exactly (same losses on the same devices).

This module imports neither jax nor the model at import time (``python -m train`` must set
``XLA_FLAGS`` before jax is imported, and it reads the device count from the config).

Over 400 lines on purpose: the eight sections' dataclasses with a one-line docstring per
field (about 140 lines), :class:`Config`'s cross-field checks and derived values (about
180), and the file and flag plumbing that every field goes through (about 210). They stay
in one module so that a field, its check and its flag are read and changed together.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import tomllib
import types
import typing
from pathlib import Path

import tomli_w

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainingConfig",
    "add_arguments",
    "dumps_toml",
    "flag_of",
    "flat_names",
    "from_args",
    "load_file",
]

MODEL_PRESET_NAMES = ("nano", "tiny", "small", "medium")
"""Keys of ``train.model.MODEL_PRESETS`` (checked against it in :meth:`Config.validate`)."""

FSDP_STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
"""``torch.distributed.fsdp.ShardingStrategy`` enum values (Accelerate writes these numbers)."""

DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A bad configuration value. ``key`` is ``section.field`` (or the file path)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def _flag(name: str, flag: str | None = None) -> dict:
    return {"flag": flag or "--" + name.replace("_", "-")}


# ----------------------------------------------------------------------------------------
# Sections. The string under each field is its documentation (and its --help text).
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    """``[model]``: the GPT's shape (``train/model.py``)."""

    preset: str = dataclasses.field(default="tiny", metadata=_flag("preset", "--model"))
    """model preset of train/model.py: nano (d 64, 2 layers), tiny (128, 4), small (256, 6), medium (512, 8, scanned)"""
    seq_len: int = 128
    """tokens (bytes) per sequence; also the size of the model's position table"""
    scan: bool | None = None
    """stack the blocks (nnx.vmap) and run them with nnx.scan (compile time flat in depth); unset: the preset's choice"""
    init_from: str | None = None
    """Hugging Face model directory (gpt2 or llama, config.json + safetensors) to fine-tune; its config.json replaces the preset (vocab_size >= 256 for byte data)"""


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
    """``[mesh]``: devices, the ``(replica, shard)`` mesh and the sharding strategy."""

    devices: int = 8
    """devices per process: N emulated CPU devices; on an accelerator, the first N (at most) of its devices"""
    shape: str | None = dataclasses.field(default=None, metadata=_flag("shape", "--mesh"))
    """REPLICAxSHARD (e.g. 2x4) or a preset of meshes/*.toml (e.g. cpu-2x4); unset: 1xN (N devices on shard), or processes x devices per process"""
    strategy: str | None = None
    """sharding strategy (FSDP names; file alias: sharding_strategy): NO_SHARD, SHARD_OPT, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2, HYBRID_SHARD_OPT; unset: FULL_SHARD, or zero_stage's"""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage, an alias of strategy (file alias: [zero_optimization] stage): 0 NO_SHARD, 1 SHARD_OPT, 2 SHARD_GRAD_OP, 3 FULL_SHARD"""
    unit: str = "blocks"
    """wrap policy: blocks (each transformer block a unit; embeddings, final norm and head form the root unit, gathered for the step) or ends (the embedding and the head are units too, gathered only where used: train.model.units_with_ends)"""


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
    """units whose all-gather may be issued ahead of the unit computing (0: off; unset: zshard.default_prefetch(), 0 on CPU and 1 on GPU/TPU)"""
    seed: int = 0
    """seed of the initial weights, of the batches and of sampling"""
    eval_every: int = 100
    """steps between held-out evaluations (0: only before the first and after the last step)"""


@dataclasses.dataclass
class CheckpointConfig:
    """``[checkpoint]``: saving and exact resume, by ``train/checkpointing.py``."""

    ckpt_every: int = 0
    """steps between checkpoints in OUT/checkpoints/<step>, and after the last step (0: none)"""
    keep: int | None = None
    """checkpoints kept, the newest (unset: all)"""
    resume: bool = False
    """continue from the newest complete checkpoint in OUT/checkpoints (same batches, same losses)"""


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
    """tokens (bytes) generated per sample"""
    temperature: float = 0.8
    """sampling temperature; 0: greedy (argmax)"""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "mesh": MeshConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
    "logging": LoggingConfig,
}


@dataclasses.dataclass
class Config:
    """The whole run: one attribute per section."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    # ---- building -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "Config":
        """A ``Config`` from nested dicts ``{section: {field: value}}`` (types checked).

        FSDP's ``mesh.sharding_strategy`` and DeepSpeed's ``zero_optimization.stage`` are
        read as ``mesh.strategy`` and ``mesh.zero_stage``.

        Raises:
          ConfigError: an unknown section or key, a value of the wrong type, or two names
            for one field; the message names ``section.key`` and what is allowed.
        """
        raw = _translate_aliases(raw, source)
        cfg = cls()
        for section, table in raw.items():
            if section not in SECTIONS:
                raise ConfigError(section, f"unknown section in {source}; allowed: {', '.join(SECTIONS)}, zero_optimization")
            if not isinstance(table, dict):
                raise ConfigError(section, f"must be a table of keys ([{section}] in TOML), got {table!r}")
            sub = getattr(cfg, section)
            known = {f.name: f for f in dataclasses.fields(sub)}
            for key, value in table.items():
                if key not in known:
                    raise ConfigError(f"{section}.{key}", f"unknown key in {source}; [{section}] allows: {', '.join(known)}")
                setattr(sub, key, _check_type(f"{section}.{key}", value, _field_type(type(sub), key)))
        return cfg

    def to_dict(self) -> dict:
        """``{section: {field: value}}``, ``None`` values left out (TOML has no null)."""
        return {s: {k: v for k, v in dataclasses.asdict(getattr(self, s)).items() if v is not None} for s in SECTIONS}

    # ---- validation ---------------------------------------------------------------------

    def validate(self, n_devices: int | None = None, processes: int = 1) -> "Config":
        """Check every value and every combination; returns ``self``.

        Args:
          n_devices: devices actually available, all processes together (default
            ``mesh.devices``); the mesh and the batch must fit them.
          processes: processes of a multi-process run (the default mesh is then
            ``processes x n_devices / processes``).

        Raises:
          ConfigError: naming the key, its flag, the value and the allowed values or the fix.
        """
        n = self.mesh.devices if n_devices is None else n_devices
        m, d, me, o, t, c, lg = self.model, self.data, self.mesh, self.optimizer, self.training, self.checkpoint, self.logging
        from train.model import MODEL_PRESETS  # noqa: PLC0415  (imports jax: after XLA_FLAGS)

        _choice("model.preset", m.preset, list(MODEL_PRESETS))
        _at_least("model.seq_len", m.seq_len, 1)
        if d.path is not None and not d.path:
            raise ConfigError(_key("data.path"), "is empty; give a text file, or leave it unset for the stdlib corpus")
        _at_least("data.eval_batches", d.eval_batches, 1)
        if d.vocab_size is not None:
            _at_least("data.vocab_size", d.vocab_size, 2)
        if d.token_dtype is not None:
            _choice("data.token_dtype", d.token_dtype, ["uint16", "uint32"])
        _at_least("mesh.devices", me.devices, 1)
        self.strategy()  # a known name / stage, and not two that disagree
        replica, shard = self.mesh_shape(n, processes)
        if replica * shard != n:
            shapes = ", ".join(f"{r}x{n // r}" for r in range(1, n + 1) if n % r == 0)
            raise ConfigError(
                _key("mesh.shape"),
                f"{me.shape!r} is {replica}x{shard} = {replica * shard} devices, but there are {n} "
                f"(mesh.devices = {me.devices}); use a mesh of {n} devices ({shapes})"
                + (f" or --devices {replica * shard}" if n == me.devices else ""),
            )
        _at_least("optimizer.lr", o.lr, 0, strict=True)
        if o.warmup is not None:
            _at_least("optimizer.warmup", o.warmup, 0)
        _at_least("optimizer.weight_decay", o.weight_decay, 0)
        if o.clip_norm is not None:
            _at_least("optimizer.clip_norm", o.clip_norm, 0, strict=True)
        _at_least("training.steps", t.steps, 1)
        _at_least("training.batch_size", t.batch_size, 1)
        _at_least("training.grad_accum", t.grad_accum, 1)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(t, name) is not None:
                _choice(f"training.{name}", getattr(t, name), list(DTYPES))
        _choice("training.remat", t.remat, ["block", "dots", "none"])
        _choice("mesh.unit", me.unit, ["blocks", "ends"])
        if t.prefetch is not None:
            _at_least("training.prefetch", t.prefetch, 0)
        _at_least("training.seed", t.seed, 0)
        _at_least("training.eval_every", t.eval_every, 0)
        unit = n * t.grad_accum  # the global batch splits over devices x micro-batches
        if t.batch_size % unit:
            lo = max(unit, t.batch_size // unit * unit)
            accum = f" x training.grad_accum {t.grad_accum}" if t.grad_accum > 1 else ""
            raise ConfigError(
                _key("training.batch_size"),
                f"{t.batch_size} does not divide by the {n} devices of the {replica}x{shard} mesh{accum} "
                f"(the global batch is split over all devices); use a multiple of {unit}, e.g. {lo} or {lo + unit}",
            )
        _at_least("checkpoint.ckpt_every", c.ckpt_every, 0)
        if c.keep is not None:
            _at_least("checkpoint.keep", c.keep, 1)
        # [distributed]: types checked here; zshard.distributed.initialize checks the values.
        if lg.out is not None and not lg.out:
            raise ConfigError(_key("logging.out"), "is empty; give a directory path, or leave it unset for a new runs/<date-time>")
        _at_least("logging.sample_every", lg.sample_every, 0)
        _at_least("logging.sample_tokens", lg.sample_tokens, 1)
        _at_least("logging.temperature", lg.temperature, 0)
        if lg.prompt is not None and not lg.prompt:
            raise ConfigError(_key("logging.prompt"), "is empty; give some text, or leave it unset for the held-out split's start")
        return self

    # ---- derived values -----------------------------------------------------------------

    def strategy(self) -> str:
        """The strategy's canonical name (``zshard.Strategy.parse`` of ``mesh.strategy`` and
        ``mesh.zero_stage``); FULL_SHARD when neither is set.

        Raises:
          ConfigError: an unknown name or stage, or both given and disagreeing.
        """
        from zshard.strategy import Strategy  # noqa: PLC0415  (imports jax: after XLA_FLAGS)

        me = self.mesh
        if me.strategy is None and me.zero_stage is None:
            return Strategy.FULL_SHARD.value
        try:
            return Strategy.parse(me.strategy, zero_stage=me.zero_stage).value
        except ValueError as e:
            key = "mesh.zero_stage" if me.zero_stage is not None else "mesh.strategy"
            raise ConfigError(_key(key), str(e)) from None

    def mesh_shape(self, n_devices: int | None = None, processes: int = 1) -> tuple[int, int]:
        """``(replica, shard)``: ``mesh.shape`` parsed, or ``(processes, n_devices / processes)`` when unset."""
        n = self.mesh.devices if n_devices is None else n_devices
        if self.mesh.shape is None:
            return processes, n // processes
        from zshard.mesh import parse_mesh  # noqa: PLC0415

        try:
            return parse_mesh(self.mesh.shape)
        except ValueError as e:
            raise ConfigError(_key("mesh.shape"), str(e)) from None

    def warmup_steps(self) -> int:
        """``optimizer.warmup`` or 10% of ``training.steps``, at most ``steps - 1``."""
        w = self.training.steps // 10 if self.optimizer.warmup is None else self.optimizer.warmup
        return min(w, self.training.steps - 1)

    def resolved(self, n_devices: int | None = None, processes: int = 1) -> "Config":
        """A validated copy with every derived value written out: the canonical strategy (no
        ``zero_stage``), the mesh as ``RxS``, the device count, the preset's ``scan``, the
        warmup in steps and the data path made absolute. Running it repeats this run."""
        from train.model import MODEL_PRESETS  # noqa: PLC0415

        self.validate(n_devices, processes)
        r = Config.from_dict(self.to_dict())
        n = self.mesh.devices if n_devices is None else n_devices
        replica, shard = self.mesh_shape(n, processes)
        r.mesh.devices, r.mesh.shape = n // processes, f"{replica}x{shard}"  # devices: per process
        r.mesh.strategy, r.mesh.zero_stage = self.strategy(), None
        if r.model.scan is None:
            r.model.scan = MODEL_PRESETS[r.model.preset].scan
        r.optimizer.warmup = self.warmup_steps()
        if r.data.path is not None:
            r.data.path = str(Path(r.data.path).resolve())
        return r


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------


def load_file(path: str | Path) -> dict:
    """The nested dict of a ``.toml`` (or ``.json``) config file.

    Raises:
      ConfigError: the file is missing, unreadable, or not valid TOML/JSON (with the
        parser's line and column).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {str(p)!r}", "no such file; give a .toml file (presets: train/configs/*.toml)")
    try:
        text = p.read_bytes()
        if p.suffix == ".json":
            raw = json.loads(text)
        else:
            raw = tomllib.loads(text.decode())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--config {str(p)!r}", f"cannot be read as {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(p)!r}", "must hold a table of sections")
    return raw


def dumps_toml(cfg: Config, header: str = "") -> str:
    """``cfg`` as TOML (``tomli_w``), one table per section; ``header`` lines become comments."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + tomli_w.dumps(cfg.to_dict())


def _translate_aliases(raw: dict, source: str) -> dict:
    """FSDP / DeepSpeed names -> ours, refusing a field given twice."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    mesh = raw.setdefault("mesh", {})
    if not isinstance(mesh, dict):
        return raw
    if "sharding_strategy" in mesh:
        value = mesh.pop("sharding_strategy")
        if "strategy" in mesh:
            raise ConfigError("mesh.sharding_strategy", f"and mesh.strategy are both set in {source}; keep one")
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in FSDP_STRATEGY_NUMBERS:
                raise ConfigError("mesh.sharding_strategy", f"invalid choice: {value} (FSDP numbers: "
                                  + ", ".join(f"{k} {v}" for k, v in FSDP_STRATEGY_NUMBERS.items()) + ")")
            value = FSDP_STRATEGY_NUMBERS[value]
        if not isinstance(value, str):
            raise ConfigError("mesh.sharding_strategy", f"expected a name such as 'FULL_SHARD', got {value!r}")
        mesh["strategy"] = value
    if "zero_optimization" in raw:
        zo = raw.pop("zero_optimization")
        if not isinstance(zo, dict):
            raise ConfigError("zero_optimization", f"must be a table with 'stage', got {zo!r}")
        for key in zo:
            if key != "stage":
                raise ConfigError(f"zero_optimization.{key}", f"is not supported in {source}; zero_optimization allows: stage")
        if "stage" in zo:
            if "zero_stage" in mesh:
                raise ConfigError("zero_optimization.stage", f"and mesh.zero_stage are both set in {source}; keep one")
            mesh["zero_stage"] = zo["stage"]
    if not mesh:
        raw.pop("mesh")
    return raw


# ----------------------------------------------------------------------------------------
# Types, docs and flags
# ----------------------------------------------------------------------------------------


@functools.cache
def _field_type(cls: type, name: str) -> tuple[type, bool]:
    """``(base type, optional)`` of field ``name``: ``int | None`` -> ``(int, True)``."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        base = [a for a in args if a is not type(None)]
        return base[0], True
    return hint, False


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _check_type(key: str, value, kind: tuple[type, bool]):
    base, optional = kind
    if value is None and optional:
        return None
    ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(_key(key), f"expected {_TYPE_WORDS[base]}{' (or unset)' if optional else ''}, "
                          f"got {value!r} ({type(value).__name__})")
    return value


def _flag_of(cls: type, f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


@functools.cache
def flat_names() -> dict[str, tuple[str, str]]:
    """``{dest: (section, field)}``: each field under its flag's name (``--batch-size`` ->
    ``batch_size``, ``--model`` -> ``model`` for ``model.preset``): the ``dest`` of each flag
    of :func:`add_arguments`."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[_flag_of(cls, f).lstrip("-").replace("-", "_")] = (section, f.name)
    return out


def flag_of(key: str) -> str:
    """The command-line flag of ``section.field`` (``training.seed`` -> ``--seed``)."""
    section, name = key.split(".")
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    return _flag_of(SECTIONS[section], f)


def _key(key: str) -> str:
    """``section.field (--flag)``."""
    section, name = key.split(".")
    cls = SECTIONS[section]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f"{key} ({f.metadata.get('flag', '--' + name.replace('_', '-'))})"


def _choice(key: str, value, allowed: list) -> None:
    if value not in allowed:
        raise ConfigError(_key(key), f"invalid choice: {value!r} (choose from {', '.join(map(str, allowed))})")


def _at_least(key: str, value, low, strict: bool = False) -> None:
    bad = value <= low if strict else value < low
    if bad or value != value or value == float("inf"):
        raise ConfigError(_key(key), f"must be {'>' if strict else '>='} {low} and finite, got {value!r}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of dataclass ``cls`` (its documentation)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)
    return docs


def _parse_value(kind: tuple[type, bool]):
    base, optional = kind

    def parse(text: str):
        if optional and text.lower() in ("none", "null", ""):
            return None
        if base is str:
            return text
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_TYPE_WORDS[base]}, got {text!r}") from None

    parse.__name__ = base.__name__  # argparse names the type in its messages
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, in one argument group per section, with ``SUPPRESS`` defaults
    (only flags given on the command line appear in the namespace, under :func:`flat_names`).

    Flag names: ``--field-name`` (``--model``, ``--data``, ``--mesh`` for ``model.preset``,
    ``data.path``, ``mesh.shape``) and ``--section.field``; booleans also take ``--no-...``.
    Optional fields take ``none`` to unset them.
    """
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"[{section}]", cls.__doc__.split(": ", 1)[-1].replace("``", ""))
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            names = [flag, f"--{section}.{f.name}"]
            kind = _field_type(cls, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            help_text = docs.get(f.name, "") + ("" if default is None else f" (default: {default})")
            help_text = help_text.replace("%", "%%")
            dest = flag.lstrip("-").replace("-", "_")
            common = dict(dest=dest, default=argparse.SUPPRESS, help=help_text)
            if kind[0] is bool:
                parser_action = argparse.BooleanOptionalAction
                group.add_argument(*names, action=parser_action, **common)
            else:
                metavar = {int: "N", float: "X", str: "TEXT"}[kind[0]]
                group.add_argument(*names, type=_parse_value(kind), metavar=metavar, **common)


def from_args(args: argparse.Namespace, file_raw: dict | None = None, source: str = "config") -> Config:
    """Defaults < ``file_raw`` (from :func:`load_file`) < the flags in ``args`` (from a parser
    set up by :func:`add_arguments`). Types are checked; call :meth:`Config.validate` next.

    Raises:
      ConfigError: from :meth:`Config.from_dict`, or a flag that contradicts a file alias.
    """
    cfg = Config.from_dict(file_raw or {}, source)
    names = flat_names()
    for dest, value in vars(args).items():
        if dest in names:
            section, name = names[dest]
            setattr(getattr(cfg, section), name, value)
    if hasattr(args, "strategy") and not hasattr(args, "zero_stage"):
        cfg.mesh.zero_stage = None  # --strategy on the command line replaces a file's zero stage
    if hasattr(args, "zero_stage") and not hasattr(args, "strategy"):
        cfg.mesh.strategy = None  # and --zero-stage a file's strategy
    return cfg
