"""``python -m train.bench``: zshard against its peers, side by side, and at scale by simulation.

    python -m train.bench                      # everything below, ~10 min on 2 CPU cores
    python -m train.bench --quick              # tiny model, one config, no sweep / scale (smoke test)
    python -m train.bench --out runs/bench --repeats 10

Writes ``OUT/bench.json``, ``OUT/bench.md`` (the printed tables) and PNG plots into ``--out``
(default ``runs/bench/``).

The package: ``peers`` (the compiled steps compared), ``sections`` (what each section
measures), ``tables`` (the Markdown tables, the targets, the plots), ``run`` (the program),
``quantized`` (section 5), ``moe`` (section 6), ``gpu`` (section 4), ``offload`` (``--offload``: host offload on one GPU, docs/offload.md); the scale section and the
memory formulas are ``train/scale.py``.

Sections
--------
1. **Peers on 8 emulated CPU devices** (mesh 2x4), in one process, on the same GPT, the same
   data and the same devices:

   - ``reference``: a plain single-device ``jax.jit`` + Optax step (ground truth for the loss);
   - ``DDP``: parameters and optimizer state replicated (``PartitionSpec()``), batch split over
     every device, ``jax.jit`` with shardings; the compiler inserts the gradient all-reduce;
   - ``FSDP-compiler`` (how MaxText does it): every parameter and its Adam moments sharded on
     the largest dimension divisible by the device count over all devices
     (``NamedSharding(mesh, P(..., ("replica", "shard"), ...))``), batch split; the compiler
     inserts all-gathers and reduce-scatters;
   - ``zshard/<STRATEGY>``: ``zshard.init`` / ``zshard.make_train_step`` in each strategy, at
     the step's defaults (``remat="block"``, ``prefetch`` = the backend's default).

   Like with like: ``FSDP-compiler remat=block`` puts each block of the peer under
   ``jax.checkpoint`` (zshard's default policy) and ``zshard/FULL_SHARD remat=none`` saves every
   activation (the plain peers' policy); every row's step time is also divided by the compiler
   peer's at the *same* policy. ``zshard/FULL_SHARD prefetch=k`` is the other prefetch setting.

   Per peer: per-device argument / output / temp bytes (``memory_analysis()`` of the compiled
   step), model-state bytes (params + optimizer state, from the shard shapes) against the
   formula, collective bytes per step per mesh axis (``zshard.parse_collectives`` on the
   compiled HLO of every peer; ring algorithm bytes), compile time (trace + lower + compile,
   seconds), step time (the executable is warmed up by the two checked steps; then in each
   round every peer, in rotating order, runs one step from a fresh initial state, so that only
   one peer's state is in memory at a time; median over rounds; ratios are medians of
   per-round ratios, pair by pair), the loss of the first two steps (must agree with the
   reference within 1e-5 relative, fp32), XLA's FLOP count (``cost_analysis``: recomputation
   shows) and, for zshard, the bytes of one gathered block unit (the unit of the temp targets).
2. **Depth sweep**: the scanned GPT of config S at 2 / 8 / 32 layers, zshard FULL_SHARD and
   FSDP-compiler compile time (the fastest of two compiles, jax caches cleared before each).
3. **Scale by simulation** (``train/scale.py``, also ``python -m train.scale``): GPT-2 1.5B,
   Llama 7B and 70B shapes, seq 2048, one sequence per device, at 64 and 512 emulated devices,
   compiled ahead of time; per-device peak against :func:`train.scale.expected_peak`.
4. **GPU** (only when ``jax.default_backend() == "gpu"``; ``train/bench/gpu.py``, also ``python -m
   train.bench.gpu`` with llama-3.2-1b): zshard (FULL_SHARD on a 1x1 mesh) against the plain
   ``jax.jit`` step of the same code (same remat, bf16 compute), tokens/s, MFU, peak HBM.
5. **Quantized collectives** (``train/bench/quantized.py``; ``--no-quantized`` skips it): the
   reference GPT for ``--quant-steps`` (300) steps with ``python -m train``, exact and with int8
   weights, int8 and int4 gradients, fp8 tensorwise weights: held-out loss gaps beside the bytes.
6. **Expert parallelism** (``train/bench/moe.py``; ``--no-moe`` skips it, ``--moe-only`` runs it alone): a
   small Qwen3-MoE with its experts split over ``expert`` (1x4x2) against plain FSDP (1x8) on the same
   8 devices: gathered bytes (the expert weights' among them), all-to-all bytes and step time as ratios;
   the target: EP gathers at most half of the expert bytes (docs/expert-parallel.md).

The targets of issues 8 and 17 are printed at the end (``### Targets``).
"""

from train.bench.run import PROG, main
from train.bench.sections import CONFIGS, STRATEGIES, BenchConfig, median_ratio, train_flops_per_token

__all__ = ["CONFIGS", "PROG", "STRATEGIES", "BenchConfig", "main", "median_ratio", "train_flops_per_token"]
