"""``python -m train``: train the byte-level GPT with zshard; metrics, TensorBoard, samples, weights, summary.

(Over 400 lines on purpose: the five steps of one run, :func:`parse_config` -> :func:`validate`
-> :func:`build` -> :func:`train_loop` -> :func:`finish`, read top to bottom in one file.
What the run writes and prints, and Ctrl-C, live in ``train/output.py``; checkpoints and
the data iterator's state in ``train/checkpointing.py``.)

    python -m train                                        # defaults: train/configs/default.toml
    python -m train --config train/configs/nano.toml --steps 50 --mesh 2x4

Configuration (``train/config.py``): dataclass defaults < ``--config FILE`` (TOML) < flags;
every field has a flag (``--steps`` or ``--training.steps``; ``python -m train --help``).
One :class:`train.config.Config` carries it from the flags to the checkpoints.

Order of work (every check comes before any compile, and nothing is written until the
model has compiled and been evaluated once):

1. :func:`parse_config`: the flags and the config file, types checked (no jax yet); set
   ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` from ``mesh.devices`` before jax
   is imported (an accelerator, if JAX finds one, is used instead, N capping its devices);
2. :func:`validate`: model preset, mesh shape against the devices, global batch divisible
   by devices x micro-batches, the data, the output folder (:func:`choose_out`) and the
   checkpoints (``train/checkpointing.py``);
3. :func:`build`: the mesh, the sharded state (``zshard.init``, or the checkpoint with
   ``--resume``) and the step, compiled ahead of time for its per-device memory figures;
   evaluated once;
4. :func:`train_loop`: writes ``OUT/config.toml`` (``--config OUT/config.toml`` repeats the
   run), then trains, reading each step's metrics while the next step runs; evaluates every
   ``eval_every`` steps, samples text every ``sample_every`` steps and at the end, saves
   checkpoints every ``ckpt_every`` steps;
5. :func:`finish`: the weights to ``OUT/model.safetensors`` (``zshard.export``), then
   ``OUT/summary.json`` and one line saying what was written where.

Output folder: ``--out DIR``, or by default a new ``runs/<YYYYmmdd-HHMMSS>`` with the link
``runs/latest`` pointing at the newest. A run never writes into a folder that holds an
earlier run's files unless ``--overwrite`` (which removes them first) or ``--resume``
(which continues that run; without ``--out`` it continues ``runs/latest``).

``OUT/metrics.jsonl``: one JSON object per step (``loss``, ``grad_norm`` (nats per byte, its
gradient's global L2 norm), ``lr``, ``step_time_s`` (s, between the reads of consecutive
steps' metrics), ``tokens_per_s`` (over the last 10 steps), ``eval_loss`` at evaluations),
appended and flushed as each step's metrics are read: ``tail -f`` follows it, and a crash
loses at most the step in flight. (``--resume`` first replaces it, once, with the records
of the checkpoint it continues from.) TensorBoard events go to ``OUT/tb`` (every step),
samples to ``OUT/samples.txt`` (appended).

Ctrl-C (SIGINT) before training starts (parsing, compiling, the first evaluation) exits at
once with status 130 and one line, nothing written. During training it finishes the step
in flight, saves it when checkpointing is on (``--ckpt-every``), writes the weights and
the summary (marked ``"interrupted": true``) and exits 130; a second Ctrl-C exits 130 at
once (files written so far are whole: metrics lines are appended whole, the rest is
written atomically). Bad input exits with status 2 and one line naming the key, its flag
and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

_T_START = time.perf_counter()  # wall time counts from here (includes importing jax)

from train import output  # noqa: E402  (no jax)
from train.output import EXIT_INTERRUPTED, PROG, Interrupts, MetricsLog, TensorBoard, choose_out, say, write_atomic  # noqa: E402

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
EXIT_USAGE = 2  # bad input, as argparse
THROUGHPUT_WINDOW = 10  # steps: metrics' tokens_per_s is measured over this many steps


def set_host_device_count(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices; must run before ``import jax``.

    Appends ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS``, replacing an
    earlier value of that flag and keeping every other flag.
    """
    if "jax" in sys.modules:
        raise RuntimeError("set_host_device_count must run before jax is imported")
    flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_FLAG}={n}"])


def fail(message: str) -> None:
    """Bad input: ``python -m train: error: MESSAGE`` alone on stderr, exit status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


class _Parser(argparse.ArgumentParser):
    """Parses the flags, reads ``--config`` and returns ``Namespace(config=PATH, run=Config)``
    (defaults < file < flags); a bad file or value is :func:`fail` (one line, exit 2)."""

    def parse_known_args(self, args=None, namespace=None):
        from train import config  # noqa: PLC0415

        ns, rest = super().parse_known_args(args, namespace)
        path = getattr(ns, "config", None)
        try:
            cfg = config.from_args(ns, config.load_file(path) if path else {}, source=path or "config")
        except config.ConfigError as e:
            self.error(str(e))
        return argparse.Namespace(config=path, run=cfg), rest

    def error(self, message: str):
        fail(f"{message} ({PROG} --help lists the flags)" if "argument" in message or "unrecognized" in message else message)


def build_parser() -> argparse.ArgumentParser:
    """``--config FILE`` and one flag per configuration field (``train.config.add_arguments``).

    ``parse_args`` returns ``Namespace(config=PATH or None, run=Config)``.
    """
    from train import config  # noqa: PLC0415

    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Train a byte-level GPT with zshard (ZeRO-3 / FSDP sharding). Writes OUT/metrics.jsonl, "
        "OUT/summary.json, OUT/config.toml, OUT/samples.txt, OUT/model.safetensors and TensorBoard events in OUT/tb.",
        epilog="Values: defaults < --config FILE < flags. Optional fields take 'none'. Presets: train/configs/*.toml.",
    )
    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML (or JSON) file with [model] [data] [mesh] [optimizer] [training] [checkpoint] "
                   "[distributed] [logging] tables; flags override it")
    config.add_arguments(p)
    return p


def parse_config(argv: list[str]):
    """``argv`` -> ``(Config, config file or None)``; :func:`fail` on bad input (no jax imported)."""
    ns = build_parser().parse_args(argv)
    return ns.run, ns.config


def _multiprocess(run) -> bool:
    """A multi-process run? (its settings, ``python -m zshard.launch``'s variables, SLURM / Open MPI), without jax."""
    env = ("ZSHARD_COORDINATOR", "ZSHARD_NUM_PROCESSES", "ZSHARD_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE")
    d = run.distributed
    return any(v is not None for v in (d.coordinator, d.num_processes, d.process_id)) or any(os.environ.get(k) for k in env)


# ----------------------------------------------------------------------------------------
# The run. Functions below import jax inside: main() must set XLA_FLAGS first.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """Everything validated, before any compile.

    Attributes:
      run: the configuration (``train.config.Config``), type-checked and validated.
      resolved: ``run`` with every derived value written out (``Config.resolved``).
      cfg: the model shape (the preset, with ``seq_len`` and ``scan`` from the config).
      source: one line naming the corpus.
      train_data: uint8 ``[n_train]``, the training bytes, or uint16/uint32 tokens of a token file (a memmap).
      eval_data: the held-out bytes or tokens (last 10% of the corpus), same dtype.
      devices: the devices of the mesh.
      replica: size of the mesh's ``replica`` axis.
      shard: size of the mesh's ``shard`` axis.
      mesh: ``jax.sharding.Mesh`` of shape ``(replica, shard)``.
      out: the output directory (not created yet).
      link: ``runs/latest``, to point at ``out`` once it is written (``None``: no link).
      strategy: the strategy's name (``zshard.Strategy`` value).
      ckpt: the run's checkpoints (``None``: neither saving nor resuming).
      builder: with ``model.init_from``: the model builder of ``train.model.from_hf``, else ``None``.
      weights: with ``model.init_from``: its ``{path: tensor}`` (read when the state is built).
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


def _run_stamp() -> str:
    """``YYYYmmdd-HHMMSS`` of now, the same on every process (process 0's clock)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    now = int(time.time())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        now = int(multihost_utils.broadcast_one_to_all(np.int64(now)))
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def validate(run) -> Setup:
    """Check the configuration against the data, the devices and OUT; :func:`fail` (exit 2) on the first problem.

    Args:
      run: a type-checked ``train.config.Config``.
    """
    import jax  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train import checkpointing, data  # noqa: PLC0415
    from train.config import ConfigError  # noqa: PLC0415
    from train.model import MODEL_PRESETS  # noqa: PLC0415

    procs = jax.process_count()  # > 1: every device of every process (mesh.devices is then per process)
    try:
        devices = jax.devices() if procs > 1 else jax.devices()[: run.mesh.devices]  # an accelerator may have fewer
        run.validate(len(devices), procs)
        replica, shard = run.mesh_shape(len(devices), procs)
        strategy = run.strategy()
        resolved = run.resolved(len(devices), procs)
    except ConfigError as e:
        fail(str(e))
    cfg = dataclasses.replace(MODEL_PRESETS[run.model.preset], seq_len=run.model.seq_len)
    if run.model.scan is not None:
        cfg = dataclasses.replace(cfg, scan=run.model.scan)
    builder = weights = None
    if run.model.init_from is not None:
        builder, weights, cfg = _init_from(run)

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
    if run.data.vocab_size is not None and builder is None:  # a token file: its vocabulary is the model's
        cfg = dataclasses.replace(cfg, vocab_size=run.data.vocab_size)
    try:
        # no mesh.shape with several processes: one row per process (jax's hybrid-mesh helper)
        mesh = zshard.make_mesh() if procs > 1 and run.mesh.shape is None else zshard.make_mesh(replica, shard, devices=devices)
    except ValueError as e:
        fail(f"mesh.shape (--mesh) {run.mesh.shape!r}: {e}")
    try:
        out, link = choose_out(run, _run_stamp())
        ckpt = checkpointing.prepare(resolved, out, fresh=run.logging.overwrite and not run.checkpoint.resume)
    except ValueError as e:
        fail(str(e))
    return Setup(run, resolved, cfg, source, train_data, eval_data, devices, replica, shard, mesh, out, link, strategy, ckpt,
                 builder, weights)


def _init_from(run):
    """``model.init_from``: ``(builder, weights, model config)`` of a Hugging Face directory; exit 2 on a problem."""
    from train.model import GPTConfig, from_hf  # noqa: PLC0415

    key = "model.init_from (--init-from)"
    try:
        builder, weights = from_hf(run.model.init_from)
    except (OSError, ValueError) as e:
        fail(f"{key} {run.model.init_from!r}: {e}")
    cfg = builder.config
    need, what = (run.data.vocab_size, f"--vocab-size {run.data.vocab_size}") if run.data.vocab_size else (256, "the byte-level data")
    if cfg.vocab_size < need:
        fail(f"{key}: the checkpoint's vocab_size is {cfg.vocab_size}; {what} needs >= {need} tokens")
    if isinstance(cfg, GPTConfig) and run.model.seq_len > cfg.seq_len:
        fail(f"model.seq_len (--seq-len) {run.model.seq_len} > the checkpoint's n_positions {cfg.seq_len}; lower --seq-len")
    return builder, weights, cfg  # (model.preset and model.scan do not apply: the checkpoint's layers are a list)


def make_optimizer(run):
    """AdamW with linear warmup and cosine decay to ``lr / 10``; returns ``(tx, warmup steps, schedule)``.

    Warmup step ``t`` (0-based) uses ``lr * (t + 1) / (warmup + 1)``: the first step already
    moves the weights (a schedule from 0 would spend step 0 on Adam's moments alone), and
    step ``warmup`` reaches ``lr`` (nanoGPT's ``get_lr``, the same line).

    Weight decay applies to kernels and embeddings only (the mask goes by name).
    ``optimizer.clip_norm`` goes to the step (``make_train_step(clip_norm=...)``), which is
    the same as ``optax.clip_by_global_norm`` first in the chain (docs/optimizers.md).
    """
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    o, steps = run.optimizer, run.training.steps
    warmup = run.warmup_steps()
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=o.lr / (warmup + 1), peak_value=o.lr, warmup_steps=warmup, decay_steps=steps, end_value=o.lr / 10
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)

    tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=o.weight_decay, mask=decay_mask)
    return tx, warmup, schedule


def make_evaluator(state, batches: list, prefetch: int | None = None):
    """``evaluate(state) -> float``: mean next-byte cross-entropy (nats) over ``batches``.

    Runs the sharded, forward-only ``zshard.make_eval_step`` (each unit gathered just in
    time, never the whole model on one device). ``evaluate.compiled`` is the compiled eval
    step (its ``memory_analysis()`` goes to the summary).

    Args:
      state: a ``zshard.ShardedState``.
      batches: global ``(inputs, targets)`` pairs, int32 ``[B, T]`` each (with several
        processes, each passes its own rows ``[i*B/P, (i+1)*B/P)`` to the step).
      prefetch: units gathered ahead (``training.prefetch``, as the train step).
    """
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train.model import cross_entropy_loss  # noqa: PLC0415

    i, procs = jax.process_index(), jax.process_count()
    local = [tuple(x[i * (len(x) // procs):(i + 1) * (len(x) // procs)] for x in b) for b in batches]
    step = zshard.make_eval_step(cross_entropy_loss, prefetch=prefetch)

    def evaluate(state) -> float:
        return float(np.mean([float(step(state, b)["loss"]) for b in local]))

    evaluate.compiled = step.lower(state, local[0]).compile()
    return evaluate


def make_sampler(seq_len: int, prefetch: int | None = None):
    """``sample(state, prompt, n, temperature, seed) -> list[int]``: ``n`` tokens generated after ``prompt`` (token ids).

    Sharded generation with a KV cache (``train.generate.generate``: each unit gathered per
    decoding step, never the whole model). The context is at most ``seq_len`` bytes: when
    it is full, generation continues from the last ``seq_len // 2`` bytes. Greedy when
    ``temperature == 0``; the draws depend only on ``seed`` (and the chunk). ``prefetch``:
    units gathered ahead (``training.prefetch``).
    """
    from train.generate import generate  # noqa: PLC0415

    def sample(state, prompt: list[int], n: int, temperature: float, seed: int) -> list[int]:
        tokens, chunk = list(prompt[-(seq_len // 2):] if len(prompt) >= seq_len else prompt), 0
        new: list[int] = []
        while len(new) < n:
            ctx = tokens[-(seq_len // 2):] if len(tokens) >= seq_len else tokens
            k = min(n - len(new), seq_len - len(ctx))
            out = generate(state, [ctx], k, temperature=temperature, seed=(seed * 1000 + chunk) % 2**31, prefetch=prefetch)[0]
            tokens += out.tolist()
            new += out.tolist()
            chunk += 1
        return new  # ids; train.output.format_sample prints bytes as text, other tokens as ids

    return sample


@dataclasses.dataclass
class Built:
    """The compiled run, before any file is written.

    Attributes:
      state: the sharded train state (``zshard.ShardedState``), fresh or resumed.
      step: the ``zshard.TrainStep``.
      batches: this process's batches (``train.checkpointing.BatchStream``), positioned.
      batch: the first batch of this run (already drawn).
      schedule: the learning-rate schedule (optax), for the ``lr`` of each record.
      warmup: warmup steps.
      records: the metrics records the run continues (a resumed checkpoint's), else ``None``.
      start: the step this run continues after (0 for a fresh run).
      compile_s: seconds to compile the step.
      per_device_bytes: the compiled step's ``memory_analysis()`` (argument/output/temp/alias), or ``None``.
      report: ``zshard.report`` of the step (``--report``), or ``None``.
      evaluate: ``evaluate(state) -> float``, the held-out loss.
      sample: ``sample(state, prompt, n, temperature, seed) -> list[int]`` (token ids).
      eval_loss0: the held-out loss this run starts from (measured, or the checkpoint's last).
      eval_step0: the step of ``eval_loss0``.
    """

    state: object
    step: object
    batches: object
    batch: object
    schedule: object
    warmup: int
    records: list | None
    start: int
    compile_s: float
    per_device_bytes: dict | None
    report: object
    evaluate: object
    sample: object
    eval_loss0: float
    eval_step0: int


def build(setup: Setup) -> Built:
    """Model, optimizer, sharded state (or the resumed checkpoint), the step compiled; one evaluation."""
    import grain  # noqa: PLC0415
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train import checkpointing, data  # noqa: PLC0415
    from train.model import GPT, cross_entropy_loss, units_with_ends  # noqa: PLC0415

    run, ckpt = setup.run, setup.ckpt
    t_cfg = run.training
    tx, warmup, schedule = make_optimizer(run)
    mp = None
    if t_cfg.param_dtype or t_cfg.reduce_dtype:
        mp = zshard.MixedPrecision(param_dtype=t_cfg.param_dtype, reduce_dtype=t_cfg.reduce_dtype)
    make_model = setup.builder or (lambda: GPT(setup.cfg, rngs=nnx.Rngs(t_cfg.seed)))  # noqa: E731
    shard = grain.sharding.ShardByJaxProcess()  # this process's rows of each global batch
    batches = checkpointing.BatchStream(setup.train_data, t_cfg.batch_size, run.model.seq_len, t_cfg.seed,
                                        process_index=shard.shard_index, process_count=shard.shard_count)
    records = None
    unit = units_with_ends if run.mesh.unit == "ends" else None  # None: zshard's default wrap policy (blocks)
    if ckpt is not None and ckpt.resuming:  # state, batch position and records of the checkpoint
        try:
            state, records = ckpt.restore(make_model, tx, setup.mesh, batches, strategy=setup.strategy, mixed_precision=mp,
                                          unit=unit)
        except checkpointing.ResumeError as e:
            fail(str(e))
    else:
        state = zshard.init(make_model, tx, setup.mesh, strategy=setup.strategy, mixed_precision=mp, params=setup.weights,
                            unit=unit)
    start = 0 if ckpt is None else ckpt.start
    step = zshard.make_train_step(cross_entropy_loss, grad_accum=t_cfg.grad_accum, clip_norm=run.optimizer.clip_norm,
                                  skip_nonfinite=t_cfg.skip_nonfinite, remat=t_cfg.remat, prefetch=t_cfg.prefetch)
    batch = next(batches)

    t0 = time.perf_counter()
    # Ahead-of-time compile for the memory figures; `step(state, batch)` later reuses the
    # compiled executable (JAX caches compilations), it only traces the step once more.
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    per_device_bytes = None
    if mem is not None:
        per_device_bytes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    report = zshard.report(step, state, batch) if run.logging.report else None

    eval_set = data.eval_batches(setup.eval_data, t_cfg.batch_size, run.model.seq_len, run.data.eval_batches)
    evaluate = make_evaluator(state, eval_set, t_cfg.prefetch)
    sample = make_sampler(run.model.seq_len, t_cfg.prefetch)
    if start:  # the checkpointed run's last evaluation
        last = [r for r in records if "eval_loss" in r][-1]
        eval_loss0, eval_step0 = last["eval_loss"], last["step"]
    else:
        eval_loss0, eval_step0 = evaluate(state), 0
    return Built(state, step, batches, batch, schedule, warmup, records, start, compile_s, per_device_bytes, report,
                 evaluate, sample, eval_loss0, eval_step0)


@dataclasses.dataclass
class Progress:
    """What the loop did: the final state, the records, the last step trained, timings."""

    state: object
    records: list
    last: int
    interrupted: bool
    train_s: float
    eval_s: float
    saved: list


def start_output(setup: Setup, b: Built) -> None:
    """Create OUT (``--overwrite``: remove the earlier run's files first), point ``runs/latest``
    at it, write ``config.toml``; rank 0 only."""
    from train import config  # noqa: PLC0415

    out = setup.out
    if not output.WRITES_FILES:
        return
    if setup.run.logging.overwrite and not b.start:
        output.clear_earlier_run(out)
    out.mkdir(parents=True, exist_ok=True)
    if setup.link is not None:
        output.point_latest(setup.link, out)
    (out / "summary.json").unlink(missing_ok=True)  # a resumed run's summary is written again at its end
    header = (f"Resolved configuration of the run in {out}, written by {PROG}.\n"
              f"Repeat it with: {PROG} --config {out / 'config.toml'} (a new runs/<date-time>, or --out DIR)")
    again = config.Config.from_dict(setup.resolved.to_dict())
    again.logging.out, again.logging.overwrite, again.checkpoint.resume = None, False, False  # where, not what
    write_atomic(out / "config.toml", config.dumps_toml(again, header))


def train_loop(setup: Setup, b: Built, interrupts: Interrupts) -> Progress:
    """Train from step ``b.start + 1`` to ``training.steps``: metrics, evaluations, samples, checkpoints."""
    import numpy as np  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    from train import data  # noqa: PLC0415

    run, out, ckpt = setup.run, setup.out, setup.ckpt
    t_cfg, lg = run.training, run.logging
    state, step, batches, batch = b.state, b.step, b.batches, b.batch
    records = list(b.records) if b.start else [{"step": 0, "eval_loss": b.eval_loss0}]
    metrics_log = MetricsLog(out / "metrics.jsonl")
    metrics_log.start(records)
    tb = TensorBoard(out / "tb" if lg.tensorboard and output.WRITES_FILES else None)
    if not b.start:
        tb.log(records[0])
    tokens_per_step = t_cfg.batch_size * run.model.seq_len  # tokens (bytes for text)
    lrs = np.asarray(b.schedule(np.arange(t_cfg.steps)))  # lr of step i is lrs[i - 1] (optax count before the update)
    byte_level = run.data.vocab_size is None  # else a token file: samples are token ids
    if lg.prompt is not None:
        prompt = list(lg.prompt.encode()) if byte_level else data.parse_token_prompt(lg.prompt, run.data.vocab_size)
    else:
        prompt = [int(t) for t in setup.eval_data[: min(64, run.model.seq_len // 2)]]
    first_step = b.start + 1
    bar = tqdm(total=t_cfg.steps, initial=first_step - 1, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
               disable=not output.WRITES_FILES)
    t_train = t_last = time.perf_counter()
    recent_times: list[float] = []  # seconds per step, the last THROUGHPUT_WINDOW steps
    eval_s = 0.0  # time spent evaluating and sampling inside the training loop, s
    saved: list[int] = []

    def write_sample(i: int) -> None:
        new = b.sample(state, prompt, lg.sample_tokens, lg.temperature, t_cfg.seed + i)
        text = output.format_sample(i, prompt, new, lg.temperature, byte_level)
        if output.WRITES_FILES:
            bar.clear()
            print(text, flush=True)
            bar.refresh()
            with open(out / "samples.txt", "a", encoding="utf-8") as f:
                f.write(f"{text}\n")

    def record(i: int, metrics) -> dict:
        """Read step ``i``'s metrics (waits for that step only), log them, stop on a non-finite loss."""
        nonlocal t_last
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        now = time.perf_counter()
        # Step time = between the reads of consecutive steps' metrics. With asynchronous
        # dispatch one step's time can land on its neighbour, so tokens/s is taken over the
        # last THROUGHPUT_WINDOW steps (evaluation and sampling time left out).
        recent_times.append(now - t_last)
        del recent_times[:-THROUGHPUT_WINDOW]
        rec = {"step": i, "loss": loss, "grad_norm": grad_norm, "lr": float(lrs[i - 1]),
               "tokens_per_s": tokens_per_step * len(recent_times) / sum(recent_times), "step_time_s": now - t_last}
        nonfinite = int(metrics["nonfinite"])  # the same on every device (reduced over the mesh)
        if nonfinite:
            rec["skipped"] = int(t_cfg.skip_nonfinite)
        t_last = now
        records.append(rec)
        tb.log(rec)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)
        if nonfinite and not t_cfg.skip_nonfinite:
            bar.close()
            metrics_log.write(records)
            metrics_log.close()
            tb.close()
            raise SystemExit(
                f"{PROG}: error: non-finite loss {loss} / grad norm {grad_norm} at step {i}; lower --lr "
                f"(now {run.optimizer.lr}), add --clip-norm, or pass --skip-nonfinite to skip such steps"
            )
        return rec

    interrupts.training()
    pending = None  # (step number, metrics) dispatched but not yet read
    last = first_step - 1  # the last step whose metrics were read
    try:
        for i in range(first_step, t_cfg.steps + 1):
            state, metrics = step(state, batch)  # donates the old `state`
            if pending is not None:
                last = record(*pending)["step"]  # step i-1 finishes while step i is queued: no per-step sync
            pending = (i, metrics)
            stop = interrupts.pending
            is_eval = i == t_cfg.steps or (t_cfg.eval_every and i % t_cfg.eval_every == 0)
            is_sample = i == t_cfg.steps or (lg.sample_every and i % lg.sample_every == 0)
            if is_eval or is_sample or stop:
                rec = record(*pending)
                pending, last = None, i
                t_eval = time.perf_counter()
                if is_eval and not stop:
                    rec["eval_loss"] = b.evaluate(state)
                    tb.log({"step": i, "eval_loss": rec["eval_loss"]})
                    say(f"step {i}: train loss {rec['loss']:.4f}, eval loss {rec['eval_loss']:.4f}")
                if is_sample and not stop:
                    write_sample(i)
                eval_s += time.perf_counter() - t_eval
                t_last = time.perf_counter()  # evaluation time is not training throughput
            if ckpt is not None and (ckpt.due(i) or (stop and ckpt.every)):
                if pending is not None:  # after the evaluation, so the records hold step i whole
                    last = record(*pending)["step"]
                    pending = None
                ckpt.save(state, i, batches, records)  # `batches` has drawn i batches
                saved.append(i)
                say(f"step {i}: saving checkpoint {ckpt.directory / str(i)} (in the background)")
            metrics_log.write(records)  # the records read so far, appended and flushed
            if stop:
                break
            if i < t_cfg.steps:
                batch = next(batches)
        if pending is not None:
            last = record(*pending)["step"]
            metrics_log.write(records)
    finally:
        if ckpt is not None:
            ckpt.close()  # wait for the last checkpoint to be complete on disk
        bar.close()
        tb.close()
        metrics_log.close()
    return Progress(state, records, last, bool(interrupts.pending), time.perf_counter() - t_train, eval_s, saved)


def finish(setup: Setup, b: Built, p: Progress) -> dict:
    """Save the weights (``OUT/model.safetensors``), write ``OUT/summary.json``, print what was written. Returns the summary."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import zshard  # noqa: PLC0415

    run, out = setup.run, setup.out
    t_cfg = run.training
    weights = out / "model.safetensors"
    eval_mem = b.evaluate.compiled.memory_analysis()
    zshard.export(p.state, weights)  # every process gathers; process 0 writes
    losses = [r["loss"] for r in p.records if "loss" in r]
    evals = [r for r in p.records if "eval_loss" in r]
    tokens_per_step = t_cfg.batch_size * run.model.seq_len
    steps_done = p.last - b.start
    summary = {
        "strategy": setup.strategy,
        "mesh": {"replica": setup.replica, "shard": setup.shard},
        "devices": len(setup.devices),
        "processes": jax.process_count(),
        "platform": setup.devices[0].platform,
        "model": {"preset": run.model.preset, "config": dataclasses.asdict(setup.cfg)},
        "num_params": p.state.plan.num_params(),
        "steps": t_cfg.steps,
        "steps_done": p.last,  # the last step trained (== steps unless interrupted)
        "resumed_from": b.start,  # 0: a fresh run
        "interrupted": p.interrupted,
        "batch_size": t_cfg.batch_size,  # global, sequences
        "seq_len": run.model.seq_len,  # tokens
        "tokens_per_step": tokens_per_step,
        "lr": run.optimizer.lr,
        "param_dtype": t_cfg.param_dtype or "float32",
        "reduce_dtype": t_cfg.reduce_dtype or t_cfg.param_dtype or "float32",
        "grad_accum": t_cfg.grad_accum,  # micro-batches per step
        "clip_norm": run.optimizer.clip_norm,
        "scan": setup.cfg.scan,
        "warmup": b.warmup,  # steps
        "weight_decay": run.optimizer.weight_decay,
        "seed": t_cfg.seed,
        "data": {
            "source": setup.source,
            "vocab_size": run.data.vocab_size or 256,  # a token file's --vocab-size, or bytes
            "train_tokens": len(setup.train_data),  # bytes for text
            "eval_tokens": len(setup.eval_data),
            **({"train_bytes": len(setup.train_data), "eval_bytes": len(setup.eval_data)} if run.data.vocab_size is None else {}),
            "eval_sequences": run.data.eval_batches * t_cfg.batch_size,
        },
        "final_train_loss": losses[-1] if losses else None,  # nats per token (byte), last step
        "final_train_loss_mean10": float(np.mean(losses[-10:])) if losses else None,  # mean of the last 10 steps
        "initial_eval_loss": evals[0]["eval_loss"],  # step 0 (of the first run, when resumed)
        "final_eval_loss": evals[-1]["eval_loss"],  # at step final_eval_step
        "final_eval_step": evals[-1]["step"],
        "per_device_bytes": b.per_device_bytes,  # from the compiled step's memory_analysis()
        "eval_per_device_bytes": None if eval_mem is None else {  # the sharded eval step's
            k: int(getattr(eval_mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp")},
        "model_bytes": sum(int(v.get_value().size) * v.get_value().dtype.itemsize for _, v in p.state.plan.template),
        "init_from": run.model.init_from,
        **({"report": b.report.to_dict()} if b.report is not None else {}),
        "compile_s": b.compile_s,
        "train_s": p.train_s,  # the training loop, evaluations included
        "eval_s": p.eval_s,  # evaluations and samples inside the loop
        "tokens_per_s": tokens_per_step * steps_done / max(p.train_s - p.eval_s, 1e-9),
        "weights": str(weights),  # safetensors, logical shapes (zshard.export)
        # the saved checkpoints still on disk (checkpoint.keep deletes the oldest)
        "checkpoints": [str(setup.ckpt.directory / str(s)) for s in p.saved
                        if (setup.ckpt.directory / str(s)).is_dir()] if setup.ckpt is not None else [],
        "wall_s": time.perf_counter() - _T_START,  # whole program, imports included
        "config": setup.resolved.to_dict(),
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(summary_line(summary, b, out), file=sys.stderr, flush=True)  # every rank: what it trained and evaluated
    return summary


def summary_line(summary: dict, b: Built, out: Path) -> str:
    """The last line: what the run did (evaluations of this run only) and every file it wrote."""
    last, steps = summary["steps_done"], summary["steps"]
    unit = "nats/byte" if "train_bytes" in summary["data"] else "nats/token"
    what = f"interrupted after step {last} of {steps}" if summary["interrupted"] else f"{steps} steps"
    if b.start:
        what += f" (resumed after step {b.start})"
    if summary["final_eval_step"] > b.eval_step0:
        evals = (f"eval loss {b.eval_loss0:.4f} (step {b.eval_step0}) -> {summary['final_eval_loss']:.4f} {unit} "
                 f"(step {summary['final_eval_step']})")
    else:
        evals = f"no evaluation in this run (the last: {b.eval_loss0:.4f} {unit} at step {b.eval_step0})"
    if summary["final_train_loss"] is not None:
        evals += f"; last train loss {summary['final_train_loss']:.4f}"
    names = [n for n in ("metrics.jsonl", "summary.json", "config.toml", "samples.txt", "tb", "checkpoints", "model.safetensors")
             if (out / n).exists()]
    wrote = f"wrote {', '.join(n + ('/' if (out / n).is_dir() else '') for n in names)} in {out}"
    if not output.WRITES_FILES:
        wrote = "rank 0 writes the files"
    return f"{PROG}: {what}; {evals}; {summary['wall_s']:.0f} s wall; {wrote}"


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    interrupts = Interrupts()  # first: Ctrl-C while importing or compiling exits 130 at once
    argv = sys.argv[1:] if argv is None else list(argv)
    run, config_path = parse_config(argv)
    devices_given = any(a.split("=")[0] in ("--devices", "--mesh.devices") for a in argv) or (
        config_path is not None and "devices" in _load(config_path).get("mesh", {}))
    if not (_multiprocess(run) and not devices_given and _DEVICE_FLAG in os.environ.get("XLA_FLAGS", "")):
        set_host_device_count(run.mesh.devices if run.mesh.devices >= 1 else 1)  # (the launcher's per-process count stands)

    import jax  # noqa: PLC0415

    import zshard.distributed  # noqa: PLC0415

    try:  # before anything touches a device; checks coordinator / num_processes / process_id
        d = run.distributed
        zshard.distributed.initialize(d.coordinator, d.num_processes, d.process_id)
    except (ValueError, RuntimeError, TimeoutError) as e:
        fail(str(e))
    output.WRITES_FILES = jax.process_index() == 0

    setup = validate(run)
    say(f"{PROG}: {run.model.init_from or run.model.preset + ' GPT'}, {setup.strategy} on a {setup.replica}x{setup.shard} (replica x shard) mesh of "
        f"{len(setup.devices)} {setup.devices[0].platform} devices; data: {setup.source}: {len(setup.train_data):,} train / "
        f"{len(setup.eval_data):,} held-out {'bytes' if run.data.vocab_size is None else f'tokens (vocabulary {run.data.vocab_size})'}; "
        f"output: {setup.out}")
    b = build(setup)
    if b.report is not None and output.WRITES_FILES:
        print(b.report.table(), file=sys.stderr)
    start_output(setup, b)
    if b.start:
        say(f"compiled in {b.compile_s:.1f} s; {b.state.plan.num_params():,} parameters; resumed after step {b.start} "
            f"(eval loss {b.eval_loss0:.4f} at step {b.eval_step0})")
    else:
        say(f"compiled in {b.compile_s:.1f} s; {b.state.plan.num_params():,} parameters; eval loss {b.eval_loss0:.4f} before training")
    progress = train_loop(setup, b, interrupts)
    finish(setup, b, progress)
    return EXIT_INTERRUPTED if progress.interrupted else 0


def _load(path: str) -> dict:
    from train import config  # noqa: PLC0415

    return config.load_file(path)


if __name__ == "__main__":
    sys.exit(main())
