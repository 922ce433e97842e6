"""The wire: how each parameter's bytes travel, resolved once and read by the collectives. The
per-parameter and per-unit records (wire.py), the gradient exit (grad_exit.py), the formats (quant.py,
precision.py), the collectives (collectives.py), hpZ (hpz.py) and error feedback (feedback.py)."""


def __getattr__(name):  # the flat module zshard.wire of zshard 0.1 (zshard/aliases.py)
    from zshard.aliases import package_attr

    return package_attr(__name__, name)
