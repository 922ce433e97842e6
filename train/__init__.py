"""The main job: a byte-level GPT trained with zshard.

    python -m train                                   # 8 emulated CPU devices, FULL_SHARD 1x8
    python -m train --strategy HYBRID_SHARD --mesh 2x4
    python -m train --data /path/to/text.txt --steps 500 --out runs/shakespeare

The modules, by what they own (README "Layout" lists them all):

- the run: ``__main__`` (the entry point) over ``trainer`` (``Trainer``: build, loop, finish),
  ``hooks`` (evaluation, samples, checkpoints, each with its ``due(step)``), ``metrics``
  (every step), ``summary``, ``output`` (run folders, Ctrl-C), ``checkpointing`` (resume);
- the configuration: ``sections`` (one dataclass per ``[table]``), ``config`` (``Config``:
  checks, derived values), ``flags`` (TOML and flag plumbing), ``cli`` (the parser), ``job``
  (``validate`` -> ``Setup``), ``devices`` (the emulated device count);
- the model and data: ``models`` (a package: the GPT, Llama with Mistral / Qwen2 / Qwen3, Gemma,
  Qwen3-MoE), ``hf`` (a package: Hugging Face in and out, one module per family), ``model``
  (re-exports both), ``data``, ``generate``;
- the other programs: ``plan``, ``scale``, ``bench`` (a package), ``plot``, ``sample``.

This file imports nothing, so ``python -m train`` installs its Ctrl-C handler before jax loads.
"""
