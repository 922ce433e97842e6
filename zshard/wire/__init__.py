"""The wire: how each parameter's bytes travel, resolved once and read by the collectives. The
per-parameter and per-unit records (wire.py), the gradient exit (grad_exit.py), the formats (quant.py,
precision.py), the collectives (collectives.py), hpZ (hpz.py) and error feedback (feedback.py)."""
