"""``python -m train``: train the byte-level GPT with zshard and write metrics and a summary.

Order of work (every check comes before any compile, and nothing is written to ``--out``
until the model has compiled and been evaluated once):

1. parse the flags; set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before
   jax is imported (``N`` emulated CPU devices; an accelerator, if JAX finds one, is used
   instead and ``N`` caps how many of its devices are used);
2. validate: model preset, data file (present, non-empty, long enough for one window per
   split), mesh shape (``RxS`` or a ``meshes/*.toml`` preset) against the device count,
   global batch divisible by the device count;
3. build the mesh, the sharded state (``zshard.init``) and the step, compile the step
   ahead of time for its per-device memory figures;
4. evaluate, train ``--steps`` steps (evaluating every ``--eval-every`` steps), evaluate;
5. write ``OUT/metrics.jsonl`` (one JSON object per step) and ``OUT/summary.json``,
   each atomically (temporary file, then ``os.replace``).

Bad input exits with status 2 and a message that names the flag and the fix.
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

from train import checkpointing

_T_START = time.perf_counter()  # wall time counts from here (includes importing jax)

PROG = "python -m train"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"

# Defaults, chosen so that the run with no flags finishes in 55-95 s (wall, compile 3-6 s
# included; the range is other load) on a 2-core CPU with 8 emulated devices and brings the
# held-out loss of the stdlib corpus from 5.86 to 2.35 nats/byte (40%; ln(256) = 5.55 is a
# uniform guess). tinyshakespeare with the same defaults: 5.95 -> 2.43.
DEFAULTS = dict(
    devices=8,
    strategy="FULL_SHARD",
    model="tiny",
    steps=300,
    batch_size=16,
    seq_len=128,
    lr=3e-3,
    warmup=None,
    weight_decay=0.1,
    seed=0,
    eval_every=100,
    eval_batches=8,
    out="runs/latest",
)


def _number(text: str, kind: type, ok, what: str):
    """``kind(text)`` if ``ok`` of it, else an argparse error saying ``what`` was expected."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _nonnegative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _nonnegative_float(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0 and v != float("inf"), "a positive number")


def _preparse_devices(argv: list[str]) -> int:
    """``--devices`` alone, before jax exists (a bad value is reported by the full parser)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--devices", type=str, default=str(DEFAULTS["devices"]))
    ns, _ = pre.parse_known_args(argv)
    try:
        return _positive_int(ns.devices)
    except (ValueError, argparse.ArgumentTypeError):
        return DEFAULTS["devices"]


def set_host_device_count(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices; must run before ``import jax``.

    Appends ``--xla_force_host_platform_device_count=n`` to ``XLA_FLAGS``, replacing an
    earlier value of that flag and keeping every other flag.
    """
    if "jax" in sys.modules:
        raise RuntimeError("set_host_device_count must run before jax is imported")
    flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_FLAG}={n}"])


def _multiprocess(argv: list[str]) -> bool:
    """A multi-process run? (its flags, ``python -m zshard.launch``'s variables, SLURM / Open MPI), without jax."""
    flags = ("--coordinator", "--num-processes", "--process-id")
    env = ("ZSHARD_COORDINATOR", "ZSHARD_NUM_PROCESSES", "ZSHARD_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE")
    return any(a.split("=")[0] in flags for a in argv) or any(os.environ.get(k) for k in env)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help where there is a default worth printing."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser(model_names: list[str], strategies: list[str]) -> argparse.ArgumentParser:
    """The full command line.

    Args:
      model_names: the keys of ``train.model.MODEL_PRESETS``.
      strategies: the names of ``zshard.Strategy`` (FULL_SHARD, HYBRID_SHARD, ...).
    """
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        description="Train a byte-level GPT with zshard (ZeRO-3 / FSDP sharding) and write "
        "OUT/metrics.jsonl and OUT/summary.json.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("devices and sharding")
    g.add_argument("--devices", metavar="N", type=_positive_int, default=d["devices"],
                   help="devices: N emulated CPU devices; on an accelerator, the first N (at most) of its devices")
    g.add_argument("--strategy", type=str.upper, choices=strategies, default=d["strategy"],
                   help="sharding strategy (DESIGN.md section 3): FULL_SHARD = ZeRO-3 over all devices; "
                   "HYBRID_SHARD = ZeRO-3 inside each shard group, replicated over replica")
    g.add_argument("--zero-stage", metavar="K", type=int, choices=[0, 1, 2, 3], default=None,
                   help="DeepSpeed ZeRO stage, an alias of --strategy: 0 NO_SHARD, 1 SHARD_OPT, 2 SHARD_GRAD_OP, 3 FULL_SHARD")
    g.add_argument("--report", action="store_true",
                   help="print zshard.report (memory and collective bytes of the compiled step against the "
                   "ZeRO/FSDP formulas) and store it in summary.json under 'report'")
    g.add_argument("--mesh", metavar="RxS|PRESET", default=None,
                   help="REPLICAxSHARD (e.g. 2x4) or a preset name from meshes/*.toml (e.g. cpu-2x4); "
                   "default 1xN: all devices on the shard axis (HYBRID_SHARD then equals FULL_SHARD)")
    g = p.add_argument_group("model and optimisation")
    g.add_argument("--model", choices=model_names, default=d["model"], help="model preset (train/model.py)")
    g.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                   help="stack the blocks (nnx.vmap) and run them with nnx.scan: compile time flat in depth "
                   "(default: the preset's choice, on for 'medium')")
    g.add_argument("--steps", metavar="N", type=_positive_int, default=d["steps"], help="optimizer steps")
    g.add_argument("--batch-size", metavar="B", type=_positive_int, default=d["batch_size"],
                   help="GLOBAL batch, sequences per step (split over all devices; must divide by their number)")
    g.add_argument("--seq-len", metavar="T", type=_positive_int, default=d["seq_len"],
                   help="tokens (bytes) per sequence; also the model's position-table size")
    g.add_argument("--lr", metavar="LR", type=_positive_float, default=d["lr"],
                   help="peak learning rate of AdamW (linear warmup, then cosine decay to lr/10)")
    g.add_argument("--warmup", metavar="N", type=_nonnegative_int, default=d["warmup"],
                   help="linear warmup, steps (default: 10%% of --steps; at most --steps - 1)")
    g.add_argument("--weight-decay", metavar="WD", type=_nonnegative_float, default=d["weight_decay"],
                   help="AdamW decoupled weight decay on matrices and embeddings (not on norms or biases)")
    g.add_argument("--param-dtype", choices=["float32", "bfloat16"], default=None,
                   help="mixed precision: dtype of the all-gather and of the compute (masters stay float32)")
    g.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default=None,
                   help="mixed precision: dtype of the gradient reduce-scatter / all-reduce (default: --param-dtype)")
    g.add_argument("--grad-accum", metavar="K", type=_positive_int, default=1,
                   help="gradient accumulation: micro-batches per optimizer step (the batch splits into devices x K)")
    g.add_argument("--clip-norm", metavar="X", type=_positive_float, default=None,
                   help="clip the gradient to this global L2 norm (exact over all shards)")
    g.add_argument("--skip-nonfinite", action="store_true",
                   help="skip the update of a step whose loss or gradient is NaN/inf (counted in metrics.jsonl "
                   "as 'skipped'); by default such a step stops the run with an error naming it")
    g.add_argument("--seed", metavar="SEED", type=_nonnegative_int, default=d["seed"], help="seed of the initial weights and of the batches")
    g = p.add_argument_group(
        "multi-process (jax.distributed)",
        "one process per host; the default mesh is then processes x devices per process (docs/multihost.md). "
        "Not needed under SLURM / Open MPI or python -m zshard.launch, which set them",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None, help="address of process 0, reachable from every process")
    g.add_argument("--num-processes", metavar="P", type=_positive_int, default=None, help="number of processes (the same on all)")
    g.add_argument("--process-id", metavar="I", type=_nonnegative_int, default=None, help="this process's rank, 0..P-1")
    g = p.add_argument_group("data, evaluation and output")
    g.add_argument("--data", metavar="FILE", default=None,
                   help="a text file to train on (bytes; last 10%% held out); default: the Python stdlib's "
                   ".py sources, first 8 MiB in sorted path order")
    g.add_argument("--eval-every", metavar="N", type=_nonnegative_int, default=d["eval_every"],
                   help="steps between held-out evaluations (0: only before the first and after the last step)")
    g.add_argument("--eval-batches", metavar="N", type=_positive_int, default=d["eval_batches"],
                   help="held-out batches (of --batch-size sequences) per evaluation")
    g.add_argument("--out", metavar="DIR", default=d["out"], help="output directory (created after validation)")
    checkpointing.add_arguments(p)
    return p


# ----------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------


_WRITES_FILES = True  # False on every process but rank 0 of a multi-process run


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


# ----------------------------------------------------------------------------------------
# The run. Functions below import jax inside: main() must set XLA_FLAGS first.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """Everything validated, before any compile.

    Attributes:
      cfg: the model shape (the preset, with ``seq_len`` from ``--seq-len``).
      source: one line naming the corpus.
      train_data: uint8 ``[n_train]``, the training bytes.
      eval_data: uint8 ``[n_eval]``, the held-out bytes (last 10% of the corpus).
      devices: the devices of the mesh.
      replica: size of the mesh's ``replica`` axis.
      shard: size of the mesh's ``shard`` axis.
      mesh: ``jax.sharding.Mesh`` of shape ``(replica, shard)``.
      out: the output directory (not created yet).
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


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Setup:
    """Check every flag against the data and the devices; ``parser.error`` (exit 2) on the first problem."""
    import jax  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train import data  # noqa: PLC0415
    from train.model import MODEL_PRESETS  # noqa: PLC0415
    from zshard.mesh import parse_mesh  # noqa: PLC0415

    cfg = dataclasses.replace(MODEL_PRESETS[args.model], seq_len=args.seq_len)
    if args.scan is not None:
        cfg = dataclasses.replace(cfg, scan=args.scan)

    source = data.describe_source(args.data)
    try:
        train_data, eval_data = data.split_corpus(data.load_corpus(args.data))
        data.check_split(train_data, eval_data, args.seq_len, source=source)
    except ValueError as e:
        parser.error(str(e))

    procs = jax.process_count()  # > 1: every device of every process (--devices is then per process)
    devices = jax.devices() if procs > 1 else jax.devices()[: args.devices]
    n, platform = len(devices), devices[0].platform
    try:
        replica, shard = parse_mesh(args.mesh) if args.mesh is not None else (procs, n // procs)
    except ValueError as e:
        parser.error(f"--mesh {args.mesh!r}: {e}")
    if replica * shard != n:
        shapes = ", ".join(f"{r}x{n // r}" for r in range(1, n + 1) if n % r == 0)
        have = f"--devices {n}" if n == args.devices else f"{n} {platform} devices (of --devices {args.devices})"
        parser.error(
            f"--mesh {args.mesh!r} is {replica}x{shard} = {replica * shard} devices, but there are {have}; "
            f"use a mesh of {n} devices ({shapes})" + (f" or --devices {replica * shard}" if platform == "cpu" else "")
        )
    try:
        # no --mesh with several processes: one row per process (jax's hybrid-mesh helper)
        mesh = zshard.make_mesh() if procs > 1 and args.mesh is None else zshard.make_mesh(replica, shard, devices=devices)
    except ValueError as e:
        parser.error(f"--mesh {args.mesh!r}: {e}")
    unit = n * args.grad_accum  # the global batch splits over devices x micro-batches
    if args.batch_size % unit:
        lo = max(unit, args.batch_size // unit * unit)
        accum = f" x --grad-accum {args.grad_accum}" if args.grad_accum > 1 else ""
        parser.error(
            f"--batch-size {args.batch_size} does not divide by the {n} devices of the {replica}x{shard} mesh{accum} "
            f"(the global batch is split over all devices); use a multiple of {unit}, e.g. {lo} or {lo + unit}"
        )

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {str(out)!r} exists and is not a directory; give a directory path")
    return Setup(cfg, source, train_data, eval_data, devices, replica, shard, mesh, out)


def make_optimizer(args: argparse.Namespace):
    """AdamW with linear warmup and cosine decay to ``lr / 10``; returns ``(tx, warmup steps)``.

    Weight decay applies to kernels and embeddings only. zshard stores each parameter flat
    (``[n_pad]``), so ``ndim`` cannot tell a matrix from a bias: the mask goes by name.
    No ``optax.clip_by_global_norm``: it would run on each device's shards and clip by a
    per-device norm, not the global one.
    """
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    warmup = min(args.steps // 10 if args.warmup is None else args.warmup, args.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=args.lr, warmup_steps=warmup, decay_steps=args.steps, end_value=args.lr / 10
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)

    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask), warmup


def make_evaluator(state, batches: list, device):
    """``evaluate(state) -> float``: mean next-byte cross-entropy (nats) over ``batches``.

    The model is gathered whole (``zshard.unshard``) and run on ``device`` with one jitted
    forward pass per batch: simple, and cheap for the models here.

    Args:
      state: a ``zshard.ShardedState`` (its plan fixes the model's structure).
      batches: ``(inputs, targets)`` pairs, int32 ``[B, T]`` each.
      device: where the evaluation runs.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train.model import cross_entropy_loss  # noqa: PLC0415

    batches = [jax.device_put(b, device) for b in batches]
    graphdef = nnx.split(zshard.unshard(state))[0]

    @jax.jit
    def loss(params, batch):
        return cross_entropy_loss(nnx.merge(graphdef, params), batch)

    def evaluate(state) -> float:
        params = nnx.split(zshard.unshard(state))[1]
        return float(jnp.mean(jnp.stack([loss(params, b) for b in batches])))

    return evaluate


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m train`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    has_devices = any(a.split("=")[0] == "--devices" for a in argv)
    if not (_multiprocess(argv) and not has_devices and _DEVICE_FLAG in os.environ.get("XLA_FLAGS", "")):
        set_host_device_count(_preparse_devices(argv))  # (the launcher's per-process count stands)

    import numpy as np  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415  (imports jax, after XLA_FLAGS)
    from tqdm import tqdm  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train import data  # noqa: PLC0415
    from train.model import GPT, MODEL_PRESETS, cross_entropy_loss  # noqa: PLC0415

    parser = build_parser(list(MODEL_PRESETS), [s.value for s in zshard.Strategy])
    args = parser.parse_args(argv)
    import jax  # noqa: PLC0415
    import zshard.distributed  # noqa: PLC0415

    global _WRITES_FILES
    try:  # before anything touches a device
        zshard.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except (ValueError, RuntimeError, TimeoutError) as e:
        parser.error(str(e))
    _WRITES_FILES = jax.process_index() == 0
    if args.zero_stage is not None:
        args.strategy = zshard.Strategy.parse(zero_stage=args.zero_stage).value
    setup = validate(parser, args)
    ckpt = checkpointing.prepare(parser, args, setup.out)  # None: no --ckpt-every / --resume
    out, n, platform = setup.out, len(setup.devices), setup.devices[0].platform
    print(
        f"{PROG}: {args.model} GPT, {args.strategy} on a {setup.replica}x{setup.shard} (replica x shard) mesh of "
        f"{n} {platform} devices; data: {setup.source}: {len(setup.train_data):,} train / "
        f"{len(setup.eval_data):,} held-out bytes",
        file=sys.stderr,
    )

    # ---- build and compile ------------------------------------------------------------
    tx, warmup = make_optimizer(args)
    mp = None
    if args.param_dtype or args.reduce_dtype:
        mp = zshard.MixedPrecision(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)
    make_model = lambda: GPT(setup.cfg, rngs=nnx.Rngs(args.seed))  # noqa: E731
    batches = checkpointing.BatchStream(  # this process's rows of each global batch
        setup.train_data, args.batch_size, args.seq_len, args.seed, process_index=jax.process_index(), process_count=jax.process_count()
    )
    if ckpt is not None and ckpt.resuming:  # state, batch position and records of the checkpoint
        state, records = ckpt.restore(make_model, tx, setup.mesh, batches, strategy=args.strategy, mixed_precision=mp)
    else:
        state = zshard.init(make_model, tx, setup.mesh, strategy=args.strategy, mixed_precision=mp)
    step = zshard.make_train_step(
        cross_entropy_loss, grad_accum=args.grad_accum, clip_norm=args.clip_norm, skip_nonfinite=args.skip_nonfinite
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
    if args.report:
        report = zshard.report(step, state, batch)
        print(report.table(), file=sys.stderr)

    eval_set = data.eval_batches(setup.eval_data, args.batch_size, args.seq_len, args.eval_batches)
    evaluate = make_evaluator(state, eval_set, jax.local_devices()[0])
    start = 0 if ckpt is None else ckpt.start
    eval_loss0 = records[0]["eval_loss"] if start else evaluate(state)

    # ---- train ------------------------------------------------------------------------
    if _WRITES_FILES:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").unlink(missing_ok=True)  # never leave a previous run's summary beside new metrics
    if not start:
        records = [{"step": 0, "eval_loss": eval_loss0}]
    write_metrics(out, records)
    tokens_per_step = args.batch_size * args.seq_len  # tokens = bytes

    bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr, disable=not _WRITES_FILES)
    bar.write(f"compiled in {compile_s:.1f} s; {state.plan.num_params():,} parameters; eval loss {eval_loss0:.4f} before training")
    t_train = t_last = time.perf_counter()
    eval_s = 0.0  # time spent evaluating inside the training loop, s

    def record(i: int, metrics) -> dict:
        """Read step ``i``'s metrics (waits for that step only), log them, stop on a non-finite loss."""
        nonlocal t_last
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        now = time.perf_counter()
        rec = {"step": i, "loss": loss, "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / (now - t_last)}
        nonfinite = int(metrics["nonfinite"])  # the same on every device (reduced over the mesh)
        if nonfinite:
            rec["skipped"] = int(args.skip_nonfinite)
        t_last = now
        records.append(rec)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)
        if nonfinite and not args.skip_nonfinite:
            bar.close()
            write_metrics(out, records)
            raise SystemExit(
                f"{PROG}: error: non-finite loss {loss} / grad norm {grad_norm} at step {i}; lower --lr "
                f"(now {args.lr}), add --clip-norm, or pass --skip-nonfinite to skip such steps"
            )
        return rec

    pending = None  # (step number, metrics) dispatched but not yet read
    for i in range(start + 1, args.steps + 1):
        state, metrics = step(state, batch)  # donates the old `state`
        if pending is not None:
            record(*pending)  # step i-1 finishes while step i is queued: no per-step sync
        pending = (i, metrics)
        if i == args.steps or (args.eval_every and i % args.eval_every == 0):
            rec = record(*pending)
            pending = None
            t_eval = time.perf_counter()
            rec["eval_loss"] = evaluate(state)
            eval_s += time.perf_counter() - t_eval
            bar.write(f"step {i}: train loss {rec['loss']:.4f}, eval loss {rec['eval_loss']:.4f}")
            write_metrics(out, records)
            t_last = time.perf_counter()  # evaluation time is not training throughput
        if ckpt is not None and ckpt.due(i):  # after the evaluation, so its records hold step i whole
            if pending is not None:
                record(*pending)
                pending = None
            ckpt.save(state, i, batches, records)  # `batches` has drawn i batches
            write_metrics(out, records)
        if i < args.steps:
            batch = next(batches)
    bar.close()
    if ckpt is not None:
        ckpt.close()  # wait for the last checkpoint
    train_s = time.perf_counter() - t_train

    # ---- summary ----------------------------------------------------------------------
    losses = [r["loss"] for r in records if "loss" in r]
    summary = {
        "strategy": args.strategy,
        "mesh": {"replica": setup.replica, "shard": setup.shard},
        "devices": n,
        "processes": jax.process_count(),
        "platform": platform,
        "model": {"preset": args.model, "config": dataclasses.asdict(setup.cfg)},
        "num_params": state.plan.num_params(),
        "steps": args.steps,
        "batch_size": args.batch_size,  # global, sequences
        "seq_len": args.seq_len,  # tokens
        "tokens_per_step": tokens_per_step,
        "lr": args.lr,
        "param_dtype": args.param_dtype or "float32",
        "reduce_dtype": args.reduce_dtype or args.param_dtype or "float32",
        "grad_accum": args.grad_accum,  # micro-batches per step
        "clip_norm": args.clip_norm,
        "scan": setup.cfg.scan,
        "warmup": warmup,  # steps
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "data": {
            "source": setup.source,
            "train_bytes": len(setup.train_data),
            "eval_bytes": len(setup.eval_data),
            "eval_sequences": args.eval_batches * args.batch_size,
        },
        "final_train_loss": losses[-1],  # nats per byte, last step
        "final_train_loss_mean10": float(np.mean(losses[-10:])),  # mean of the last 10 steps
        "initial_eval_loss": eval_loss0,
        "final_eval_loss": records[-1]["eval_loss"],
        "per_device_bytes": per_device_bytes,  # from the compiled step's memory_analysis()
        **({"report": report.to_dict()} if report is not None else {}),
        "compile_s": compile_s,
        "train_s": train_s,  # the training loop, evaluations included
        "eval_s": eval_s,  # evaluations inside the loop
        "tokens_per_s": tokens_per_step * (args.steps - start) / (train_s - eval_s),
        "wall_s": time.perf_counter() - _T_START,  # whole program, imports included
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(
        f"{PROG}: eval loss {eval_loss0:.4f} -> {summary['final_eval_loss']:.4f} nats/byte in {args.steps} steps; "
        f"{summary['wall_s']:.0f} s wall; "
        + (f"wrote {out / 'metrics.jsonl'} and {out / 'summary.json'}" if _WRITES_FILES else "rank 0 writes the files"),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
