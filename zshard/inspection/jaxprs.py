"""Reading traced programs: sub-jaxprs, how an equation routes its operands into them, the mesh
axes a value varies over, and zshard's named scopes (built and parsed here only).

Every check that refuses a program before it compiles (:mod:`zshard.inspection.checks`) and every
optimizer pass that looks at the traced Optax update (:mod:`zshard.optim`,
:mod:`zshard.optim.optim_global`) walks jaxprs with these helpers, so a primitive that carries a
sub-program (``scan``, ``while``, ``cond``, ``jit``, ``checkpoint``, ``custom_vjp_call``,
``shard_map``) is understood the same way everywhere.

Scope names (``jax.named_scope``) mark zshard's own code in jaxprs and in the compiled HLO's
``op_name`` metadata:

- ``zshard.unit.<unit>.<method>``: one call of a block unit's method (its gathers, compute and
  reduce-scatters); ``zshard.unit.<unit>.forward`` / ``.backward``: the phases of the call;
  ``zshard.unit.root.gather``: the root unit's gather;
- ``zshard.read.<path>``: a unit parameter all-gathered where it is read outside its unit;
- ``zshard.loss_fn``: the user's ``loss_fn`` (or eval ``fn``);
- ``zshard.optimizer``: the global-view optimizer's collectives (:mod:`zshard.optim.optim_global`);
- ``zshard.context``: ``zshard.attention``'s collectives over ``context`` (:mod:`zshard.attention`).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import jax
import jax.extend as jex

__all__ = [
    "CONTEXT_SCOPE",
    "LOSS_SCOPE",
    "OPTIMIZER_SCOPE",
    "ROOT_GATHER_SCOPE",
    "inline_body",
    "is_own",
    "is_var",
    "read_scope",
    "routes",
    "scope_owner",
    "sub_jaxprs",
    "unit_of",
    "unit_scope",
    "varying",
]

LOSS_SCOPE = "zshard.loss_fn"
OPTIMIZER_SCOPE = "zshard.optimizer"
CONTEXT_SCOPE = "zshard.context"
_UNIT, _READ = "zshard.unit.", "zshard.read."
ROOT_GATHER_SCOPE = _UNIT + "root.gather"
_OWNER = re.compile(r"zshard\.(unit|read)\.([^/]+)")


def unit_scope(unit: str, phase: str) -> str:
    """``zshard.unit.<unit>.<phase>``: ``phase`` a method name, ``"forward"`` or ``"backward"``."""
    return f"{_UNIT}{unit}.{phase}"


def read_scope(path: str) -> str:
    """``zshard.read.<path>``: a unit parameter gathered where it is read (dotted path)."""
    return f"{_READ}{path}"


def is_own(name_stack: str) -> bool:
    """The equation was emitted by zshard's unit calls or reads (not by the user's code)."""
    return _UNIT in name_stack or _READ in name_stack


def scope_owner(name_stack: str) -> str | None:
    """``"unit 'blocks.0'"`` / ``"parameter 'blocks.0.w'"`` for an equation inside a unit call or
    a read; ``None`` outside zshard's scopes."""
    m = _OWNER.search(name_stack)
    if m is None:
        return None
    if m.group(1) == "unit":
        return f"unit {m.group(2).rsplit('.', 1)[0]!r}"
    return f"parameter {m.group(2)!r}"


def unit_of(name_stack: str) -> str | None:
    """The unit whose call (or gather) emitted an equation or HLO instruction: ``"blocks.0"``
    for ``.../zshard.unit.blocks.0.__call__/...``, ``"root"`` for the root unit's gather;
    ``None`` outside every ``zshard.unit.*`` scope."""
    m = re.search(r"zshard\.unit\.([^/]+)", name_stack)
    return m.group(1).rsplit(".", 1)[0] if m else None


def is_var(v) -> bool:
    """A jaxpr variable (not a literal constant)."""
    return not isinstance(v, jex.core.Literal)


def _jaxpr(v):
    return v.jaxpr if isinstance(v, jex.core.ClosedJaxpr) else v


def sub_jaxprs(eqn) -> Iterator[Any]:
    """Every ``Jaxpr`` an equation carries in its parameters (branches, bodies, conditions)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
                yield _jaxpr(v)


def varying(v) -> frozenset:
    """The manual mesh axes a jaxpr variable (or a traced value) varies over inside ``shard_map``."""
    aval = getattr(v, "aval", None)
    if aval is None and isinstance(v, jax.Array):
        aval = jax.typeof(v)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(getattr(manual, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", ()) or ())


def _scan_counts(p) -> tuple[int, int]:
    """``(number of consts, number of carries)`` of a ``scan`` equation's inputs: jax 0.10 names
    them ``num_consts`` / ``num_carry``; jax 0.12 gives the input tree ``ft_in = (consts, carry, xs)``."""
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))


def routes(eqn) -> list[tuple[Any, list, list]] | None:
    """How an equation feeds its sub-jaxprs.

    Returns ``(sub_jaxpr, [(eqn input index, sub input index)], [(sub output index, dest)])``
    per sub-jaxpr, ``dest`` an equation output index, or ``("in", j)`` for a loop body's output
    that is its own input ``j`` at the next iteration (a carry); ``[]`` for a primitive without
    sub-jaxprs; ``None`` for a primitive whose sub-jaxprs' inputs do not line up with its own
    operands (not followed).
    """
    name, p, n_in, n_out = eqn.primitive.name, eqn.params, len(eqn.invars), len(eqn.outvars)
    ident = lambda n: [(i, i) for i in range(n)]  # noqa: E731
    if name == "scan":
        body = _jaxpr(p["jaxpr"])
        nc, nk = _scan_counts(p)
        # inputs: consts + carry + xs (sliced per step); outputs: carry + ys (stacked); body
        # output k < nk is the next step's carry: it feeds body input nc + k too
        return [(body, ident(n_in), [(k, k) for k in range(n_out)] + [(k, ("in", nc + k)) for k in range(nk)])]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        body, cond = _jaxpr(p["body_jaxpr"]), _jaxpr(p["cond_jaxpr"])
        n_carry = n_in - cn - bn
        body_in = [(cn + i, i) for i in range(bn + n_carry)]
        body_out = [(k, k) for k in range(n_carry)] + [(k, ("in", bn + k)) for k in range(n_carry)]
        cond_in = [(i, i) for i in range(cn)] + [(cn + bn + k, cn + k) for k in range(n_carry)]
        return [(body, body_in, body_out), (cond, cond_in, [])]
    if name == "cond":
        return [(_jaxpr(b), [(i + 1, i) for i in range(n_in - 1)], ident(n_out)) for b in p["branches"]]
    subs = list(sub_jaxprs(eqn))
    if any(len(s.invars) != n_in or len(s.outvars) != n_out for s in subs):
        return None
    return [(s, ident(n_in), ident(n_out)) for s in subs]


_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"})


def inline_body(eqn) -> tuple[Any, list] | None:
    """``(jaxpr, consts)`` of a call-like equation (``jit``, ``custom_jvp_call``, ``checkpoint``,
    ...) whose body takes exactly its operands, to evaluate inline; ``None`` otherwise."""
    if eqn.primitive.name not in _INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        inner = getattr(j, "jaxpr", j)
        if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            return inner, list(getattr(j, "consts", ()))
    return None
