"""The validated job of ``python -m train``: the configuration checked against the data, the
devices and the output folder, before anything compiles (:func:`validate` -> :class:`Setup`),
and the optimizer it asks for (:func:`make_optimizer`).

Every problem is :func:`train.cli.fail`: one line naming the key, its flag and the fix, exit
status 2; nothing is written.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import zshard
from train import checkpointing, data
from train.cli import fail
from train import config
from train.config import ConfigError
from train.flags import key_of
from train.hf.files import Tensor
from train.model import MODEL_PRESETS, GPTConfig, build_model, expert_plan, from_hf, tensor_plan
from train.output import choose_out

__all__ = ["Setup", "is_run_folder", "make_optimizer", "preset_description", "validate"]


@dataclasses.dataclass
class Setup:
    """Everything validated, before any compile.

    Attributes:
      run: the configuration (``train.config.Config``), type-checked and validated.
      resolved: ``run`` with every derived value written out (``Config.resolved``).
      cfg: the model shape (``Config.model_config``: the preset, with ``seq_len`` and ``scan`` from the
        config; a trainer preset with a token file's vocabulary), or the ``init_from`` checkpoint's.
      source: one line naming the corpus.
      train_data: uint8 ``[n_train]``, the training bytes, or uint16/uint32 tokens of a token file (a memmap).
      eval_data: the held-out bytes or tokens (last 10% of the corpus), same dtype.
      devices: the devices of the mesh.
      replica: size of the mesh's ``replica`` axis.
      shard: size of the mesh's ``shard`` axis.
      mesh: ``jax.sharding.Mesh`` of shape ``(replica, shard)``, with ``expert`` (``mesh.expert > 1``),
        ``context`` (``mesh.context > 1``) and ``tensor`` (``mesh.tensor > 1``) axes after them.
      out: the output directory (not created yet).
      link: ``runs/latest``, to point at ``out`` once it is written (``None``: no link).
      strategy: the strategy's name (``zshard.Strategy`` value).
      ckpt: the run's checkpoints (``None``: neither saving nor resuming).
      builder: with ``model.init_from``: the model builder (of ``train.model.from_hf``, or of
        the run folder's configuration), else ``None``.
      weights: with ``model.init_from``: its ``{path: tensor}`` (read when the state is built).
      model: what is trained, for the banner and ``summary.json``: ``{"name", "preset",
        "init_from", "model_type"}`` (``preset`` ``None`` with ``init_from``; ``model_type``: the
        Hugging Face ``model_type``, or a preset's family: ``"gpt"`` for a trainer preset, ``"llama"``,
        ``"moe"``, ``"gpt2"`` for a zoo preset, :func:`preset_description`).
    """

    run: object
    resolved: object
    cfg: object
    source: str
    train_data: object
    eval_data: object
    devices: list
    replica: int
    shard: int
    mesh: object
    out: Path
    link: Path | None
    strategy: str
    ckpt: object
    builder: object = None
    weights: object = None
    model: dict = dataclasses.field(default_factory=dict)


def preset_description(preset: str, cfg) -> dict:
    """``{"name", "model_type"}`` of a preset's model (``cfg``: :meth:`train.config.Config.model_config`):
    ``"tiny GPT"`` / ``"gpt"`` for a trainer preset, ``"llama-1b Llama"`` / ``"llama"`` for a zoo preset
    (``"gpt2"``, ``"llama"``, ``"gemma"``, ``"moe"``: the family of its ``train.models`` config)."""
    family = type(cfg).__name__.removesuffix("Config")
    if preset in MODEL_PRESETS:
        return {"name": f"{preset} GPT", "model_type": "gpt"}
    return {"name": f"{preset} {family}", "model_type": "gpt2" if family == "GPT" else family.lower()}


def _run_stamp() -> str:
    """``YYYYmmdd-HHMMSS`` of now, the same on every process (process 0's clock)."""
    now = int(time.time())
    if jax.process_count() > 1:
        now = int(multihost_utils.broadcast_one_to_all(np.int64(now)))
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def validate(run) -> Setup:
    """Check the configuration against the data, the devices and OUT; :func:`fail` (exit 2) on the first problem.

    Args:
      run: a type-checked ``train.config.Config``.
    """
    procs = jax.process_count()  # > 1: every device of every process (mesh.devices is then per process)
    try:
        devices = jax.devices() if procs > 1 else jax.devices()[: run.mesh.devices]  # an accelerator may have fewer
        run.validate(len(devices), procs)
        replica, shard, tensor = run.mesh_shape(len(devices), procs)
        strategy = run.strategy()
        resolved = run.resolved(len(devices), procs)
    except ConfigError as e:
        fail(str(e))
    cfg = run.model_config()  # a trainer preset (a token file's vocabulary), or a zoo preset (its own vocabulary)
    builder = weights = None
    model = {**preset_description(run.model.preset, cfg), "preset": run.model.preset, "init_from": None}
    if run.model.init_from is not None:
        builder, weights, cfg, model = _init_from(run)

    source = data.describe_source(run.data.path)
    try:
        train_data, eval_data = data.split_corpus(data.load_data(run.data.path, run.data.vocab_size, run.data.token_dtype))
        data.check_split(train_data, eval_data, run.model.seq_len, source=source)
    except ValueError as e:
        fail(f"data.path: {e}")
    if run.data.vocab_size is not None and run.logging.prompt is not None:
        try:
            data.parse_token_prompt(run.logging.prompt, run.data.vocab_size)
        except ValueError as e:
            fail(f"logging.prompt: {e}")
    try:  # the model's Megatron plan over the tensor axis: refused here, before the run's banner
        tensor_plan(cfg, tensor)
    except ValueError as e:
        key = key_of("mesh.shape" if run.mesh.shape is not None else "mesh.tensor")
        fail(f"{key} {run.mesh.shape if run.mesh.shape is not None else tensor!r}: {e}")
    expert = run.expert()
    try:  # the experts over the expert axis: a dense model, or X not dividing the experts, refused here
        expert_plan(cfg, expert)
    except ValueError as e:
        fail(f"{key_of('mesh.expert')} {expert}: {e}")
    try:
        # no mesh.shape with several processes: one row per process (jax's hybrid-mesh helper)
        if procs > 1 and run.mesh.shape is None and tensor == 1 and expert == 1:
            mesh = zshard.make_mesh()
        else:  # the expert axis only when there is one (zshard.make_mesh(expert=X): X > 1)
            mesh = zshard.make_mesh(None if procs > 1 and run.mesh.shape is None else replica,
                                    None if procs > 1 and run.mesh.shape is None else shard, tensor, context=run.context(),
                                    devices=devices, **({"expert": expert} if expert > 1 else {}))
    except ValueError as e:
        # an expert axis that zshard refuses (with context or tensor, or an expert group across hosts): name --expert
        fail(f"{key_of('mesh.expert')} {expert}: {e}" if expert > 1 else f"mesh.shape (--mesh) {run.mesh.shape!r}: {e}")
    if run.mesh.offload is not None:
        _check_pinned_host(run.mesh.offload, devices)
    try:
        out, link = choose_out(run, _run_stamp())
        ckpt = checkpointing.prepare(resolved, out, fresh=run.logging.overwrite and not run.checkpoint.resume)
    except ValueError as e:
        fail(str(e))
    return Setup(run, resolved, cfg, source, train_data, eval_data, devices, replica, shard, mesh, out, link, strategy, ckpt,
                 builder, weights, model)


def _check_pinned_host(mode: str, devices) -> None:
    """``mesh.offload`` needs ``pinned_host`` memory on every device (``zshard.init`` checks it too)."""
    for d in devices:
        kinds = [m.kind for m in d.addressable_memories()] if d.process_index == jax.process_index() else ["pinned_host"]
        if "pinned_host" not in kinds:
            fail(f"mesh.offload (--offload) {mode}: device {d} ({d.platform}) has no pinned_host memory (its memory kinds: "
                 f"{kinds}); host offload needs a backend with pinned host memory: leave --offload unset here")


def _init_from(run):
    """``model.init_from``: ``(builder, weights, model config, Setup.model)`` of a Hugging Face
    directory or a ``python -m train`` run folder; exit 2 on a problem."""
    key = "model.init_from (--init-from)"
    path = Path(run.model.init_from).resolve()
    try:
        builder, weights, desc = _load_weights(path)
    except (OSError, ValueError) as e:
        fail(f"{key} {run.model.init_from!r}: {e}")
    cfg = builder.config
    need, what = (run.data.vocab_size, f"--vocab-size {run.data.vocab_size}") if run.data.vocab_size else (256, "the byte-level data")
    if cfg.vocab_size < need:
        fail(f"{key}: the checkpoint's vocab_size is {cfg.vocab_size}; {what} needs >= {need} tokens")
    if isinstance(cfg, GPTConfig) and run.model.seq_len > cfg.seq_len:
        fail(f"model.seq_len (--seq-len) {run.model.seq_len} > the checkpoint's n_positions {cfg.seq_len}; lower --seq-len")
    # (model.preset and model.scan do not apply: the checkpoint's model is trained)
    return builder, weights, cfg, {"name": desc["name"], "preset": None, "init_from": str(path), "model_type": desc["model_type"]}


def is_run_folder(path: Path) -> bool:
    """A ``python -m train`` run folder (its ``config.toml``, and no Hugging Face ``config.json``)?"""
    return (path / "config.toml").is_file() and not (path / "config.json").is_file()


def _load_weights(path: Path, depth: int = 0):
    """``(builder, {path: tensor}, {"name", "model_type"})`` of a Hugging Face directory or a run folder.

    A run folder's model is its ``config.toml``'s (a preset, or its own ``init_from``'s model,
    followed); its weights are the newer of ``model.safetensors`` (the step ``summary.json``
    names) and the latest complete checkpoint (exported to a temporary file,
    ``zshard.export``). Raises ``FileNotFoundError`` / ``ValueError`` naming what is missing.
    """
    if not path.exists():
        raise FileNotFoundError("does not exist; give a Hugging Face model directory (config.json and safetensors) "
                                "or the folder of a python -m train run")
    if not is_run_folder(path):
        builder, weights = from_hf(path)
        kind = json.loads((path / "config.json").read_text()).get("model_type")
        return builder, weights, {"name": f"{kind} from {path}", "model_type": kind}
    if depth > 8:
        raise ValueError("its config.toml's model.init_from chain is longer than 8 runs (a loop?)")
    try:
        src = config.Config.from_dict(config.load_file(str(path / "config.toml")), str(path / "config.toml"))
    except ConfigError as e:
        raise ValueError(f"its config.toml cannot be read: {e}") from None
    file, step = _run_weights_file(path)
    if src.model.init_from is not None:  # a fine-tuned run: the model of its own source
        builder, _, desc = _load_weights(Path(src.model.init_from), depth + 1)
        mc = builder.config
    else:
        mc = src.model_config()
        desc = preset_description(src.model.preset, mc)

        def builder():
            return build_model(mc, nnx.Rngs(0))

        builder.config = mc
    return builder, _safetensors_weights(file), {"name": f"{desc['name']} trained in {path} (step {step})",
                                                 "model_type": desc["model_type"]}


def _run_weights_file(path: Path) -> tuple[Path, int]:
    """The newest weights of a run folder: ``(safetensors file, step)``; a checkpoint is exported to a temporary file."""
    summary = path / "summary.json"
    done = None
    if summary.is_file() and (path / "model.safetensors").is_file():
        s = json.loads(summary.read_text())
        done = s.get("steps_done") if s.get("weights") else None
    where = path / checkpointing.SUBDIR
    latest = zshard.Checkpointer(where).latest_step() if where.is_dir() else None
    if done is not None and (latest is None or done >= latest):
        return path / "model.safetensors", done
    if latest is None:
        raise FileNotFoundError("is a run folder with no weights: no model.safetensors named by its summary.json and no "
                                "complete checkpoint in checkpoints/")
    if jax.process_count() > 1:
        raise ValueError(f"the run's newest weights are checkpoint {latest} only; export them first, in one process: "
                         f"python -c \"import zshard; zshard.export('{where}', 'weights/model.safetensors')\" and give that "
                         "run's folder, or use one process")
    tmp = tempfile.TemporaryDirectory(prefix="zshard-init-from-")
    _TEMPORARY.append(tmp)  # removed when the process ends
    return zshard.export(where, Path(tmp.name) / "model.safetensors"), latest


_TEMPORARY: list = []


def _safetensors_weights(file: Path) -> dict:
    """``{dotted path: Tensor}`` of a ``zshard.export`` file, read one tensor at a time when called."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(file, framework="numpy") as f:
        shapes = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}

    def read(name):
        with safe_open(file, framework="numpy") as f:
            return f.get_tensor(name)

    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}
    return {name: Tensor(lambda name=name: read(name), shape, dtypes.get(code, np.float32)) for name, (shape, code) in shapes.items()}


def make_optimizer(run):
    """AdamW with linear warmup and cosine decay to ``lr / 10``; returns ``(tx, warmup steps, schedule)``.

    Warmup step ``t`` (0-based) uses ``lr * (t + 1) / (warmup + 1)``: the first step already
    moves the weights (a schedule from 0 would spend step 0 on Adam's moments alone), and
    step ``warmup`` reaches ``lr`` (nanoGPT's ``get_lr``, the same line).

    Weight decay applies to kernels and embeddings only (the mask goes by name).
    ``optimizer.clip_norm`` goes to the step (``make_train_step(clip_norm=...)``), which is
    the same as ``optax.clip_by_global_norm`` first in the chain (docs/optimizers.md).
    """
    o, steps = run.optimizer, run.training.steps
    warmup = run.warmup_steps()
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=o.lr / (warmup + 1), peak_value=o.lr, warmup_steps=warmup, decay_steps=steps, end_value=o.lr / 10
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)

    tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=o.weight_decay, mask=decay_mask)
    return tx, warmup, schedule
