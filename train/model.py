"""The main job's models and their Hugging Face checkpoints, under one name.

The models live in ``train/models/`` (one module per family, a shared core), the
checkpoint maps in ``train/hf/`` (one module per family); this module re-exports both, so
``from train.model import GPT, Llama, from_hf, to_hf, cross_entropy_loss`` keeps working.
Neither package imports this one.
"""

from __future__ import annotations

from train.hf import from_hf, to_hf
from train.models import *  # noqa: F403
from train.models import __all__ as _models
from train.models.loss import token_nll as _token_nll  # noqa: F401  (the name docs/memory.md and train/scale.py use)

__all__ = [*_models, "from_hf", "to_hf"]
