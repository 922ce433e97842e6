"""The emulated CPU device count of every ``python -m train...`` program, in one place.

    import jax
    from train.devices import emulate_devices
    emulate_devices(8)            # after ``import jax``, before the first computation

:func:`emulate_devices` sets jax's ``jax_num_cpu_devices`` option (and, for the benchmark,
XLA's scheduling flags): both are read when jax starts its backend, at the first
``jax.devices()`` or computation, so importing jax (and zshard, flax, optax) first is fine.
The option wins over an ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``.

Child processes do not inherit it: ``python -m zshard.launch`` gives each of its processes
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` in its environment, which
``python -m train`` keeps (:func:`train.cli.device_count`); ``train.scale``'s workers
call :func:`emulate_devices` themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

__all__ = ["DEVICE_FLAG", "emulate_devices"]

DEVICE_FLAG = "--xla_force_host_platform_device_count"
"""XLA's own flag for the emulated CPU device count (``XLA_FLAGS``), as the launcher sets it."""


def emulate_devices(n: int | None, *, cpu_only: bool = False, xla_flags: Sequence[str] = ()) -> bool:
    """Ask jax for ``n`` emulated CPU devices in this process, before its backend starts.

    Args:
      n: CPU devices (``jax.config.update("jax_num_cpu_devices", n)``); ``None``: leave the
        count as it is (``XLA_FLAGS`` or jax's default of one).
      cpu_only: also run on the CPU even where an accelerator exists (``jax_platforms="cpu"``),
        unless ``JAX_PLATFORMS`` says otherwise (planning and scale simulation emulate devices
        whatever the machine has).
      xla_flags: flags appended to ``XLA_FLAGS`` (those whose name is not there yet), read by
        XLA when the backend starts (the benchmark's GPU scheduling flags).

    Returns:
      ``True`` when applied; ``False`` when jax's backend runs already (jax computed something
      in this process, as in a test process that calls a program's ``main``): its devices
      stand, and the caller checks that there are as many as it needs.
    """
    try:
        if n is not None:
            jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError:  # "should be updated before backends are initialized"
        return False
    if cpu_only and not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    if xla_flags:
        have = os.environ.get("XLA_FLAGS", "").split()
        names = {f.split("=")[0] for f in have}
        os.environ["XLA_FLAGS"] = " ".join(have + [f for f in xla_flags if f.split("=")[0] not in names])
    return True
