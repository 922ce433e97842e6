"""``python -m train.sample``: continue a prompt with a saved run or a Hugging Face model, sharded.

    python -m train.sample runs/latest --prompt "def main(" --tokens 200 --temperature 0.8 --top-p 0.95
    python -m train.sample tests/fixtures/hf/llama --prompt "3 10 17" --tokens 8 --mesh 2x4

``RUN`` is either

- a run folder of ``python -m train``: its ``config.toml`` gives the model (the preset with the
  run's ``seq_len``, ``scan`` and token-file vocabulary, a zoo preset with its own, or the Hugging Face model it was
  initialised from) and its weights are ``model.safetensors`` (``zshard.export``), or, when the
  run wrote none (preempted), the latest checkpoint in ``checkpoints/`` (``zshard.restore``);
- a Hugging Face model directory (``config.json`` and safetensors files, ``train.model.from_hf``).

The weights stream into the shards of the mesh given (``--mesh RxS`` or ``RxSxT``, ``--devices N``
emulated CPU devices on a CPU; ``zshard.init(..., params=...)``, never the whole model on one
device) and ``train.generate.continue_tokens`` decodes with a KV cache, each unit gathered
per decoding step (``--gather-once``: the whole model gathered once per call), in windows of
the model's ``seq_len`` as ``python -m train``'s samples.

Output (stdout): the prompt followed by its continuation: text for a byte-level run (the bytes
decoded as UTF-8, invalid bytes as U+FFFD, a token id >= 256 of a larger vocabulary as ``?``), else
token ids separated by spaces, as ``python -m train --prompt`` takes them; then, on its own last line, the decoding rate
(``12.3 tokens/s (...)``: the generated tokens over the seconds of the decoding calls; each
window's program is compiled before, timed apart). A line naming the model and mesh goes to stderr.
``--seed`` makes sampling reproducible: the same seed gives the same tokens on any mesh;
``--temperature 0`` is greedy (argmax).

Exit status 0; 2 for bad input (one line naming the flag or file and the fix), before
anything compiles. ``--help`` imports no jax.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["Source", "build_parser", "load", "main", "read_source"]

PROG = "python -m train.sample"
EXIT_USAGE = 2


def _fail(message: str):
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m train.sample`` (``--help``)."""
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Continue a prompt with a run folder of python -m train or a Hugging Face model directory, on a "
        "sharded mesh (KV cache, each unit gathered per decoding step). Prints the prompt and its continuation (text "
        "for byte-level runs, token ids otherwise), then the tokens per second on the last line.",
        epilog="Examples: python -m train.sample runs/latest --prompt 'import os' --tokens 200; "
        "python -m train.sample tests/fixtures/hf/llama --prompt '3 10 17' --tokens 8 --mesh 2x4 --temperature 0",
    )
    p.add_argument("run", metavar="RUN", help="a run folder of python -m train (config.toml with model.safetensors or "
                   "checkpoints/), or a Hugging Face model directory (config.json and *.safetensors)")
    p.add_argument("--prompt", required=True, help="the text to continue (byte-level runs), or token ids separated by "
                   "spaces (token-file runs and Hugging Face models: there is no tokenizer), e.g. '464 2068'")
    p.add_argument("--tokens", type=_positive(int), default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (argmax) (default 0.8)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: draw from the most likely tokens whose "
                   "probability reaches P, in (0, 1]; 1: every token (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same tokens on any mesh (default 0)")
    p.add_argument("--mesh", default=None, help="REPLICAxSHARD (e.g. 2x4), REPLICAxSHARDxTENSOR (e.g. 1x4x2) or a "
                   "preset of meshes/*.toml; default 1xN (N devices)")
    p.add_argument("--devices", type=_positive(int), default=8, help="devices: N emulated CPU devices; on an "
                   "accelerator, the first N (default 8)")
    p.add_argument("--strategy", default="FULL_SHARD", help="sharding strategy of the parameters (default FULL_SHARD)")
    p.add_argument("--gather-once", action="store_true", help="gather the whole model once per call, not each unit "
                   "per decoding step (memory of the whole model per device, no communication per token)")
    p.add_argument("--prefetch", type=int, default=None, help="units gathered ahead while decoding (default: the backend's)")
    return p


class Source:
    """What a ``RUN`` folder holds, read before anything is placed or compiled.

    Attributes:
      path: the folder.
      cfg: the model config (``train.model.GPTConfig``, ``LlamaConfig``, ...).
      make_model: a zero-argument callable building the model (for ``zshard.init``).
      run: a run folder's configuration (``train.config.Config``); ``None`` for a Hugging Face directory.
      weights: a Hugging Face directory's ``{dotted path: reader}`` (``train.model.from_hf``), else ``None``.
      seq_len: the context window of :func:`train.generate.continue_tokens`, tokens (the run's
        ``model.seq_len``; a Hugging Face model's position table).
      byte_level: the run trained on bytes (prompt and output are text), else token ids.
    """

    def __init__(self, path: Path, cfg, make_model, run, weights, seq_len: int, byte_level: bool):
        self.path, self.cfg, self.make_model, self.run, self.weights = path, cfg, make_model, run, weights
        self.seq_len, self.byte_level = seq_len, byte_level


def _safetensors_weights(file: Path) -> dict:
    """``{dotted path: zero-argument reader}`` of an ``zshard.export`` file (one tensor read per call)."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(file, framework="numpy") as f:
        names = list(f.keys())

    def reader(name):
        def read():
            with safe_open(file, framework="numpy") as f:
                return f.get_tensor(name)

        return read

    return {name: reader(name) for name in names}


def read_source(path: str | Path) -> Source:
    """The model of a run folder (its ``config.toml``: the model ``train.job.validate`` builds for
    it) or of a Hugging Face directory (``config.json``); no weight is read yet.

    Raises:
      SystemExit(2): no such folder, neither kind of folder, an unreadable configuration (one line on stderr).
    """
    from flax import nnx  # noqa: PLC0415

    from train.cli import parse_config  # noqa: PLC0415
    from train.model import build_model, from_hf  # noqa: PLC0415

    path = Path(path)
    if not path.is_dir():
        _fail(f"RUN {str(path)!r} does not exist (give a run folder of python -m train or a Hugging Face model directory)")
    if (path / "config.toml").is_file():
        run, _ = parse_config(["--config", str(path / "config.toml")])
        byte_level = run.data.vocab_size is None
        if run.model.init_from is not None:
            try:
                builder, _ = from_hf(run.model.init_from)
            except (OSError, ValueError) as e:
                _fail(f"{path / 'config.toml'}: model.init_from {run.model.init_from!r}: {e}")
            return Source(path, builder.config, builder, run, None, run.model.seq_len, byte_level)
        cfg = run.model_config()  # the preset train.job.validate built: a token file's vocabulary, or a zoo preset's own
        return Source(path, cfg, lambda: build_model(cfg, nnx.Rngs(run.training.seed)), run, None, run.model.seq_len, byte_level)
    if (path / "config.json").is_file():
        try:
            builder, weights = from_hf(path)
        except (OSError, ValueError) as e:
            _fail(f"RUN {str(path)!r}: {e}")
        return Source(path, builder.config, builder, None, weights, builder.config.seq_len, False)
    _fail(f"RUN {str(path)!r} holds neither config.toml (a run folder of python -m train) nor config.json "
          "(a Hugging Face model directory)")


def load(source: Source, mesh, *, strategy: str = "FULL_SHARD"):
    """``(state, what)``: the weights of ``source`` streamed into ``mesh``'s shards, and one line
    naming where they came from.

    Args:
      source: from :func:`read_source`.
      mesh: from ``zshard.make_mesh`` (``(replica, shard[, tensor])``; a ``tensor`` axis uses the
        model's Megatron plan, ``train.model.tensor_plan``).
      strategy: the sharding strategy (``zshard.Strategy`` name).

    Returns:
      ``state``: a ``zshard.ShardedState`` (an ``optax.identity()`` optimizer, no optimizer state;
      restored from a checkpoint: the run's AdamW state too).

    Raises:
      SystemExit(2): a run with neither weights nor a checkpoint, weights that do not match the
        model, or a tensor axis the model cannot split (one line on stderr).
    """
    import optax  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train.model import tensor_plan  # noqa: PLC0415

    path, run = source.path, source.run
    try:
        plan = tensor_plan(source.cfg, dict(mesh.shape).get("tensor", 1))
    except ValueError as e:
        _fail(f"--mesh: {e}")
    try:
        if run is None:
            return zshard.init(source.make_model, optax.identity(), mesh, strategy=strategy, params=source.weights,
                               tensor_parallel=plan), f"Hugging Face model {path}"
        if (path / "model.safetensors").is_file():
            return zshard.init(source.make_model, optax.identity(), mesh, strategy=strategy, tensor_parallel=plan,
                               params=_safetensors_weights(path / "model.safetensors")), f"run {path} (model.safetensors)"
        if (path / "checkpoints").is_dir():
            from train.job import make_optimizer  # noqa: PLC0415

            state, _ = zshard.restore(path / "checkpoints", mesh, model=source.make_model, tx=make_optimizer(run)[0],
                                      strategy=strategy, tensor_parallel=plan, mixed_precision=run.mixed_precision())
            return state, f"run {path} (its latest checkpoint)"
    except (FileNotFoundError, ValueError) as e:
        _fail(f"RUN {str(path)!r}: {e}")
    _fail(f"RUN {str(path)!r} holds no model.safetensors and no checkpoints/: the run wrote no weights (it stopped "
          "before its end without checkpointing); train it again, with --ckpt-every N to keep checkpoints")


def _prompt_ids(source: Source, text: str) -> list[int]:
    from train.data import parse_token_prompt  # noqa: PLC0415

    if source.byte_level:
        return list(text.encode())
    try:
        return parse_token_prompt(text, source.cfg.vocab_size)
    except ValueError as e:
        _fail(str(e))


def _render(source: Source, ids: list[int]) -> str:
    """Bytes as text (invalid UTF-8 as U+FFFD; a token id >= 256, which a model of a larger vocabulary, a zoo
    preset or a Hugging Face checkpoint, can draw, as ``?``), other tokens as space-separated ids."""
    if source.byte_level:
        return bytes(t if t < 256 else ord("?") for t in ids).decode("utf-8", errors="replace")
    return " ".join(map(str, ids))


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m train.sample`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if not args.temperature >= 0:
        _fail(f"--temperature {args.temperature}: give 0 (greedy) or a positive number")
    if not 0 < args.top_p <= 1:
        _fail(f"--top-p {args.top_p}: give a probability mass in (0, 1] (1: every token)")
    if not args.prompt:
        _fail("--prompt is empty; give some text (or token ids)")

    import jax  # noqa: PLC0415  (after the flags: --help and bad flags import no jax)

    import zshard  # noqa: PLC0415
    from train.devices import emulate_devices  # noqa: PLC0415
    from train.generate import chunks, continue_tokens, lower  # noqa: PLC0415

    emulate_devices(args.devices)
    devices = jax.devices()[: args.devices]
    try:
        shape = zshard.parse_mesh(args.mesh) if args.mesh is not None else (1, len(devices))
    except ValueError as e:
        _fail(f"--mesh {args.mesh!r}: {e}")
    if len(shape) == 2:
        shape = (*shape, 1)
    if shape[0] * shape[1] * shape[2] != len(devices):
        _fail(f"--mesh {args.mesh!r} has {shape[0] * shape[1] * shape[2]} devices, there are {len(devices)} (--devices "
              f"{args.devices}); give a mesh of {len(devices)} devices or --devices {shape[0] * shape[1] * shape[2]}")
    try:
        strategy = zshard.Strategy.parse(args.strategy).value
    except ValueError as e:
        _fail(f"--strategy {args.strategy!r}: {e}")
    try:
        mesh = zshard.make_mesh(shape[0], shape[1], shape[2], devices=devices)
    except ValueError as e:
        _fail(f"--mesh {args.mesh!r}: {e}")
    source = read_source(args.run)
    prompt = _prompt_ids(source, args.prompt)  # checked before anything is placed or compiled
    state, what = load(source, mesh, strategy=strategy)
    kw = dict(temperature=args.temperature, top_p=args.top_p, gather_once=args.gather_once, prefetch=args.prefetch)
    mesh_text = "x".join(str(s) for s in dict(mesh.shape).values())
    print(f"{PROG}: {what}; {strategy} on a {mesh_text} mesh of {len(devices)} {devices[0].platform} devices",
          file=sys.stderr, flush=True)

    windows = sorted(set(chunks(len(prompt), args.tokens, source.seq_len)))  # (context, new tokens) of each call
    t0 = time.perf_counter()
    try:  # each window's program, compiled ahead (the calls reuse them): compiling is not decoding
        for ctx, k in windows:
            lower(state, [prompt[len(prompt) - ctx:]], k, seed=args.seed, **kw).compile()
    except ValueError as e:
        _fail(str(e))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    new = continue_tokens(state, prompt, args.tokens, seq_len=source.seq_len, seed=args.seed, **kw)
    decode_s = time.perf_counter() - t0
    text = _render(source, prompt + new)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    print(f"{len(new) / decode_s:.1f} tokens/s ({len(new)} tokens in {decode_s:.2f} s; compiled before, apart: "
          f"{len(windows)} program{'s' if len(windows) > 1 else ''} in {compile_s:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
