"""``python -m train``: train the byte-level GPT with zshard; metrics, TensorBoard, samples, summary.

    python -m train                                        # defaults: train/configs/default.toml
    python -m train --config train/configs/nano.toml --steps 50 --mesh 2x4

Configuration (``train/config.py``): dataclass defaults < ``--config FILE`` (TOML) < flags;
every field has a flag (``--steps`` or ``--training.steps``; ``python -m train --help``).

Order of work (every check comes before any compile, and nothing is written to ``OUT``
until the model has compiled and been evaluated once):

1. parse the flags and the config file and check their types (no jax yet); set
   ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` from ``mesh.devices`` before jax
   is imported (an accelerator, if JAX finds one, is used instead, N capping its devices);
2. validate (``Config.validate``): model preset, mesh shape against the devices, global
   batch divisible by devices x micro-batches, ...; then the data file;
3. build the mesh, the sharded state (``zshard.init``) and the step, compile the step
   ahead of time for its per-device memory figures; evaluate once;
4. write ``OUT/config.toml`` (the resolved configuration: ``--config OUT/config.toml``
   repeats the run), then train, reading each step's metrics while the next step runs
   (no device-to-host sync per step); evaluate every ``eval_every`` steps, sample text
   every ``sample_every`` steps and at the end;
5. write ``OUT/metrics.jsonl`` (one JSON object per step: ``loss``, ``grad_norm`` (nats per
   byte, its gradient's global L2 norm), ``lr``, ``step_time_s`` (s, between the reads of
   consecutive steps' metrics), ``tokens_per_s`` (over the last 10 steps), ``eval_loss`` at
   evaluations; rewritten atomically at every
   evaluation, sample, 10 s of wall time and at the end), TensorBoard events under
   ``OUT/tb`` (every step), ``OUT/samples.txt`` (appended) and ``OUT/summary.json``.

Ctrl-C (SIGINT) finishes the step in flight, saves it when checkpointing is on
(``--ckpt-every``; ``train/checkpointing.py``), writes metrics and the summary (marked
``"interrupted": true``) and exits with status 130; a second Ctrl-C aborts at once.
Bad input exits with status 2 and a message naming the key, its flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

_T_START = time.perf_counter()  # wall time counts from here (includes importing jax)

PROG = "python -m train"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
METRICS_WRITE_EVERY_S = 10.0  # rewrite metrics.jsonl at least this often (wall seconds)
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


class _Parser(argparse.ArgumentParser):
    """Parses the flags, reads ``--config`` and returns the whole configuration as one flat
    namespace (``train.config.flat_names``: ``args.steps``, ``args.model``, ``args.ckpt_every``,
    ...; defaults < file < flags) plus ``args.config``; a bad file or value is ``error`` (exit 2)."""

    def parse_known_args(self, args=None, namespace=None):
        from train import config  # noqa: PLC0415

        ns, rest = super().parse_known_args(args, namespace)
        path = getattr(ns, "config", None)
        try:
            cfg = config.from_args(ns, config.load_file(path) if path else {}, source=path or "config")
        except config.ConfigError as e:
            self.error(str(e))
        return config.to_namespace(cfg, config=path), rest


def build_parser(*_unused) -> argparse.ArgumentParser:
    """``--config FILE`` and one flag per configuration field (``train.config.add_arguments``).

    ``parse_args`` returns the flat namespace of the whole configuration (see ``_Parser``);
    ``train.config.from_namespace`` makes it a ``Config``. (Positional arguments are ignored:
    model and strategy names are checked by ``Config.validate``.)
    """
    from train import config  # noqa: PLC0415

    p = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Train a byte-level GPT with zshard (ZeRO-3 / FSDP sharding). Writes OUT/metrics.jsonl, "
        "OUT/summary.json, OUT/config.toml, OUT/samples.txt and TensorBoard events in OUT/tb.",
        epilog="Values: defaults < --config FILE < flags. Optional fields take 'none'. Presets: train/configs/*.toml.",
    )
    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML (or JSON) file with [model] [data] [mesh] [optimizer] [training] [checkpoint] "
                   "[distributed] [logging] tables; flags override it")
    config.add_arguments(p)
    return p


# ----------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------


_WRITES_FILES = True  # False on every process but rank 0 of a multi-process run


def _multiprocess(argv: list[str], run) -> bool:
    """A multi-process run? (its settings, ``python -m zshard.launch``'s variables, SLURM / Open MPI), without jax."""
    env = ("ZSHARD_COORDINATOR", "ZSHARD_NUM_PROCESSES", "ZSHARD_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE")
    d = run.distributed
    return any(v is not None for v in (d.coordinator, d.num_processes, d.process_id)) or any(os.environ.get(k) for k in env)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``path.tmp`` and ``os.replace``: never half-written (rank 0 only)."""
    if not _WRITES_FILES:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_metrics(out: Path, records: list[dict]) -> None:
    """``OUT/metrics.jsonl``, rewritten whole (atomically): one JSON object per line, per step."""
    write_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))


class TensorBoard:
    """Scalars to TensorBoard event files in ``OUT/tb`` (``tensorboardX.SummaryWriter``), or nothing.

    Tags: ``train/loss``, ``train/grad_norm``, ``train/lr``, ``eval/loss`` (nats per byte,
    per step), ``perf/tokens_per_s``, ``perf/step_time_s``. View with
    ``tensorboard --logdir OUT/tb``.
    """

    TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "eval_loss": "eval/loss",
            "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s"}

    def __init__(self, logdir: Path | None):
        self.writer = None
        if logdir is not None:
            from tensorboardX import SummaryWriter  # noqa: PLC0415

            self.writer = SummaryWriter(str(logdir), flush_secs=10)

    def log(self, rec: dict) -> None:
        if self.writer is not None:
            for key, tag in self.TAGS.items():
                if key in rec:
                    self.writer.add_scalar(tag, rec[key], rec["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ----------------------------------------------------------------------------------------
# The run. Functions below import jax inside: main() must set XLA_FLAGS first.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """Everything validated, before any compile.

    Attributes:
      cfg: the model shape (the preset, with ``seq_len`` and ``scan`` from the config).
      source: one line naming the corpus.
      train_data: uint8 ``[n_train]``, the training bytes.
      eval_data: uint8 ``[n_eval]``, the held-out bytes (last 10% of the corpus).
      devices: the devices of the mesh.
      replica: size of the mesh's ``replica`` axis.
      shard: size of the mesh's ``shard`` axis.
      mesh: ``jax.sharding.Mesh`` of shape ``(replica, shard)``.
      out: the output directory (not created yet).
      strategy: the strategy's name (``zshard.Strategy`` value).
      builder: with ``model.init_from``: the model builder of ``train.model.from_hf``, else ``None``.
      weights: with ``model.init_from``: its ``{path: tensor}`` (read when the state is built).
    """

    cfg: object
    source: str
    train_data: object
    eval_data: object
    devices: list
    replica: int
    shard: int
    mesh: object
    out: Path
    strategy: str
    builder: object = None
    weights: object = None


def validate(parser: argparse.ArgumentParser, run) -> Setup:
    """Check the configuration against the data and the devices; ``parser.error`` (exit 2) on the first problem.

    Args:
      run: a type-checked ``train.config.Config``.
    """
    import jax  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train import data  # noqa: PLC0415
    from train.config import ConfigError  # noqa: PLC0415
    from train.model import MODEL_PRESETS  # noqa: PLC0415

    procs = jax.process_count()  # > 1: every device of every process (mesh.devices is then per process)
    try:
        devices = jax.devices() if procs > 1 else jax.devices()[: run.mesh.devices]  # an accelerator may have fewer
        run.validate(len(devices), procs)
        replica, shard = run.mesh_shape(len(devices), procs)
        strategy = run.strategy()
    except ConfigError as e:
        parser.error(str(e))
    cfg = dataclasses.replace(MODEL_PRESETS[run.model.preset], seq_len=run.model.seq_len)
    if run.model.scan is not None:
        cfg = dataclasses.replace(cfg, scan=run.model.scan)
    builder = weights = None
    if run.model.init_from is not None:
        builder, weights, cfg = _init_from(parser, run)

    source = data.describe_source(run.data.path)
    try:
        train_data, eval_data = data.split_corpus(data.load_corpus(run.data.path))
        data.check_split(train_data, eval_data, run.model.seq_len, source=source)
    except ValueError as e:
        parser.error(f"data.path: {e}")
    try:
        # no mesh.shape with several processes: one row per process (jax's hybrid-mesh helper)
        mesh = zshard.make_mesh() if procs > 1 and run.mesh.shape is None else zshard.make_mesh(replica, shard, devices=devices)
    except ValueError as e:
        parser.error(f"mesh.shape (--mesh) {run.mesh.shape!r}: {e}")

    out = Path(run.logging.out)
    if out.exists() and not out.is_dir():
        parser.error(f"logging.out (--out) {str(out)!r} exists and is not a directory; give a directory path")
    return Setup(cfg, source, train_data, eval_data, devices, replica, shard, mesh, out, strategy, builder, weights)


def _init_from(parser: argparse.ArgumentParser, run):
    """``model.init_from``: ``(builder, weights, model config)`` of a Hugging Face directory; exit 2 on a problem."""
    from train.model import GPTConfig, from_hf  # noqa: PLC0415

    key = "model.init_from (--init-from)"
    try:
        builder, weights = from_hf(run.model.init_from)
    except (OSError, ValueError) as e:
        parser.error(f"{key} {run.model.init_from!r}: {e}")
    cfg = builder.config
    if cfg.vocab_size < 256:
        parser.error(f"{key}: the checkpoint's vocab_size is {cfg.vocab_size}; the byte-level data needs >= 256 tokens")
    if isinstance(cfg, GPTConfig) and run.model.seq_len > cfg.seq_len:
        parser.error(f"model.seq_len (--seq-len) {run.model.seq_len} > the checkpoint's n_positions {cfg.seq_len}; lower --seq-len")
    return builder, weights, cfg  # (model.preset and model.scan do not apply: the checkpoint's layers are a list)


def make_optimizer(run):
    """AdamW with linear warmup and cosine decay to ``lr / 10``; returns ``(tx, warmup steps, schedule)``.

    Weight decay applies to kernels and embeddings only. zshard stores each parameter flat
    (``[n_pad]``), so ``ndim`` cannot tell a matrix from a bias: the mask goes by name.
    No ``optax.clip_by_global_norm``: it would run on each device's shards and clip by a
    per-device norm, not the global one (``optimizer.clip_norm`` goes to the step instead).
    """
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    o, steps = run.optimizer, run.training.steps
    warmup = run.warmup_steps()
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=steps, end_value=o.lr / 10
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)

    tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=o.weight_decay, mask=decay_mask)
    return tx, warmup, schedule


def make_evaluator(state, batches: list, prefetch: int = 1):
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


def make_sampler(seq_len: int, prefetch: int = 1):
    """``sample(state, prompt, n, temperature, seed) -> bytes``: ``n`` bytes generated after ``prompt``.

    Sharded generation with a KV cache (``train.generate.generate``: each unit gathered per
    decoding step, never the whole model). The context is at most ``seq_len`` bytes: when
    it is full, generation continues from the last ``seq_len // 2`` bytes. Greedy when
    ``temperature == 0``; the draws depend only on ``seed`` (and the chunk). ``prefetch``:
    units gathered ahead (``training.prefetch``).
    """
    from train.generate import generate  # noqa: PLC0415

    def sample(state, prompt: bytes, n: int, temperature: float, seed: int) -> bytes:
        tokens, chunk = list(prompt[-(seq_len // 2):] if len(prompt) >= seq_len else prompt), 0
        new: list[int] = []
        while len(new) < n:
            ctx = tokens[-(seq_len // 2):] if len(tokens) >= seq_len else tokens
            k = min(n - len(new), seq_len - len(ctx))
            out = generate(state, [ctx], k, temperature=temperature, seed=(seed * 1000 + chunk) % 2**31, prefetch=prefetch)[0]
            tokens += out.tolist()
            new += out.tolist()
            chunk += 1
        return bytes(t if t < 256 else ord("?") for t in new)  # a checkpoint's non-byte tokens print as '?'

    return sample


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from train import config as config_mod  # noqa: PLC0415  (no jax)

    parser = build_parser()
    args = parser.parse_args(argv)  # flat: args.steps, args.ckpt_every, ... (train/checkpointing.py reads it)
    run = config_mod.from_namespace(args)
    devices_given = any(a.split("=")[0] in ("--devices", "--mesh.devices") for a in argv) or (
        args.config is not None and "devices" in config_mod.load_file(args.config).get("mesh", {}))
    if not (_multiprocess(argv, run) and not devices_given and _DEVICE_FLAG in os.environ.get("XLA_FLAGS", "")):
        set_host_device_count(run.mesh.devices if run.mesh.devices >= 1 else 1)  # (the launcher's per-process count stands)

    import jax  # noqa: PLC0415

    import zshard.distributed  # noqa: PLC0415

    global _WRITES_FILES
    try:  # before anything touches a device; checks coordinator / num_processes / process_id
        d = run.distributed
        zshard.distributed.initialize(d.coordinator, d.num_processes, d.process_id)
    except (ValueError, RuntimeError, TimeoutError) as e:
        parser.error(str(e))
    _WRITES_FILES = jax.process_index() == 0

    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415  (imports jax, after XLA_FLAGS)
    from tqdm import tqdm  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train import checkpointing, data  # noqa: PLC0415
    from train.model import GPT, cross_entropy_loss  # noqa: PLC0415

    setup = validate(parser, run)
    ckpt = checkpointing.prepare(parser, args, setup.out)  # None: no --ckpt-every / --resume
    resolved = run.resolved(len(setup.devices), jax.process_count())
    out, n, platform, strategy = setup.out, len(setup.devices), setup.devices[0].platform, setup.strategy
    t_cfg, lg = run.training, run.logging
    print(
        f"{PROG}: {run.model.init_from or run.model.preset + ' GPT'}, {strategy} on a {setup.replica}x{setup.shard} (replica x shard) mesh of "
        f"{n} {platform} devices; data: {setup.source}: {len(setup.train_data):,} train / "
        f"{len(setup.eval_data):,} held-out bytes",
        file=sys.stderr,
    )

    # ---- build and compile ------------------------------------------------------------
    tx, warmup, schedule = make_optimizer(run)
    mp = None
    if t_cfg.param_dtype or t_cfg.reduce_dtype:
        mp = zshard.MixedPrecision(param_dtype=t_cfg.param_dtype, reduce_dtype=t_cfg.reduce_dtype)
    make_model = setup.builder or (lambda: GPT(setup.cfg, rngs=nnx.Rngs(t_cfg.seed)))  # noqa: E731
    # the batches of data.train_batches, with a position a checkpoint can hold
    batches = checkpointing.BatchStream(  # this process's rows of each global batch
        setup.train_data, t_cfg.batch_size, run.model.seq_len, t_cfg.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )
    records = None
    if ckpt is not None and ckpt.resuming:  # state, batch position and records of the checkpoint
        state, records = ckpt.restore(make_model, tx, setup.mesh, batches, strategy=strategy, mixed_precision=mp)
    else:
        state = zshard.init(make_model, tx, setup.mesh, strategy=strategy, mixed_precision=mp, params=setup.weights)
    start = 0 if ckpt is None else ckpt.start  # the step this run continues after
    step = zshard.make_train_step(
        cross_entropy_loss,
        grad_accum=t_cfg.grad_accum,
        clip_norm=run.optimizer.clip_norm,
        skip_nonfinite=t_cfg.skip_nonfinite,
        remat=t_cfg.remat,
        prefetch=t_cfg.prefetch,
    )
    batch = next(batches)

    t0 = time.perf_counter()
    # Ahead-of-time compile for the memory figures; `step(state, batch)` below reuses the
    # compiled executable (JAX caches compilations), it only traces the step once more.
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    per_device_bytes = None
    if mem is not None:
        per_device_bytes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}

    report = None
    if lg.report:
        report = zshard.report(step, state, batch)
        print(report.table(), file=sys.stderr)

    eval_set = data.eval_batches(setup.eval_data, t_cfg.batch_size, run.model.seq_len, run.data.eval_batches)
    evaluate = make_evaluator(state, eval_set, t_cfg.prefetch)
    eval_mem = evaluate.compiled.memory_analysis()
    eval_loss0 = records[0]["eval_loss"] if start else evaluate(state)
    sample = make_sampler(run.model.seq_len, t_cfg.prefetch)
    prompt = lg.prompt.encode() if lg.prompt is not None else bytes(setup.eval_data[: min(64, run.model.seq_len // 2)])

    first_step = start + 1

    # ---- output -----------------------------------------------------------------------
    if _WRITES_FILES:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").unlink(missing_ok=True)  # never leave a previous run's summary beside new metrics
    if not start and _WRITES_FILES:  # a fresh run's samples and curves only (a resumed run appends)
        (out / "samples.txt").unlink(missing_ok=True)
        for old in (out / "tb").glob("events.out.tfevents.*"):
            old.unlink()
    header = (f"Resolved configuration of the run in {out}, written by {PROG}.\n"
              f"Repeat it with: {PROG} --config {out / 'config.toml'} [--out ANOTHER_DIR]")
    write_atomic(out / "config.toml", config_mod.dumps_toml(resolved, header))
    tb = TensorBoard(out / "tb" if lg.tensorboard and _WRITES_FILES else None)
    if not start:
        records = [{"step": 0, "eval_loss": eval_loss0}]
        tb.log(records[0])
    write_metrics(out, records)
    tokens_per_step = t_cfg.batch_size * run.model.seq_len  # tokens = bytes
    lrs = np.asarray(schedule(np.arange(t_cfg.steps)))  # lr of step i is lrs[i - 1] (optax count before the update)

    def say(msg: str) -> None:
        tqdm.write(msg, file=sys.stderr)  # above the progress bar (tqdm.write alone goes to stdout)

    bar = tqdm(total=t_cfg.steps, initial=first_step - 1, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
               disable=not _WRITES_FILES)
    t_train = t_last = t_written = time.perf_counter()
    recent_times: list[float] = []  # seconds per step, the last THROUGHPUT_WINDOW steps
    eval_s = 0.0  # time spent evaluating and sampling inside the training loop, s

    def write_sample(i: int) -> None:
        text = sample(state, prompt, lg.sample_tokens, lg.temperature, t_cfg.seed + i)
        head = f"=== step {i}: {lg.sample_tokens} bytes after a {len(prompt)}-byte prompt, temperature {lg.temperature} ==="
        body = (prompt + text).decode("utf-8", errors="replace")
        if _WRITES_FILES:
            print(f"{head}\n{body}\n", flush=True)
            with open(out / "samples.txt", "a", encoding="utf-8") as f:
                f.write(f"{head}\n{body}\n\n")

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
            write_metrics(out, records)
            tb.close()
            raise SystemExit(
                f"{PROG}: error: non-finite loss {loss} / grad norm {grad_norm} at step {i}; lower --lr "
                f"(now {run.optimizer.lr}), add --clip-norm, or pass --skip-nonfinite to skip such steps"
            )
        return rec

    interrupted = []  # the signal number, once Ctrl-C arrives

    def on_sigint(signum, frame):
        interrupted.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts at once
        say(f"{PROG}: interrupted: finishing step in flight, then writing the summary (Ctrl-C again to abort)")

    previous_handler = signal.signal(signal.SIGINT, on_sigint)
    # "compiled in" is printed once Ctrl-C is handled: from here on it finishes the step in flight.
    say(f"compiled in {compile_s:.1f} s; {state.plan.num_params():,} parameters; eval loss {eval_loss0:.4f} before training")
    pending = None  # (step number, metrics) dispatched but not yet read
    last = first_step - 1  # the last step whose metrics were read
    try:
        for i in range(first_step, t_cfg.steps + 1):
            state, metrics = step(state, batch)  # donates the old `state`
            if pending is not None:
                last = record(*pending)["step"]  # step i-1 finishes while step i is queued: no per-step sync
            pending = (i, metrics)
            is_eval = i == t_cfg.steps or (t_cfg.eval_every and i % t_cfg.eval_every == 0)
            is_sample = i == t_cfg.steps or (lg.sample_every and i % lg.sample_every == 0)
            if is_eval or is_sample or interrupted:
                rec = record(*pending)
                pending, last = None, i
                t_eval = time.perf_counter()
                if is_eval and not interrupted:
                    rec["eval_loss"] = evaluate(state)
                    tb.log({"step": i, "eval_loss": rec["eval_loss"]})
                    say(f"step {i}: train loss {rec['loss']:.4f}, eval loss {rec['eval_loss']:.4f}")
                if is_sample and not interrupted:
                    write_sample(i)
                eval_s += time.perf_counter() - t_eval
                t_last = time.perf_counter()  # evaluation time is not training throughput
            if ckpt is not None and (ckpt.due(i) or (interrupted and ckpt.every)):
                if pending is not None:  # after the evaluation, so the records hold step i whole
                    last = record(*pending)["step"]
                    pending = None
                ckpt.save(state, i, batches, records)  # `batches` has drawn i batches
            if interrupted or is_eval or is_sample or time.perf_counter() - t_written > METRICS_WRITE_EVERY_S:
                write_metrics(out, records)
                t_written = time.perf_counter()
            if interrupted:
                break
            if i < t_cfg.steps:
                batch = next(batches)
    finally:
        if ckpt is not None:
            ckpt.close()  # wait for the last checkpoint to be complete on disk
        signal.signal(signal.SIGINT, previous_handler)
        bar.close()
        tb.close()
    train_s = time.perf_counter() - t_train

    # ---- summary ----------------------------------------------------------------------
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    steps_done = last - first_step + 1
    summary = {
        "strategy": strategy,
        "mesh": {"replica": setup.replica, "shard": setup.shard},
        "devices": n,
        "processes": jax.process_count(),
        "platform": platform,
        "model": {"preset": run.model.preset, "config": dataclasses.asdict(setup.cfg)},
        "num_params": state.plan.num_params(),
        "steps": t_cfg.steps,
        "steps_done": last,  # the last step trained (== steps unless interrupted)
        "interrupted": bool(interrupted),
        "batch_size": t_cfg.batch_size,  # global, sequences
        "seq_len": run.model.seq_len,  # tokens
        "tokens_per_step": tokens_per_step,
        "lr": run.optimizer.lr,
        "param_dtype": t_cfg.param_dtype or "float32",
        "reduce_dtype": t_cfg.reduce_dtype or t_cfg.param_dtype or "float32",
        "grad_accum": t_cfg.grad_accum,  # micro-batches per step
        "clip_norm": run.optimizer.clip_norm,
        "scan": setup.cfg.scan,
        "warmup": warmup,  # steps
        "weight_decay": run.optimizer.weight_decay,
        "seed": t_cfg.seed,
        "data": {
            "source": setup.source,
            "train_bytes": len(setup.train_data),
            "eval_bytes": len(setup.eval_data),
            "eval_sequences": run.data.eval_batches * t_cfg.batch_size,
        },
        "final_train_loss": losses[-1] if losses else None,  # nats per byte, last step
        "final_train_loss_mean10": float(np.mean(losses[-10:])) if losses else None,  # mean of the last 10 steps
        "initial_eval_loss": eval_loss0,
        "final_eval_loss": evals[-1]["eval_loss"],  # at step final_eval_step
        "final_eval_step": evals[-1]["step"],
        "per_device_bytes": per_device_bytes,  # from the compiled step's memory_analysis()
        "eval_per_device_bytes": None if eval_mem is None else {  # the sharded eval step's
            k: int(getattr(eval_mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp")},
        "model_bytes": sum(int(v.get_value().size) * v.get_value().dtype.itemsize for _, v in state.plan.template),
        "init_from": run.model.init_from,
        **({"report": report.to_dict()} if report is not None else {}),
        "compile_s": compile_s,
        "train_s": train_s,  # the training loop, evaluations included
        "eval_s": eval_s,  # evaluations and samples inside the loop
        "tokens_per_s": tokens_per_step * steps_done / max(train_s - eval_s, 1e-9),
        "wall_s": time.perf_counter() - _T_START,  # whole program, imports included
        "config": resolved.to_dict(),
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    what = f"interrupted after step {last} of {t_cfg.steps}" if interrupted else f"in {t_cfg.steps} steps"
    print(
        f"{PROG}: eval loss {eval_loss0:.4f} -> {summary['final_eval_loss']:.4f} nats/byte (step {summary['final_eval_step']}) "
        f"{what}; {summary['wall_s']:.0f} s wall; "
        + (f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'config.toml'}" if _WRITES_FILES
           else "rank 0 writes the files"),
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
