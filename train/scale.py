"""Scale by simulation: per-device memory of zshard at 64 and 512 devices, against the formula.

    python -m train.scale                                   # every model and strategy, 64 and 512 devices
    python -m train.scale --devices 64 --models llama-7b    # one slice of the table
    python -m train.bench                                   # runs this as its section 3

GPT-2 1.5B, Llama 7B and 70B shapes (``train.model.PLAN_PRESETS``), seq 2048, one sequence per
device, AdamW, fp32, FULL_SHARD / HYBRID_SHARD / HYBRID_SHARD_OPT on meshes of ``N/8 x 8`` (8
devices per host), compiled ahead of time with abstract inputs on ``N`` emulated CPU devices
(one subprocess per ``N``, each with its own ``XLA_FLAGS``; nothing is allocated). Per-device
peak (``argument + output - alias + temp``) against :func:`expected_peak`
(:func:`memory_formula`, :func:`activation_bytes`); fits on 80 GB and on 141 GB devices.
docs/memory.md ("The scale table") has the measured table and the buffer-level analysis.

Split out of ``train/bench.py``, which imports the formulas and the runner from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["activation_bytes", "expected_peak", "memory_formula", "run_scale", "scale_table", "scale_worker"]

GB = 10**9
DEVICE_GB = (80, 141)  # H100 80 GB, H200 141 GB
SCALE_MODELS = ("gpt2-1.5b", "llama-7b", "llama-70b")
SCALE_DEVICES = (64, 512)
SCALE_STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_OPT")
SCALE_SEQ = 2048
HOST_DEVICES = 8  # devices per host: the shard axis of the simulated meshes


# --------------------------------------------------------------------------------------
# Formulas (pure Python: no jax)
# --------------------------------------------------------------------------------------


def activation_bytes(d_model: int, n_layers: int, n_heads: int, d_ff: int, vocab: int, seq: int, batch: int, glu: bool,
                     itemsize: int = 4) -> dict:
    """Activation bytes per device at the three moments of a step that can hold its peak, with
    full activation recomputation per block.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    arXiv 2205.05198) section 4.1 count the tensors a transformer layer saves for backward:
    ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits with dropout. Here, with ``e = itemsize`` bytes
    per element (fp32: 4), no dropout, and ``f = d_ff``, per layer:

    - attention: norm input, QKV input, Q, K, V, attention output: ``6*s*b*h`` elements, plus the
      softmax output ``a*s^2*b``;
    - MLP: norm input, fc input ``2*s*b*h``, then ``2*s*b*f`` (GELU: pre-activation and output)
      or ``4*s*b*f`` (SwiGLU: gate|up, silu(gate), product).

    With full recomputation (their section 4.3: only each layer's input ``s*b*h`` is kept), the
    scan's buffer of all ``L`` layer inputs is allocated before the forward loop and held
    through backward, and then one of

    - ``"forward"``: the first layer's attention in forward (the scan's first iteration is
      peeled out of the loop), the softmax's exponentials and probabilities, ``2*a*s^2*b``
      (no fused attention), with the unit gathered (and its per-parameter copies,
      :func:`memory_formula`'s ``unit``). Where the compiled peaks of every preset sit since
      the loss's and the embedding's gradients are no longer allocated at the step's start
      (the buffer traces in docs/memory.md, "The scale table");
    - ``"block"``: one layer's full set, recomputed in its backward (while its unit is
      gathered: the ``unit`` term belongs to this moment too);
    - ``"head"``: the output layer's backward: the log-probabilities the loss keeps for
      backward and the logits' gradient, ``2*s*b*V`` (``train.model._token_nll`` computes
      ``(softmax - onehot) / n`` from them; section 4.2 counts ``4*s*b*V`` bytes for
      autodiff's fp32 cross-entropy, which also keeps the logits and a log-softmax
      gradient), and the inputs of the final layer norm and of the output projection with
      their gradients, ``4*s*b*h`` (section 4.2: ``s*b*h`` each forward); no block unit is
      gathered then.

    They are moments, not one sum; :func:`expected_peak` takes the largest.

    Returns:
      ``{"forward": e*(L*s*b*h + 2*a*s^2*b), "block": e*(L*s*b*h + s*b*(8h + m*f) + a*s^2*b),
      "head": e*(L*s*b*h + 4*s*b*h + 2*s*b*V)}``, ``m`` = 2 (GELU) or 4 (SwiGLU).
    """
    s, b, h, a, f, L, V = seq, batch, d_model, n_heads, d_ff, n_layers, vocab
    layer = s * b * (8 * h + (4 if glu else 2) * f) + a * s * s * b
    return {"forward": float(itemsize * (L * s * b * h + 2 * a * s * s * b)),
            "block": float(itemsize * (L * s * b * h + layer)),
            "head": float(itemsize * (L * s * b * h + 4 * s * b * h + 2 * s * b * V))}


def expected_peak(formula: dict, activations: dict) -> tuple[float, str]:
    """Per-device peak bytes of a step from :func:`memory_formula` and :func:`activation_bytes`:
    ``state + grad_shard + root + max(unit + forward, unit + block, head)``, and the name of
    the moment that sets it (``"forward"``, ``"block"`` or ``"head"``; ``forward`` is optional
    in ``activations``)."""
    moments = {"block": formula["unit"] + activations["block"], "head": activations["head"]}
    if "forward" in activations:
        moments["forward"] = formula["unit"] + activations["forward"]
    moment = max(moments, key=moments.get)
    return formula["state"] + formula["grad_shard"] + formula["root"] + moments[moment], moment


def memory_formula(psi: int, psi_root: int, psi_layer: int, shards: int, itemsize: int = 4, opt_slots: int = 2,
                   opt_shards: int | None = None, psi_out: int | None = None) -> dict:
    """Per-device bytes of a zshard FULL_SHARD / HYBRID_SHARD / HYBRID_SHARD_OPT step, activations excluded.

    ZeRO (arXiv 1910.02054) section 5.2 / FSDP (arXiv 2304.11277) section 3.2, for ``Psi``
    parameters sharded ``N`` ways, Adam (``K = opt_slots`` moments), ``e`` bytes per element:

    - ``state``: parameters + optimizer state, ``(1 + K) * e * Psi / N`` (persistent, donated);
      HYBRID_SHARD_OPT (optimizer state over ``M = opt_shards = R*S``): ``e Psi / N + K e Psi / M``;
    - ``grad_shard``: the reduce-scattered gradients, held to the end of backward:
      ``e * Psi / M`` with ``M = opt_shards`` (``N`` for FULL_SHARD / HYBRID_SHARD; ``R*S`` for
      HYBRID_SHARD_OPT, whose units reduce-scatter over ``replica`` inside their backward);
      the optimizer updates in place, no buffer of its own;
    - ``root``: the root unit (embeddings, head), gathered for the whole step, ``e * Psi_root``,
      and one more copy of its output projection, ``e * Psi_out`` (``Psi_out = h * V``): in
      forward the head's weight copied out of the gathered FlatParameter (the slice is not
      contiguous), in backward the head's gradient, held until the root's reduce-scatter at the
      step's end. The embedding's gradient is made only after the last block's backward
      (``train.model.Embed``), so it is not in either moment (docs/memory.md, "The scale
      table"). ``psi_out=None``: ``Psi_out = Psi_root``, the old ``2 * e * Psi_root``;
    - ``unit``: one block unit gathered in backward and its full gradient, or, in forward, the
      gathered FlatParameter and the per-parameter copies sliced out of it (Llama-7B on 64
      devices peaks at the first layer's attention with 0.81 GB gathered + 0.61 GB of copies,
      ``e * Psi_layer`` = 0.81 GB): ``2 * e * Psi_layer``
      (the simulated models are scanned: a stacked unit gathers its own layer inside the loop
      and is not prefetched, ``zshard.collectives``); only at the block moment of
      :func:`activation_bytes` (:func:`expected_peak`).

    The transient terms were settled against compiled programs (issue 8 note): a third
    ``e * Psi_layer`` for a prefetched next unit was dropped (scanned units: no prefetch). An
    ``e * Psi / N`` "update buffer" term added then was in fact the concatenated FlatParameter
    copy each unit saved for backward (stacked: ``[L, L_u/N]``); issue 17 removed the copy and
    the term (docs/memory.md).

    Returns:
      dict of the four terms and ``total`` (bytes).
    """
    opt = opt_shards or shards
    out = {
        "state": itemsize * psi / shards + opt_slots * itemsize * psi / opt,
        "grad_shard": itemsize * psi / opt,
        "root": itemsize * (psi_root + (psi_root if psi_out is None else psi_out)),
        "unit": 2 * itemsize * psi_layer,
    }
    out["total"] = sum(out.values())
    return out


# --------------------------------------------------------------------------------------
# The worker, the runner, the table
# --------------------------------------------------------------------------------------


def scale_worker(n_devices: int, models, strategies) -> list[dict]:
    """In a process whose ``XLA_FLAGS`` give ``n_devices`` CPU devices: compile every
    (model, strategy) on a ``n/8 x 8`` mesh with abstract inputs and measure it."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    from train.model import PLAN_PRESETS, GPTConfig, build_model, cross_entropy_loss  # noqa: PLC0415
    from train.plan import peak_bytes  # noqa: PLC0415

    mesh = zshard.make_mesh(n_devices // HOST_DEVICES, HOST_DEVICES, devices=jax.devices()[:n_devices])
    tokens = jax.ShapeDtypeStruct((n_devices, SCALE_SEQ), jnp.int32)
    step = zshard.make_train_step(cross_entropy_loss)
    out = []
    for name in models:
        cfg = dataclasses.replace(PLAN_PRESETS[name], seq_len=SCALE_SEQ)
        for strategy in strategies:
            state = zshard.init(lambda cfg=cfg: build_model(cfg, nnx.Rngs(0)), optax.adamw(1e-4), mesh, strategy=strategy, abstract=True)
            t0 = time.perf_counter()
            step.lower(state, (tokens, tokens)).compile()
            compile_s = time.perf_counter() - t0
            rep = zshard.report(step, state, (tokens, tokens))
            units = rep.units
            psi = rep.num_params
            psi_root = sum(u["params"] for u in units if u["layers"] == 1)
            psi_layer = max(u["params"] // u["layers"] for u in units if u["layers"] > 1)
            shards = state.plan.num_shards
            gpt = isinstance(cfg, GPTConfig)
            d_ff = 4 * cfg.d_model if gpt else cfg.d_ff
            form = memory_formula(psi, psi_root, psi_layer, shards, opt_shards=state.plan.opt_shards,
                                  psi_out=cfg.d_model * cfg.vocab_size)
            act = activation_bytes(cfg.d_model, cfg.n_layers, cfg.n_heads, d_ff, cfg.vocab_size, SCALE_SEQ, 1, glu=not gpt)
            expected, moment = expected_peak(form, act)
            peak = peak_bytes(rep.per_device_bytes)
            out.append({
                "model": name, "devices": n_devices, "mesh": f"{mesh.shape['replica']}x{mesh.shape['shard']}",
                "strategy": strategy, "params": psi, "compile_s": compile_s, "per_device_bytes": rep.per_device_bytes,
                "peak": peak, "formula": form, "activations": act, "moment": moment, "expected": expected,
                "ratio": peak / expected,
                "state_ratio": rep.model_state_bytes["ratio"],
                "fits": {str(g): peak <= g * GB for g in DEVICE_GB},
            })
            print(json.dumps(out[-1]), flush=True)
    return out


def run_scale(devices, models, strategies, progress, timeout: float) -> list[dict]:
    rows = []
    for n in devices:
        progress.set_description(f"scale: {n} devices")
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f) + \
            f" --xla_force_host_platform_device_count={n}"
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, "-m", "train.scale", "--worker", str(n), "--models", ",".join(models),
               "--strategies", ",".join(strategies)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parent.parent)
        try:
            stdout, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, err = proc.communicate()
            err += f"\nkilled after --scale-timeout {timeout:g} s"
        got = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        rows += got
        progress.update(len(got))
        if proc.returncode != 0:
            progress.write(f"scale worker for {n} devices failed (exit {proc.returncode}):\n{err[-3000:]}", file=sys.stderr)
    return rows


def scale_table(rows) -> str:
    lines = ["### Scale by simulation: seq 2048, one sequence per device, AdamW fp32, remat (recomputed blocks), "
             "8 devices per host", "",
             "Expected = state + gradient + root + max(unit + forward, unit + block, head activations) "
             "(`train.scale.expected_peak`); the moment is the larger of the two.", "",
             "| model | devices | mesh | strategy | params | compile s | state / formula | peak GB | state + grad + root GB "
             "| moment | + moment GB | expected GB | peak / expected | 80 GB | 141 GB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        f = r["formula"]
        base = f["state"] + f["grad_shard"] + f["root"]
        lines.append(
            f"| {r['model']} | {r['devices']} | {r['mesh']} | {r['strategy']} | {r['params'] / 1e9:.2f} B | {r['compile_s']:.1f} | "
            f"{r['state_ratio']:.4f} | {r['peak'] / GB:.2f} | {base / GB:.2f} | {r['moment']} | {(r['expected'] - base) / GB:.2f} | "
            f"{r['expected'] / GB:.2f} | {r['ratio']:.3f} | {'fits' if r['fits']['80'] else 'no'} | {'fits' if r['fits']['141'] else 'no'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Command line: the worker (one device count, in its own process) and a standalone run
# --------------------------------------------------------------------------------------


def set_device_count(n_devices: int) -> None:
    """Before jax is imported: ``n_devices`` emulated CPU devices (other ``XLA_FLAGS`` kept)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n_devices}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


class _Progress:
    """The slice of ``tqdm``'s interface :func:`run_scale` uses, printing to stderr."""

    def set_description(self, text):
        print(text, file=sys.stderr, flush=True)

    def update(self, n):
        pass

    def write(self, text, file=sys.stderr):
        print(text, file=file, flush=True)


def _csv(value: str, allowed, flag: str, parser) -> list:
    items = [x.strip() for x in value.split(",") if x.strip()]
    for x in items:
        if x not in allowed:
            parser.error(f"{flag}: unknown {x!r}; choose from {', '.join(map(str, allowed))}")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.scale", allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default=",".join(map(str, SCALE_DEVICES)), help="emulated device counts, comma-separated (multiples of 8)")
    p.add_argument("--models", default=",".join(SCALE_MODELS), help="presets, comma-separated")
    p.add_argument("--strategies", default=",".join(SCALE_STRATEGIES), help="strategies, comma-separated")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S", help="seconds allowed to each device count's subprocess")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows (every measured and formula term) as JSON")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # one device count, in this process
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    models = _csv(args.models, SCALE_MODELS, "--models", p)
    strategies = _csv(args.strategies, SCALE_STRATEGIES, "--strategies", p)
    if args.worker is not None:
        set_device_count(args.worker)
        scale_worker(args.worker, models, strategies)
        return 0
    try:
        devices = [int(d) for d in args.devices.split(",") if d.strip()]
    except ValueError:
        p.error(f"--devices {args.devices!r}: expected comma-separated integers, e.g. 64,512")
    for d in devices:
        if d < HOST_DEVICES or d % HOST_DEVICES:
            p.error(f"--devices: {d} is not a positive multiple of {HOST_DEVICES} (devices per host)")
    rows = run_scale(devices, models, strategies, _Progress(), args.timeout)
    print(scale_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if len(rows) == len(devices) * len(models) * len(strategies) else 1


if __name__ == "__main__":
    sys.exit(main())
