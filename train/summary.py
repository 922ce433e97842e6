"""The end of a ``python -m train`` run: the weights, ``OUT/summary.json`` and the last line
(a preempted run: no weights, and the line names its checkpoint).

``summary.json`` holds what ran (strategy, mesh, devices, model, data, the resolved
configuration), what it measured (losses, per-device bytes of the compiled train and eval
steps, compile / train / evaluation seconds, tokens per second) and what it wrote (weights,
the checkpoints still on disk). The last line on stderr says what the run did and every file
it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

import zshard
from train import output
from train.output import PROG, write_atomic
from train.stops import Stop

__all__ = ["finish", "moe_summary", "preempted_line", "summary_line"]


def finish(b, p, t_start: float) -> dict:
    """Save the weights (``OUT/model.safetensors``), write ``OUT/summary.json``, print what was written.

    Args:
      b: the :class:`train.trainer.Trainer`.
      p: its :class:`train.trainer.Progress`.
      t_start: ``time.perf_counter()`` when the program started (``wall_s`` counts from there).

    Returns:
      The summary (the JSON object written).
    """
    setup = b.setup
    run, out = setup.run, setup.out
    t_cfg = run.training
    preempted = p.stop == Stop.PREEMPT  # the checkpoint holds everything; the grace is short: no weights
    weights = None if preempted else out / "model.safetensors"
    eval_mem = b.evaluate.compiled.memory_analysis()
    t0 = time.perf_counter()
    if weights is not None:
        zshard.export(p.state, weights)  # every process gathers; process 0 writes
    export_s = time.perf_counter() - t0
    losses = [r["loss"] for r in p.records if "loss" in r]
    evals = [r for r in p.records if "eval_loss" in r]
    tokens_per_step = t_cfg.batch_size * run.model.seq_len
    steps_done = p.last - b.start
    summary = {
        "strategy": setup.strategy,
        "mesh": dict(setup.mesh.shape),
        "devices": len(setup.devices),
        "processes": jax.process_count(),
        "platform": setup.devices[0].platform,
        # what was trained: a preset, or (init_from) a Hugging Face model_type / an earlier run's model
        "model": {**setup.model, "config": dataclasses.asdict(setup.cfg)},
        "num_params": p.state.plan.num_params(),
        "steps": t_cfg.steps,
        "steps_done": p.last,  # the last step trained (== steps unless interrupted)
        "resumed_from": b.start,  # 0: a fresh run
        "interrupted": p.interrupted,  # stopped early: Ctrl-C, or preempted
        "preempted": preempted,  # SIGTERM / SIGUSR1: a checkpoint of steps_done, no weights
        "signal": b.stops.signal_name,  # the stopping signal this process received (None: none, or another process's)
        "fit_check_s": b.fit_check_s,  # the fit check before the first step
        "save_compile_s": b.save_compile_s,  # the save compiled ahead (--preempt-grace)
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
        **({"moe": moe_summary(p.records)} if any("expert_load" in r for r in p.records) else {}),
        "per_device_bytes": b.per_device_bytes,  # from the compiled step's memory_analysis()
        "eval_per_device_bytes": None if eval_mem is None else {  # the sharded eval step's
            k: int(getattr(eval_mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp")},
        "model_bytes": sum(int(v.get_value().size) * v.get_value().dtype.itemsize for _, v in p.state.plan.template),
        "init_from": setup.model.get("init_from"),  # absolute
        **({"report": b.report.to_dict()} if b.report is not None else {}),
        "compile_s": b.compile_s,
        "train_s": p.train_s,  # the training loop, from the first step to the last one's metrics, evaluations included
        "eval_s": p.eval_s,  # evaluations and samples inside the loop
        "save_s": p.save_s,  # the loop held by starting checkpoint saves (the first one's compile included)
        "first_save_s": p.first_save_s,  # of save_s, the first save (None: no save)
        "save_wait_s": p.save_wait_s,  # after the last step: the last checkpoint's background writes
        "export_s": export_s,  # writing model.safetensors
        "tokens_per_s": tokens_per_step * steps_done / max(p.train_s - p.eval_s - p.save_s, 1e-9),  # steps only
        "weights": None if weights is None else str(weights),  # safetensors, logical shapes (zshard.export)
        # the saved checkpoints still on disk (checkpoint.keep deletes the oldest)
        "checkpoints": [str(setup.ckpt.directory / str(s)) for s in p.saved
                        if (setup.ckpt.directory / str(s)).is_dir()] if setup.ckpt is not None else [],
        "wall_s": time.perf_counter() - t_start,  # whole program, imports included
        "config": setup.resolved.to_dict(),
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    line = preempted_line(summary, b, p, out) if preempted else summary_line(summary, b, out)
    print(line, file=sys.stderr, flush=True)  # every rank: what it trained and evaluated
    return summary


def moe_summary(records: list[dict]) -> dict:
    """An MoE run's router figures over its steps: ``expert_load`` (each expert's share of the routed
    slots, mean of the last 10 steps), ``max_expert_load`` (``E * max`` of it: 1 when balanced),
    ``dropped_fraction`` (mean over the steps: slots dropped for capacity), and the last step's
    ``router_aux_loss`` and ``router_z_loss``."""
    steps = [r for r in records if "expert_load" in r]
    load = np.mean([r["expert_load"] for r in steps[-10:]], axis=0)
    return {"expert_load": load.tolist(), "max_expert_load": float(load.max() * load.size),
            "dropped_fraction": float(np.mean([r.get("dropped_fraction", 0.0) for r in steps])),
            "router_aux_loss": steps[-1].get("router_aux_loss"), "router_z_loss": steps[-1].get("router_z_loss")}


def preempted_line(summary: dict, b, p, out: Path) -> str:
    """The last line of a preempted run: where its checkpoint is and how to continue."""
    step, where = p.last, b.setup.ckpt.directory / str(p.last)
    stops, by = b.stops, b.agreement.by
    if stops.signal_name in ("SIGTERM", "SIGUSR1"):
        what = f"{stops.signal_name}"
        took = f", {time.monotonic() - stops.t_signal:.1f} s after the signal"
    else:
        what, took = f"a signal on process {', '.join(map(str, by))}", ""
    return (f"{PROG}: preempted by {what} after step {step} of {summary['steps']}: checkpoint {where} is complete{took}; "
            f"continue with the same flags and --resume{'' if b.setup.run.logging.out else f' --out {out}'}")


def summary_line(summary: dict, b, out: Path) -> str:
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
