"""Refuse, before compiling, a unit whose collectives only some devices would run.

Every device of a shard group must issue the same all-gathers and reduce-scatters in the
same order. A unit called under ``lax.cond`` (or ``lax.switch``, or a ``while_loop``)
whose predicate differs from device to device (it depends on the device's slice of the
batch) makes some devices wait in a collective that the others never enter: XLA aborts
after a timeout on CPU, a GPU hangs. Inside ``shard_map`` every value's type records the
mesh axes it varies over (``aval.vma``), so the traced step shows such a predicate.
"""

from __future__ import annotations

import re

import jax

__all__ = ["check_uniform_collectives"]

_COLLECTIVES = ("all_gather", "psum_scatter", "reduce_scatter", "psum", "all_to_all", "ppermute", "pmax", "pmin")
_UNIT = re.compile(r"zshard\.(unit|read)\.([^/]+)")


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _first_collective(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith(_COLLECTIVES):
            return eqn
        for sub in _subjaxprs(eqn):
            found = _first_collective(sub)
            if found is not None:
                return found
    return None


def _varying(var) -> frozenset:
    manual = getattr(getattr(var, "aval", None), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()) or ())


def _where(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    m = _UNIT.search(stack)
    if m:
        return f"unit {m.group(2).rsplit('.', 1)[0]!r}" if m.group(1) == "unit" else f"parameter {m.group(2)!r}"
    return f"a collective ({eqn.primitive.name})"


def check_uniform_collectives(jaxpr) -> None:
    """Walk a traced step; raise if a collective sits under device-dependent control flow.

    Raises:
      ValueError: naming the unit (or parameter) whose all-gather / reduce-scatter is under
        a ``cond`` / ``switch`` / ``while_loop`` whose predicate varies over mesh axes, and the fix.
    """
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        predicate = None
        if name == "cond":
            predicate = _varying(eqn.invars[0])
        elif name == "while":
            cond = eqn.params["cond_jaxpr"].jaxpr
            predicate = _varying(cond.outvars[0])
        if predicate:
            found = _first_collective(jaxpr=_Sub(list(_subjaxprs(eqn))))
            if found is not None:
                raise ValueError(
                    f"zshard: {_where(found)} is called under a jax.lax.{'cond/switch' if name == 'cond' else 'while_loop'} "
                    f"whose predicate differs between devices (it varies over mesh axes {sorted(predicate)}): devices "
                    "would disagree on which all-gathers and reduce-scatters to run and wait for each other forever. "
                    "Make the predicate the same on every device (compute it from parameters or constants, or reduce "
                    "it first, e.g. jax.lax.pmax(flag, ('replica', 'shard'))), or compute both branches and select "
                    "with jnp.where"
                )
        for sub in _subjaxprs(eqn):
            check_uniform_collectives(sub)


class _Sub:
    """Several jaxprs seen as one (the branches of a ``cond``)."""

    def __init__(self, jaxprs):
        self.eqns = [e for j in jaxprs for e in j.eqns]
