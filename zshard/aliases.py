"""The flat module paths of zshard 0.1 (``zshard.step``, ``zshard.units``, ...) as aliases for one release.

zshard 0.2 moved the modules that sat directly in ``zshard/`` into subpackages (docs/design.md
section 1). Code that imported an old path keeps working until the next release:
``import zshard.units`` / ``from zshard.units import UnitWarning`` gives the module that now
lives at :data:`MOVED` ``["zshard.units"]`` (``zshard.params.units``, the same module object,
so its classes and warnings are the same objects) and warns once with a ``DeprecationWarning``
naming the new path. Three old modules share their name with the package they moved into
(``zshard.mesh``, ``zshard.optim``, ``zshard.wire``): their old attributes
(``from zshard.mesh import make_mesh``) resolve through :func:`package_attr`, called by those
packages' module ``__getattr__`` (PEP 562), with the same warning.

Installed by ``import zshard`` (a ``sys.meta_path`` finder that only answers the names in
:data:`MOVED`); nothing else in zshard imports an old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install", "package_attr"]

# old module path -> new module path (zshard 0.1 -> 0.2)
MOVED = {
    "zshard.axes": "zshard.mesh.axes",
    "zshard.checks": "zshard.inspection.checks",
    "zshard.collectives": "zshard.wire.collectives",
    "zshard.evaluate": "zshard.programs.evaluate",
    "zshard.feedback": "zshard.wire.feedback",
    "zshard.flash": "zshard.context.flash",
    "zshard.flat": "zshard.params.flat",
    "zshard.grad_exit": "zshard.wire.grad_exit",
    "zshard.hlo": "zshard.inspection.hlo",
    "zshard.hpz": "zshard.wire.hpz",
    "zshard.intercept": "zshard.programs.intercept",
    "zshard.jaxprs": "zshard.inspection.jaxprs",
    "zshard.offload": "zshard.optim.offload",
    "zshard.optim_global": "zshard.optim.optim_global",
    "zshard.optim_shards": "zshard.optim.optim_shards",
    "zshard.planner": "zshard.plan.planner",
    "zshard.precision": "zshard.wire.precision",
    "zshard.quant": "zshard.wire.quant",
    "zshard.sequence": "zshard.context.sequence",
    "zshard.state": "zshard.plan.state",
    "zshard.step": "zshard.programs.step",
    "zshard.step_config": "zshard.programs.step_config",
    "zshard.strategy": "zshard.mesh.strategy",
    "zshard.tp": "zshard.params.tp",
    "zshard.unit_call": "zshard.programs.unit_call",
    "zshard.units": "zshard.params.units",
    "zshard.weights": "zshard.plan.weights",
}
# old modules whose name is now a package: package -> the module holding the old attributes
PACKAGE_MOVED = {"zshard.mesh": "zshard.mesh.mesh", "zshard.optim": "zshard.optim.optim", "zshard.wire": "zshard.wire.wire"}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} in zshard 0.2; the old path works until the next release: import {new}",
                  DeprecationWarning, stacklevel=3)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import zshard.<old>`` with the module at its new path (the same object)."""

    def __init__(self):
        self._specs = {}

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        _warn(spec.name, MOVED[spec.name])
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # the new module is already executed; the import system set its __spec__ to the old
        # name's: give it back its own
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def package_attr(package: str, name: str):
    """Attribute ``name`` of the old module ``package`` (``zshard.mesh`` / ``zshard.optim`` /
    ``zshard.wire``), from the module that holds it now, with a ``DeprecationWarning``.

    Raises:
      AttributeError: ``name`` was not in the old module either.
    """
    new = PACKAGE_MOVED[package]
    module = importlib.import_module(new)
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}")
    value = getattr(module, name)
    setattr(sys.modules[package], name, value)  # warned once: later reads find it on the package
    return value
