"""Wrap policy -> units: the groups of parameters that are all-gathered together.

A unit is a submodule whose ``__call__`` is run with its parameters gathered just in time
(FSDP's wrapped module, arXiv 2304.11277 section 3.1). By default each element of a
repeated-block container (an ``nnx.List`` of modules of one class) is a unit; everything
not inside a unit (embeddings, final norm, head) forms the root unit.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import numpy as np
from flax import nnx

__all__ = ["UnitWarning", "find_units", "path_str", "stacked_layers"]


class UnitWarning(UserWarning):
    """The default wrap policy left parameters that look like blocks in the root unit (:func:`find_units`)."""


_warned: set = set()  # messages already given (once per process)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UnitWarning, stacklevel=4)


def path_str(path: tuple) -> str:
    """``("blocks", 0, "attn")`` -> ``"blocks.0.attn"``; the root is ``"root"``."""
    return ".".join(str(p) for p in path) if path else "root"


def _modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and p]


def stacked_layers(module: nnx.Module) -> int | None:
    """``L`` when ``module`` holds ``L`` stacked layers (built with ``nnx.vmap``), else ``None``.

    Stacked means: at least two parameters, every one with a leading dimension of the same
    size ``L >= 2`` and at least 2 dimensions (a stacked vector ``[L, d]``), and at least one
    with 3 or more (a stacked matrix ``[L, d_in, d_out]``). Plain modules have differing
    leading dimensions, plain vectors, or a single kernel (a bias-free Conv or LinearGeneral).
    """
    shapes = [v.get_value().shape for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]
    if len(shapes) < 2 or min(len(s) for s in shapes) < 2 or max(len(s) for s in shapes) < 3:
        return None
    layers = shapes[0][0]
    return layers if layers >= 2 and all(s[0] == layers for s in shapes) else None


_CONTAINERS = (nnx.List, nnx.Dict)


def _repeated_blocks(model: nnx.Module) -> list[tuple]:
    # Modules held by a container (an nnx.List or nnx.Dict, nested containers included: a list
    # of lists of blocks), grouped by their outermost container and class: each class with at
    # least two members gives units. Containers themselves are never called, never units.
    containers = {tuple(p) for p, n in nnx.iter_graph(model) if isinstance(n, _CONTAINERS)}
    groups: dict[tuple, list] = defaultdict(list)
    for path, mod in _modules(model):
        if isinstance(mod, _CONTAINERS) or path[:-1] not in containers:
            continue
        top = path[:-1]
        while top[:-1] in containers and top[:-1] != top:
            top = top[:-1]
        groups[top, type(mod)].append(path)
    found = [p for members in groups.values() if len(members) >= 2 for p in members]
    # Stacked blocks (nnx.vmap-built, run with nnx.scan): one module holding L layers.
    found.extend(p for p, m in _modules(model) if stacked_layers(m) is not None)
    return found


def _outermost(paths: list[tuple]) -> list[tuple]:
    paths = sorted(set(paths), key=len)
    keep: list[tuple] = []
    for p in paths:
        if not any(p[: len(k)] == k for k in keep):
            keep.append(p)
    return keep


def _num_params(module: nnx.Module) -> int:
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param)))


def _size_based(model: nnx.Module, min_params: int) -> list[tuple]:
    # FSDP's size_based_auto_wrap_policy, bottom-up, without nesting: a module becomes a unit
    # when it holds >= min_params parameters and no descendant is a unit already.
    found: list[tuple] = []
    for path, mod in sorted(_modules(model), key=lambda pm: -len(pm[0])):  # deepest first
        if isinstance(mod, _CONTAINERS) or any(f[: len(path)] == path for f in found):  # containers are never called
            continue
        if _num_params(mod) >= min_params:
            found.append(path)
    return found


def find_units(model: nnx.Module, unit: Any = None) -> list[tuple]:
    """Module paths of the units of ``model`` (the root unit is implicit), in graph order.

    Args:
      model: the (possibly abstract) model.
      unit: the wrap policy (PyTorch FSDP's ``auto_wrap_policy``):

        - ``None``: repeated blocks (elements of an ``nnx.List`` of one module class) and
          modules of stacked layers (see :func:`stacked_layers`);
        - a module class or a tuple of classes: every outermost submodule of those classes;
        - a callable ``(path, module) -> bool``: the submodules it selects (they must not nest);
        - an int ``n``: size-based, the deepest submodules holding at least ``n`` parameters
          (a module whose descendant is already a unit is not wrapped again).

    Returns:
      Paths like ``("blocks", 0)``.

    Raises:
      ValueError: a class not in the model, a policy that selects nothing, a callable that
        selects nested (overlapping) modules, or a ``unit`` of another type.
    """
    if unit is None:
        found = _repeated_blocks(model)
    elif isinstance(unit, bool) or (isinstance(unit, (int, np.integer)) and unit < 1):
        raise ValueError(f"unit={unit!r}: a size-based policy takes a positive parameter count, e.g. unit=1_000_000")
    elif isinstance(unit, (int, np.integer)):
        found = _size_based(model, int(unit))
        if not found:
            biggest = max((_num_params(m) for _, m in _modules(model) if not isinstance(m, _CONTAINERS)), default=0)
            raise ValueError(f"unit={unit}: no submodule holds that many parameters (the largest holds {biggest:,}); lower it")
    elif isinstance(unit, type) or isinstance(unit, tuple):
        classes = unit if isinstance(unit, tuple) else (unit,)
        if not classes or not all(isinstance(c, type) and issubclass(c, nnx.Module) for c in classes):
            raise ValueError(f"unit={unit!r}: expected an nnx.Module subclass or a tuple of them (e.g. unit=Block)")
        found = [p for p, m in _modules(model) if isinstance(m, classes)]
        if not found:
            present = sorted({type(m).__name__ for _, m in _modules(model)})
            names = ", ".join(c.__name__ for c in classes)
            raise ValueError(
                f"unit={names}: no submodule of the model is an instance of it; "
                f"submodule classes present: {', '.join(present)}"
            )
    elif callable(unit):
        found = [p for p, m in _modules(model) if unit(p, m)]
        if not found:
            raise ValueError(f"unit={getattr(unit, '__name__', unit)!r}: the policy selected no submodule (it is called as policy(path, module))")
        for a in found:
            for b in found:
                if a != b and b[: len(a)] == a:
                    raise ValueError(
                        f"unit policy selected overlapping units {path_str(a)!r} and {path_str(b)!r}: "
                        f"units cannot nest; select only one of them"
                    )
    else:
        raise ValueError(
            f"unit={unit!r}: expected None, a module class, a tuple of classes, a callable "
            f"(path, module) -> bool, or a minimum parameter count"
        )
    order = {p: i for i, (p, _) in enumerate(_modules(model))}
    found = sorted(_outermost(found), key=lambda p: order[p])
    if unit is None:
        _warn_root_blocks(model, found)
    return found


def _warn_root_blocks(model: nnx.Module, found: list[tuple]) -> None:
    """Warn (:class:`UnitWarning`, once per message) when the default policy leaves blocks in the
    root unit: sibling attributes holding modules of one user class (``self.block0``,
    ``self.block1``), or no unit at all in a model with parameters below its top level (a UNet,
    whose stages are all different): the root unit is all-gathered whole for every step."""
    modules = _modules(model)
    params = {p: _num_params(m) for p, m in modules if not isinstance(m, _CONTAINERS)}
    siblings: dict[tuple, list] = defaultdict(list)
    containers = {tuple(p) for p, n in nnx.iter_graph(model) if isinstance(n, _CONTAINERS)}
    for path, mod in modules:
        inside = any(path[: len(u)] == u for u in found)
        # a block: a user class made of submodules (not a layer such as an Embed holding its own
        # parameters), the same parameter shapes as its siblings of that class
        composite = not type(mod).__module__.startswith("flax.") and any(
            q[: len(path)] == path and len(q) > len(path) and params.get(q, 0) for q, _ in modules)
        if not inside and composite and path[:-1] not in containers and params.get(path, 0) > 0:
            shapes = tuple((tuple(k), v.get_value().shape) for k, v in nnx.to_flat_state(nnx.state(mod, nnx.Param)))
            siblings[path[:-1], type(mod), shapes].append(path)
    for (parent, cls, _), paths in siblings.items():
        if len(paths) < 2:
            continue
        names = ", ".join(path_str(p) for p in paths)
        _warn_once(
            f"zshard: {names} are {len(paths)} modules of class {cls.__name__} kept as separate attributes of "
            f"{'the model' if not parent else repr(path_str(parent))}, so the default unit policy (an nnx.List of "
            "blocks) does not find them: they stay in the root unit, all-gathered whole for every step. Fix: hold them "
            f"in an nnx.List (self.blocks = nnx.List([...])), or pass unit={cls.__name__} to zshard.init; "
            "docs/your-model.md, 'How a unit runs'"
        )
    total = sum(params.get(p, 0) for p in params if len(p) == 1)
    if not found and total and sum(1 for p in params if params[p]) >= 2 and not any(len(v) >= 2 for v in siblings.values()):
        _warn_once(
            f"zshard: the default unit policy found no units in {type(model).__name__} (no nnx.List of two or more "
            "blocks of one class, no stacked layers): the whole model is one root unit, all-gathered for every "
            "step, so FSDP saves no memory for the parameters while they compute. Fix: choose units with "
            "zshard.init(..., unit=...): a module class (unit=ResBlock), a tuple of classes, a callable (path, "
            "module) -> bool, or a parameter count (unit=1_000_000: the deepest modules holding that many); "
            "docs/your-model.md, 'How a unit runs'"
        )
