"""``python -m train.plot OUT``: PNG plots of a ``python -m train`` run (matplotlib).

Reads ``OUT/metrics.jsonl`` and ``OUT/summary.json`` and writes, into ``OUT`` (or
``--to DIR``):

- ``loss.png``: training loss per step (a line) and held-out loss at each evaluation (markers), nats per byte;
- ``tokens_per_s.png``: training throughput per step, tokens (bytes) per second, with its
  running median over 20 steps;
- ``memory.png``: per-device bytes of the compiled step (``memory_analysis()``: argument,
  output, temp, alias), MiB, and with ``--report`` the model-state bytes against the
  strategy's formula.

Exit status 2, naming the file, when ``OUT`` holds no run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["load_run", "loss_figure", "plot_loss", "plot_memory", "plot_throughput", "main"]

MIB = 2**20


def load_run(out: Path) -> tuple[list[dict], dict | None]:
    """``(records of metrics.jsonl, summary.json or None)``.

    Raises:
      ValueError: ``OUT/metrics.jsonl`` is missing or a line is not JSON (names the line).
    """
    path = out / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: no such file; give the --out directory of a `python -m train` run")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return records, summary


def _title(summary: dict | None) -> str:
    if not summary:
        return ""
    mesh = summary.get("mesh", {})
    model = summary.get("model", {})
    name = model.get("name") or f"{model.get('preset', '?')} GPT"  # older summaries name the preset only
    return f"{name}, {summary.get('strategy')} on {mesh.get('replica')}x{mesh.get('shard')}"



def _save(fig, path: Path) -> None:
    """Lay out, write ``path`` (PNG, 110 dpi) and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

def loss_figure(records: list[dict], summary: dict | None):
    """The figure of :func:`plot_loss`: the training loss as a line, each evaluation a marker
    (not joined: the held-out loss between two evaluations is not known)."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), lw=1, label="train loss")
    if evals:
        ax.plot(*zip(*evals), linestyle="none", marker="o", label="eval loss (held out)")
    ax.set(xlabel="step", ylabel="loss, nats per byte", title=_title(summary))
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def plot_loss(records: list[dict], summary: dict | None, path: Path) -> None:
    """Training loss per step and held-out loss per evaluation (nats per byte) -> ``path``."""
    _save(loss_figure(records, summary), path)


def plot_throughput(records: list[dict], summary: dict | None, path: Path) -> None:
    """Tokens per second per step, and its running median over 20 steps -> ``path``."""
    pts = [(r["step"], r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if pts:
        steps, tps = (np.asarray(a) for a in zip(*pts))
        ax.plot(steps, tps, lw=0.6, alpha=0.4, label="per step")
        k = min(20, len(tps))
        med = [np.median(tps[max(0, i - k + 1) : i + 1]) for i in range(len(tps))]
        ax.plot(steps, med, lw=1.5, label=f"running median ({k} steps)")
        ax.set_ylim(0, np.percentile(tps, 99) * 1.2)
    ax.set(xlabel="step", ylabel="tokens / s", title=_title(summary))
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_memory(summary: dict | None, path: Path) -> bool:
    """Per-device bytes of the compiled step (MiB) -> ``path``; ``False`` if the summary has none."""
    pdb = (summary or {}).get("per_device_bytes")
    if not pdb:
        return False
    labels, values = list(pdb), [pdb[k] / MIB for k in pdb]
    report = (summary or {}).get("report", {}).get("model_state_bytes")
    if report:
        labels += ["model state\n(measured)", "model state\n(formula)"]
        values += [report["measured"]["total"] / MIB, report["formula"]["total"] / MIB]  # params + optimizer state
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, values, color=["C0", "C1", "C2", "C3", "C4", "C5"][: len(labels)])
    ax.bar_label(bars, fmt="%.2f")
    ax.set(ylabel="MiB per device", title=f"compiled step, memory_analysis() -- {_title(summary)}")
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("out", metavar="OUT", help="the --out directory of a python -m train run")
    p.add_argument("--to", metavar="DIR", default=None, help="where the PNGs go (default: OUT)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        records, summary = load_run(out)
    except ValueError as e:
        p.error(str(e))
    dest = Path(args.to) if args.to else out
    dest.mkdir(parents=True, exist_ok=True)
    written = [dest / "loss.png", dest / "tokens_per_s.png"]
    plot_loss(records, summary, written[0])
    plot_throughput(records, summary, written[1])
    if plot_memory(summary, dest / "memory.png"):
        written.append(dest / "memory.png")
    else:
        print(f"python -m train.plot: no per-device memory in {out / 'summary.json'} (run unfinished?); skipped memory.png",
              file=sys.stderr)
    print("\n".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
