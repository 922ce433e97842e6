"""Print, per Hugging Face family of tests/fixtures/hf/, how close the loaded model is to
``transformers`` (the table of docs/eval-and-hf.md); no torch needed.

    .venv/bin/python scripts/hf_fidelity.py

Columns: logits on one device (relative l2 ``||ours - theirs|| / ||theirs||`` and the largest
absolute difference), the sharded eval loss's relative difference on FULL_SHARD 1x8 and
HYBRID_SHARD 2x4, and the fixture's size on disk.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import json  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zshard  # noqa: E402
from train.model import cross_entropy_loss, from_hf  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def main() -> None:
    print("| family | logits rel. l2 | logits max abs | eval loss rel. 1x8 | eval loss rel. 2x4 | fixture KiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for d in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        ids, want = np.load(d / "batch.npy"), np.load(d / "logits.npy")
        loss = json.loads((d / "loss.json").read_text())["loss"]
        builder, weights = from_hf(d)
        graphdef, state = nnx.split(nnx.eval_shape(builder))
        model = nnx.merge(graphdef, nnx.from_flat_state(
            [(p, v.replace(jnp.asarray(weights[".".join(map(str, p))]()))) for p, v in nnx.to_flat_state(state)]))
        got = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)), np.float64)
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        losses = []
        for strategy, r, s in [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4)]:
            st = zshard.init(builder, optax.sgd(0.0), zshard.make_mesh(r, s), strategy=strategy, params=weights)
            ev = float(zshard.make_eval_step(cross_entropy_loss)(st, (ids[:, :-1], ids[:, 1:]))["loss"])
            losses.append(abs(ev - loss) / abs(loss))
        kib = sum(f.stat().st_size for f in d.iterdir()) / 1024
        print(f"| {d.name} | {rel:.2e} | {np.abs(got - want).max():.2e} | {losses[0]:.2e} | {losses[1]:.2e} | {kib:.0f} |")


if __name__ == "__main__":
    main()
