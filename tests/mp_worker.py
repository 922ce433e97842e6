"""One process of a multi-process test run (``tests/test_multiprocess.py`` starts it).

Run as P processes with ``ZSHARD_COORDINATOR`` / ``ZSHARD_NUM_PROCESSES`` / ``ZSHARD_PROCESS_ID``
and D emulated devices each (by hand, or ``python -m zshard.launch --nproc P --devices-per-proc D --
python tests/mp_worker.py MODE``). Importable (no side effects) so that the test builds the same model,
batches and optimizer for its single-process runs.

Modes:
  ``train``: train :func:`make_model` for :data:`STEPS` steps with FULL_SHARD and
    HYBRID_SHARD on ``zshard.make_mesh()`` (replica = processes), each process feeding only
    its rows of every global batch; then the tensor mode's run; print one line ``RESULT {json}`` with the
    losses, gradient norms, the final parameters (rank 0) and the collectives of each compiled step
    (kind, replica groups as device ids) plus the device -> process map.
  ``train-kill``: ``train``, then rank 1 kills itself (SIGKILL) and the others keep stepping with
    FULL_SHARD (every step waits on the dead peer: they must be stopped by the runtime, never hang).
  ``tensor``: the tiny GPT of :func:`tensor_case` with its TP plan, HYBRID_SHARD on
    ``make_mesh(P, D/2, tensor=2)`` (each process's devices a shard x tensor block); print
    ``RESULT`` with the losses, gradient norms, the mesh's processes per tensor group and the
    error ``make_mesh`` gives for a tensor group wider than a process.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

STEPS = 10
BATCH = 16  # global batch, rows
D_IN, D, D_OUT, BLOCKS = 13, 19, 3, 2  # no size divisible by 2, 4 or 8: every parameter padded
STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD")


def make_model():
    """The conftest ResMLP shape, 13 -> 19 -> (2 residual blocks) -> 3, seed 0 (~1k parameters)."""
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    class ResBlock(nnx.Module):
        def __init__(self, d, *, rngs):
            self.lin = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(x))

    class ResMLP(nnx.Module):
        def __init__(self, *, rngs):
            self.inp = nnx.Linear(D_IN, D, rngs=rngs)
            self.blocks = nnx.List([ResBlock(D, rngs=rngs) for _ in range(BLOCKS)])
            self.head = nnx.Linear(D, D_OUT, rngs=rngs)

        def __call__(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return ResMLP(rngs=nnx.Rngs(0))


def loss_fn(model, batch):
    import jax.numpy as jnp  # noqa: PLC0415

    x, y = batch
    return jnp.mean(jnp.square(model(x) - y))


def make_tx():
    import optax  # noqa: PLC0415

    return optax.adamw(1e-2, weight_decay=0.1)


def batches(steps: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` global batches ``(x [16, 13], y [16, 3])``, float32."""
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal((BATCH, D_IN)).astype(np.float32), rng.standard_normal((BATCH, D_OUT)).astype(np.float32))
        for _ in range(steps)
    ]


def local_rows(batch, index: int, count: int):
    """Process ``index`` of ``count``: its rows ``[i B/P, (i+1) B/P)`` of a global batch."""
    rows = BATCH // count
    return tuple(x[index * rows : (index + 1) * rows] for x in batch)


_COLLECTIVE = re.compile(
    r"=\s*\S.*?\s(all-gather|reduce-scatter|all-reduce)(?:-start)?\(.*?replica_groups="
    r"(@?mesh(?:<[^>]*>|\[[^\]]*\])\s*\{[^}]*\}|\S+?)(?:,\s*\w+=|\s*$)"  # jax 0.12 mesh['replica'=2,'shard'=4] {'shard'}, or one token
)


def collectives(hlo: str, mesh) -> list[dict]:
    """``[{"kind", "groups"}]`` of the compiled HLO, groups as device ids (not mesh positions)."""
    from zshard.report import parse_replica_groups  # noqa: PLC0415

    ids = [d.id for d in mesh.devices.flat]  # HLO replica groups index the mesh's device order
    out = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            groups = parse_replica_groups(m.group(2), mesh.size)
            out.append({"kind": m.group(1), "groups": [[ids[i] for i in g] for g in groups]})
    return out


def tensor_case():
    """``(make_model, tx, loss_fn, plan, batches)`` of the tensor mode: the reference GPT,
    vocabulary 64, 8 tokens, d 16, 2 heads, 2 blocks; 4 AdamW steps of 8 rows."""
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from train.model import GPT, GPTConfig, cross_entropy_loss, tensor_plan  # noqa: PLC0415

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
    rng = np.random.default_rng(0)
    toks = [rng.integers(0, 64, size=(8, 9), dtype=np.int32) for _ in range(4)]
    return (lambda: GPT(cfg, rngs=nnx.Rngs(0))), optax.adamw(1e-2), cross_entropy_loss, tensor_plan(cfg, 2), \
        [(t[:, :-1], t[:, 1:]) for t in toks]


def _tensor(rank: int, procs: int) -> dict:
    import jax  # noqa: PLC0415

    import zshard  # noqa: PLC0415

    make, tx, loss, plan, data = tensor_case()
    mesh = zshard.make_mesh(procs, jax.local_device_count() // 2, tensor=2)
    state = zshard.init(make, tx, mesh, strategy="HYBRID_SHARD", tensor_parallel=plan)
    step = zshard.make_train_step(loss)
    rows = 8 // procs
    losses, norms = [], []
    for b in data:
        state, m = step(state, tuple(x[rank * rows : (rank + 1) * rows] for x in b))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    groups = mesh.devices.reshape(-1, mesh.shape["tensor"])
    try:
        zshard.make_mesh(1, 1, tensor=len(jax.devices()))
        wide = None
    except ValueError as e:
        wide = str(e)
    return {"mesh": dict(mesh.shape), "losses": losses, "grad_norms": norms,
            "group_processes": [sorted({d.process_index for d in g}) for g in groups], "wide_error": wide}


def main(mode: str) -> int:
    import jax  # noqa: PLC0415

    import zshard  # noqa: PLC0415
    import zshard.distributed  # noqa: PLC0415
    from flax import nnx, traverse_util  # noqa: PLC0415

    zshard.distributed.initialize()  # from the launcher's ZSHARD_* variables
    rank, procs = jax.process_index(), jax.process_count()
    result = {"rank": rank, "process_count": procs, "device_process": {d.id: d.process_index for d in jax.devices()}}
    if mode == "tensor":
        print("RESULT " + json.dumps({**result, "tensor": _tensor(rank, procs)}), flush=True)
        return 0
    kept = {}  # strategy -> (step, state, first local batch): what train-kill keeps stepping
    for strategy in STRATEGIES:
        mesh = zshard.make_mesh()
        state = zshard.init(make_model(), make_tx(), mesh, strategy=strategy)
        step = zshard.make_train_step(loss_fn)
        local = [local_rows(b, rank, procs) for b in batches()]
        hlo = step.lower(state, local[0]).compile().as_text()
        losses, grad_norms = [], []
        for b in local:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
            grad_norms.append(float(metrics["grad_norm"]))
        model = zshard.unshard(state)  # every process takes part (cross-process all-gather)
        params = {"/".join(map(str, p)): np.asarray(v).tolist() for p, v in traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}
        result[strategy] = {
            "mesh": dict(mesh.shape),
            "mesh_processes": [[d.process_index for d in row] for row in mesh.devices],
            "losses": losses,
            "grad_norms": grad_norms,
            "params": params if rank == 0 else None,
            "collectives": collectives(hlo, mesh),
        }
        kept[strategy] = step, state, local[0]
    result["tensor"] = _tensor(rank, procs)  # the tensor mode's run too: one start of the processes for all
    print("RESULT " + json.dumps(result), flush=True)
    if mode == "train-kill":
        if rank == 1:
            print("rank 1 kills itself now", flush=True)
            os.kill(os.getpid(), 9)
        step, state, batch = kept["FULL_SHARD"]
        for _ in range(1000):  # rank 0 keeps computing with a dead peer (FULL_SHARD: every gather crosses processes)
            state, metrics = step(state, batch)
            float(metrics["loss"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "train"))
