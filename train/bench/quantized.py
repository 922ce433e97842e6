"""Section 5 of ``python -m train.bench``: quantized collectives (ZeRO++ qwZ / qgZ, docs/quantized.md).

The reference GPT, as ``python -m train`` trains it by default (preset tiny, FULL_SHARD on 8
emulated devices, the stdlib corpus, 300 steps), once exact and once per quantized format
(``[precision]`` flags of the main job, one subprocess each): the held-out loss at the last
step against the exact run's, beside the bytes one device sends per step over the shard axis
(``zshard.report`` of the compiled step, ``--report``) and their formula. The gaps are the
targets of issue 28: int8 weights and int8 gradients within 0.5%, int4 gradients within 1% with
error feedback (``--error-feedback``: ``zshard.Quant(..., error_feedback=True)``; the row without it
is there to show what it buys), fp8 tensorwise weights within 2.5%. Each row prints its eval loss
over the exact run's of the same invocation (``loss / exact``) and the gap ``loss / exact - 1``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["VARIANTS", "quantized_section", "quantized_table"]

# name -> (flags of python -m train, the target gap of the held-out loss, relative; None: the exact run)
VARIANTS = {
    "exact (fp32)": ([], None),
    "int8/256 weights": (["--gather-format", "int8"], 0.005),
    "int8/256 gradients": (["--reduce-format", "int8"], 0.005),
    "int4/256 gradients (no error feedback)": (["--reduce-format", "int4"], None),  # issue 28's 1% is with error feedback
    "int4/256 gradients + error feedback": (["--reduce-format", "int4", "--error-feedback"], 0.01),
    "fp8 e4m3 tensorwise weights": (["--gather-format", "float8_e4m3fn", "--quant-block", "0"], 0.025),
}


def _run(flags: list[str], out: Path, steps: int, timeout: float) -> dict:
    """One ``python -m train`` run; its ``summary.json``."""
    cmd = [sys.executable, "-m", "train", "--steps", str(steps), "--out", str(out), "--overwrite", "--report",
           "--no-tensorboard", "--eval-every", str(steps), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def quantized_section(out: Path, steps: int, progress, timeout: float = 3600.0, only=None) -> dict:
    """Every :data:`VARIANTS` run for ``steps`` steps under ``out`` (``only``: the names that contain
    one of these words, and always the exact run, the peer); per variant the final held-out loss,
    its gap to the exact run (relative), the target, and the shard-axis bytes per step (measured,
    formula) with what they move."""
    rows = []
    for name, (flags, target) in VARIANTS.items():
        if only and flags and not any(w in name for w in only):
            continue
        s = _run(flags, out / re.sub(r"\W+", "-", name).strip("-"), steps, timeout)  # runs/bench/quantized/int8-256-weights
        comm = s["report"]["comm_bytes_per_step"]["shard"]
        rows.append({"name": name, "flags": " ".join(flags), "target": target, "eval_loss": s["final_eval_loss"],
                     "eval_step": s["final_eval_step"], "shard_bytes": comm["measured"], "shard_formula": comm["formula"],
                     "moves": s["report"].get("moves", {}).get("shard", ""), "train_s": s["train_s"]})
        progress.update(1)
    exact = rows[0]
    for r in rows:
        r["gap"] = r["eval_loss"] / exact["eval_loss"] - 1
        r["bytes_ratio"] = r["shard_bytes"] / exact["shard_bytes"]
    return {"steps": steps, "rows": rows}


def quantized_table(res: dict) -> str:
    """The section as Markdown: loss gaps beside the bytes saved."""
    lines = [f"### Quantized collectives: the reference GPT, {res['steps']} steps, FULL_SHARD 1x8 (python -m train defaults)", "",
             "| run | moves (shard axis) | MiB / step measured | formula | bytes / exact | eval loss | loss / exact | gap | target | met |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        t = r["target"]
        met = "" if t is None else ("yes" if abs(r["gap"]) <= t else "NO")
        lines.append(f"| {r['name']} | {r['moves']} | {r['shard_bytes'] / 2**20:.2f} | {r['shard_formula'] / 2**20:.2f} | "
                     f"{r['bytes_ratio']:.3f} | {r['eval_loss']:.4f} | {1 + r['gap']:.4f} | {r['gap']:+.2%} | "
                     f"{'' if t is None else f'{t:.1%}'} | {met} |")
    return "\n".join(lines)
