"""Typed, validated configuration of ``python -m train``: dataclasses in sections, TOML files.

A run is described by one :class:`Config`, built from three layers, later ones winning:

1. the defaults of the section dataclasses (``train/sections.py``);
2. a file, ``--config FILE`` (TOML, or JSON for DeepSpeed-style files), one table per
   section (``[model]``, ``[data]``, ``[mesh]``, ``[optimizer]``, ``[training]``,
   ``[precision]``, ``[checkpoint]``, ``[distributed]``, ``[logging]``);
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

The sections are ``train/sections.py``; files, types and flags ``train/flags.py`` (both
re-exported here).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import zshard
from train.flags import (
    ConfigError,
    add_arguments,
    at_least,
    check_type,
    choice,
    dumps_toml,
    field_docs,
    field_type,
    flag_of,
    flat_names,
    key_of,
    load_file,
    translate_aliases,
)
from train.model import MODEL_PRESETS, PLAN_PRESETS
from train.sections import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainingConfig,
)

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoggingConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "TrainingConfig",
    "add_arguments",
    "dumps_toml",
    "field_docs",
    "field_type",
    "flag_of",
    "flat_names",
    "from_args",
    "load_file",
]

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class Config:
    """The whole run: one attribute per section."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
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
        raw = translate_aliases(raw, source)
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
                setattr(sub, key, check_type(f"{section}.{key}", value, field_type(type(sub), key)))
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
        choice("model.preset", m.preset, [*MODEL_PRESETS, *PLAN_PRESETS])
        zoo = PLAN_PRESETS.get(m.preset) if m.init_from is None else None
        if zoo is not None and d.vocab_size is not None and d.vocab_size > zoo.vocab_size:
            raise ConfigError(key_of("data.vocab_size"), f"{d.vocab_size} > the vocabulary of model.preset {m.preset!r} "
                              f"({zoo.vocab_size}): a zoo preset keeps its own vocabulary; give a token file of at most "
                              f"{zoo.vocab_size} tokens, or a preset of {', '.join(MODEL_PRESETS)} (--vocab-size sets theirs)")
        at_least("model.seq_len", m.seq_len, 1)
        if d.path is not None and not d.path:
            raise ConfigError(key_of("data.path"), "is empty; give a text file, or leave it unset for the stdlib corpus")
        at_least("data.eval_batches", d.eval_batches, 1)
        if d.vocab_size is not None:
            at_least("data.vocab_size", d.vocab_size, 2)
        if d.token_dtype is not None:
            choice("data.token_dtype", d.token_dtype, ["uint16", "uint32"])
        at_least("mesh.devices", me.devices, 1)
        if me.tensor is not None:
            at_least("mesh.tensor", me.tensor, 1)
        if me.context is not None:
            at_least("mesh.context", me.context, 1)
        if me.expert is not None:
            at_least("mesh.expert", me.expert, 1)
        self.strategy()  # a known name / stage, and not two that disagree
        replica, shard, tensor = self.mesh_shape(n, processes)
        context, expert = self.context(), self.expert()
        if replica * shard * expert * context * tensor != n:
            inner = expert * context * tensor  # devices of one (replica, shard) position
            shapes = ", ".join(f"{r}x{n // (r * inner)}" + (f"x{tensor}" if tensor > 1 else "")
                               for r in range(1, n + 1) if n % (r * inner) == 0)
            ctx = (f" x expert {expert}" if expert > 1 else "") + (f" x context {context}" if context > 1 else "")
            if shapes:
                fix = f"use a mesh of {n} devices ({shapes}{ctx})"
            elif expert > 1:  # expert x context x tensor does not divide the devices
                experts = [x for x in range(1, n + 1) if n % (x * context * tensor) == 0]
                fix = f"expert {expert} x context {context} x tensor {tensor} = {inner} does not divide {n}: use --expert " \
                      f"{_alternatives(experts)}"
            else:  # context x tensor does not divide the devices: no RxS fits, the inner axes must change
                contexts = [c for c in range(1, n + 1) if n % (c * tensor) == 0]
                fix = (f"context {context} x tensor {tensor} = {inner} does not divide {n}: use --context {_alternatives(contexts)}"
                       if contexts else f"tensor {tensor} does not divide {n}: use a tensor size of "
                       f"{_alternatives([t for t in range(1, n + 1) if n % t == 0])}")
            raise ConfigError(
                key_of("mesh.shape" if me.shape is not None else "mesh.expert" if expert > 1 else "mesh.context" if context > 1
                       else "mesh.tensor"),
                f"{me.shape or f'tensor = {tensor}'!r} is {replica}x{shard}{f'x{tensor}' if tensor > 1 else ''}{ctx} = "
                f"{replica * shard * inner} devices, but there are {n} (mesh.devices = {me.devices}); {fix}"
                + (f"; or --devices {replica * shard * inner}" if n == me.devices else ""),
            )
        if context > 1:
            if m.seq_len % (2 * context):
                lo = max(m.seq_len // (2 * context), 1) * 2 * context
                raise ConfigError(key_of("model.seq_len"), f"{m.seq_len} does not divide by 2 x mesh.context = {2 * context} "
                                  f"(the head-tail order cuts each sequence into 2 x context chunks); use e.g. {lo}")
            if processes > 1:
                raise ConfigError(key_of("mesh.context"), f"{context}: context parallelism in the main job runs in one "
                                  "process (each process reads whole rows of the batch); use one process, or unset it")
        at_least("optimizer.lr", o.lr, 0, strict=True)
        if o.warmup is not None:
            at_least("optimizer.warmup", o.warmup, 0)
        at_least("optimizer.weight_decay", o.weight_decay, 0)
        if o.clip_norm is not None:
            at_least("optimizer.clip_norm", o.clip_norm, 0, strict=True)
        at_least("training.steps", t.steps, 1)
        at_least("training.batch_size", t.batch_size, 1)
        at_least("training.grad_accum", t.grad_accum, 1)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(t, name) is not None:
                choice(f"training.{name}", getattr(t, name), list(DTYPES))
        self._validate_precision()
        choice("training.remat", t.remat, ["block", "dots", "none", "offload"])
        choice("mesh.unit", me.unit, ["blocks", "ends"])
        if me.offload is not None:
            choice("mesh.offload", me.offload, ["optimizer", "optimizer+master"])
            if me.offload == "optimizer+master" and t.param_dtype != "bfloat16":
                raise ConfigError(
                    key_of("mesh.offload"),
                    f"optimizer+master keeps a bf16 copy of the fp32 masters on the device, so it needs mixed precision: "
                    f"set training.param_dtype ({flag_of('training.param_dtype')}) to bfloat16 (it is {t.param_dtype}), "
                    "or use --offload optimizer",
                )
        if t.prefetch is not None:
            at_least("training.prefetch", t.prefetch, 0)
        if t.hpz and (self.strategy() != "FULL_SHARD" or replica == 1 or shard * context == 1):
            why = (f"mesh.strategy is {self.strategy()}" if self.strategy() != "FULL_SHARD" else
                   "the mesh has replica = 1 (the world gather is inside one node already)" if replica == 1 else
                   "the mesh has shard = 1 (the secondary partition would be the whole weights: SHARD_GRAD_OP)")
            raise ConfigError(key_of("training.hpz"), f"hpZ re-gathers FULL_SHARD's weights inside a node, but {why}; use "
                              "mesh.strategy FULL_SHARD on a mesh with replica > 1 and shard > 1, or unset training.hpz")
        at_least("training.seed", t.seed, 0)
        at_least("training.eval_every", t.eval_every, 0)
        at_least("training.watchdog", t.watchdog, 0)
        data = n // (tensor * context)  # the rows are split over replica x shard (x expert), not over tensor (nor context: sequences)
        unit = data * t.grad_accum  # the global batch splits over data devices x micro-batches
        if t.batch_size % unit:
            lo = max(unit, t.batch_size // unit * unit)
            accum = f" x training.grad_accum {t.grad_accum}" if t.grad_accum > 1 else ""
            where = (f"{data} data devices of the {replica}x{shard}x{tensor}" if tensor > 1 and context == 1
                     else f"{data} row devices (replica x shard) of the {replica}x{shard} x context {context}" if context > 1
                     else f"{n} devices of the {replica}x{shard}")
            raise ConfigError(
                key_of("training.batch_size"),
                f"{t.batch_size} does not divide by the {where} mesh{accum} "
                f"(the global batch is split over all data devices); use a multiple of {unit}, e.g. {lo} or {lo + unit}",
            )
        at_least("checkpoint.ckpt_every", c.ckpt_every, 0)
        if c.keep is not None:
            at_least("checkpoint.keep", c.keep, 1)
        if c.preempt_grace is not None:
            at_least("checkpoint.preempt_grace", c.preempt_grace, 0, strict=True, fix="leave it out for no limit")
        # [distributed]: types checked here; zshard.distributed.initialize checks the values.
        if lg.out is not None and not lg.out:
            raise ConfigError(key_of("logging.out"), "is empty; give a directory path, or leave it unset for a new runs/<date-time>")
        at_least("logging.sample_every", lg.sample_every, 0)
        at_least("logging.sample_tokens", lg.sample_tokens, 0)
        at_least("logging.temperature", lg.temperature, 0)
        if lg.prompt is not None and not lg.prompt:
            raise ConfigError(key_of("logging.prompt"), "is empty; give some text, or leave it unset for the held-out split's start")
        return self

    def _validate_precision(self) -> None:
        """``[precision]``: known format names, a block >= 0, and a format for a collective the
        strategy has (no shard-axis gather without shard axes, no replica reduction without replicas)."""
        pr, strategy = self.precision, zshard.Strategy.parse(self.strategy())
        at_least("precision.block", pr.block, 0)
        if pr.error_feedback and pr.reduce_format is None:
            raise ConfigError(key_of("precision.error_feedback"), "corrects the quantized gradient reduction; set "
                              "precision.reduce_format too (int4 is where it pays: docs/quantized.md)")
        if pr.error_feedback and strategy.scatters_replica:
            raise ConfigError(key_of("precision.error_feedback"), f"{strategy.value} reduces gradients into its optimizer "
                              "slices, which error feedback does not support; use HYBRID_SHARD or FULL_SHARD")
        for name in ("gather_format", "reduce_format", "replica_format"):
            value = getattr(pr, name)
            if value is None:
                continue
            try:
                zshard.Quant(value, block=pr.block or None)
            except ValueError as e:  # an unknown name (the known ones listed), an odd block for int4
                raise ConfigError(key_of(f"precision.{name}" if "format" in str(e) else "precision.block"), str(e)) from None
            if name != "replica_format" and not strategy.shard_axes:
                raise ConfigError(key_of(f"precision.{name}"), f"{value!r}: {strategy.value} keeps every parameter whole, so "
                                  "nothing is gathered or reduce-scattered over a shard axis; use precision.replica_format")
            if name == "replica_format" and not strategy.replica_axes:
                raise ConfigError(key_of(f"precision.{name}"), f"{value!r}: {strategy.value} reduces no gradient across "
                                  "replicas; use precision.reduce_format, or a HYBRID strategy")

    def mixed_precision(self) -> "zshard.MixedPrecision | None":
        """The run's ``zshard.MixedPrecision`` (``[training]`` dtypes, ``[precision]`` formats), or
        ``None`` when nothing is set (full precision)."""
        t, pr = self.training, self.precision
        formats = {k: zshard.Quant(v, block=pr.block or None, error_feedback=pr.error_feedback and k == "reduce_format") if v else None
                   for k, v in (("gather_format", pr.gather_format), ("reduce_format", pr.reduce_format),
                                ("replica_format", pr.replica_format))}
        if not (t.param_dtype or t.reduce_dtype or any(formats.values())):
            return None
        return zshard.MixedPrecision(param_dtype=t.param_dtype, reduce_dtype=t.reduce_dtype, **formats)

    # ---- derived values -----------------------------------------------------------------

    def strategy(self) -> str:
        """The strategy's canonical name (``zshard.Strategy.parse`` of ``mesh.strategy`` and
        ``mesh.zero_stage``); FULL_SHARD when neither is set.

        Raises:
          ConfigError: an unknown name or stage, or both given and disagreeing.
        """
        me = self.mesh
        if me.strategy is None and me.zero_stage is None:
            return zshard.Strategy.FULL_SHARD.value
        try:
            return zshard.Strategy.parse(me.strategy, zero_stage=me.zero_stage).value
        except ValueError as e:
            key = "mesh.zero_stage" if me.zero_stage is not None else "mesh.strategy"
            raise ConfigError(key_of(key), str(e)) from None

    def context(self) -> int:
        """``mesh.context`` (1 when unset): devices each sequence is split over."""
        return self.mesh.context or 1

    def expert(self) -> int:
        """``mesh.expert`` (1 when unset): devices each MoE layer's experts are split over."""
        return self.mesh.expert or 1

    def mesh_shape(self, n_devices: int | None = None, processes: int = 1) -> tuple[int, int, int]:
        """``(replica, shard, tensor)``: ``mesh.shape`` parsed (``RxS`` takes ``mesh.tensor``), or
        ``(processes, n_devices / (processes * expert * context * tensor), tensor)`` when unset (the
        expert and context axes: :meth:`expert`, :meth:`context`).

        Raises:
          ConfigError: an unknown shape, or ``RxSxT`` disagreeing with ``mesh.tensor``.
        """
        n = self.mesh.devices if n_devices is None else n_devices
        tensor = self.mesh.tensor or 1
        if self.mesh.shape is None:
            return processes, max(n // (processes * self.expert() * self.context() * tensor), 1), tensor
        try:
            shape = zshard.parse_mesh(self.mesh.shape)
        except ValueError as e:
            raise ConfigError(key_of("mesh.shape"), str(e)) from None
        if len(shape) == 3:
            if tensor not in (1, shape[2]):
                raise ConfigError(key_of("mesh.tensor"), f"{tensor} disagrees with mesh.shape {self.mesh.shape!r} "
                                  f"(tensor {shape[2]}); give one of them")
            return shape
        return shape[0], shape[1], tensor

    def model_config(self):
        """The model config of ``model.preset`` (its ``seq_len`` and ``scan`` from ``[model]``), before any
        ``model.init_from`` replaces it: a trainer preset (``train.model.MODEL_PRESETS``, a byte-level GPT)
        takes a token file's ``data.vocab_size`` as its vocabulary; a zoo preset (``train.model.PLAN_PRESETS``:
        GPT-2, Llama, the mixtures of experts) keeps its own, which bytes (256) and any token file
        :meth:`validate` lets through (``vocab_size`` at most the preset's) fit under."""
        m = self.model
        if m.preset in MODEL_PRESETS:
            cfg = dataclasses.replace(MODEL_PRESETS[m.preset], seq_len=m.seq_len)
            if self.data.vocab_size is not None:  # a token file: its vocabulary is the model's
                cfg = dataclasses.replace(cfg, vocab_size=self.data.vocab_size)
        else:
            cfg = dataclasses.replace(PLAN_PRESETS[m.preset], seq_len=m.seq_len)
        return cfg if m.scan is None else dataclasses.replace(cfg, scan=m.scan)

    def warmup_steps(self) -> int:
        """``optimizer.warmup`` or 10% of ``training.steps``, at most ``steps - 1``."""
        w = self.training.steps // 10 if self.optimizer.warmup is None else self.optimizer.warmup
        return min(w, self.training.steps - 1)

    def resolved(self, n_devices: int | None = None, processes: int = 1) -> "Config":
        """A validated copy with every derived value written out: the canonical strategy (no
        ``zero_stage``), the mesh as ``RxS`` (``RxSxT``), the device count, the preset's ``scan``, the
        warmup in steps, and the data path and ``model.init_from`` made absolute (so ``--config
        OUT/config.toml`` and ``--resume`` work from any folder). Running it repeats this run."""
        self.validate(n_devices, processes)
        r = Config.from_dict(self.to_dict())
        n = self.mesh.devices if n_devices is None else n_devices
        replica, shard, tensor = self.mesh_shape(n, processes)
        r.mesh.devices, r.mesh.shape = n // processes, f"{replica}x{shard}" + (f"x{tensor}" if tensor > 1 else "")  # devices: per process
        r.mesh.tensor = tensor if tensor > 1 else None
        r.mesh.context = self.context() if self.context() > 1 else None
        r.mesh.expert = self.expert() if self.expert() > 1 else None
        r.mesh.strategy, r.mesh.zero_stage = self.strategy(), None
        if r.model.scan is None:
            r.model.scan = self.model_config().scan
        r.optimizer.warmup = self.warmup_steps()
        if r.data.path is not None:
            r.data.path = str(Path(r.data.path).resolve())
        if r.model.init_from is not None:
            r.model.init_from = str(Path(r.model.init_from).resolve())
        return r


def _alternatives(sizes: list[int]) -> str:
    """``[1, 2, 4] -> "1, 2 or 4"``: the sizes an error suggests."""
    return " or ".join(filter(None, [", ".join(map(str, sizes[:-1])), str(sizes[-1])]))


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