"""The main job: a byte-level GPT trained with zshard.

    python -m train                                   # 8 emulated CPU devices, FULL_SHARD 1x8
    python -m train --strategy HYBRID_SHARD --mesh 2x4
    python -m train --data /path/to/text.txt --steps 500 --out runs/shakespeare

Modules:

- ``train.model``: the GPT (Flax NNX), its presets and the loss.
- ``train.data``: byte corpus, held-out split, batches.
- ``train.__main__``: the command line (``python -m train --help``).

This file imports nothing: ``python -m train`` must set ``XLA_FLAGS`` (the emulated device
count) before the first ``import jax``, and ``train.model`` imports jax.
"""
