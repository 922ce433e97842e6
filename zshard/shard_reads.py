"""Refuse, before compiling, a block unit's raw shard used as if it were the parameter.

Inside the step a block unit's parameters hold this device's padded shards (``[n_pad/N]``,
``[L, n_pad/N]`` stacked; zshard/intercept.py), so that the module passes through
``nnx.scan`` / ``nnx.remat`` / ``jax.vmap`` like any module. Read through the module
(``variable[...]``, ``.value``, a method of the unit) a parameter is gathered exactly. But
``jax.tree.leaves(nnx.state(model, nnx.Param))`` walks the raw values: an L2 penalty written
that way sums the squares of each device's padded slice, a wrong number that would train.

The traced step shows every such use. Its inputs that are block-unit shards are followed
through the primitives that only carry them (``scan``, ``while``, ``cond``, ``jit``,
``checkpoint``, ``custom_vjp_call``, ``shard_map``, ``pvary``, slicing / reshaping a layer of
a stacked parameter) into the sub-jaxprs; inside ``loss_fn`` (the named scope
:data:`LOSS_SCOPE`, which the train and eval steps put around it) any other primitive that
uses one outside zshard's own named scopes (``zshard.unit.*``: a unit's gather, forward and
backward, prefetch; ``zshard.read.*``: a parameter gathered where it is read) is refused,
naming the parameter. Outside ``loss_fn`` the step's own code (accumulation, the optimizer
update of the shards) is not judged. No compile: the walk reads the jaxpr the step traced
anyway for :func:`zshard.divergence.check_uniform_collectives`.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax

from zshard.units import path_str

__all__ = ["LOSS_SCOPE", "check_shard_reads", "block_shard_inputs"]

LOSS_SCOPE = "zshard.loss_fn"  # jax.named_scope around the user's loss_fn / eval fn
_OWN = ("zshard.unit.", "zshard.read.")  # zshard's gathers, unit calls and reads

# Primitives that hand a shard on with its values unchanged (a view, a copy, a type or
# placement mark, a layer's slice of a stacked parameter, a broadcast or concatenation): their
# outputs are followed like the shard itself, and a value computed from them is refused where
# it is computed (``reduce_sum``, ``mul``, ...).
_CARRY = frozenset(
    (
        "pvary",
        "pcast",
        "copy",
        "copy_p",
        "device_put",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "convert_element_type",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "concatenate",
        "slice",
        "dynamic_slice",
        "gather",
        "transpose",
        "optimization_barrier",
    )
)


def block_shard_inputs(plan, args) -> list:
    """Per leaf of ``jax.tree.leaves(args)`` (the traced step's inputs, in order), the path of
    the block-unit parameter whose shard it is, or ``None``.

    ``args``: the step's arguments, e.g. ``(state, batch)``, with ``state`` a
    :class:`zshard.ShardedState`; only ``state.params`` leaves are marked.
    """
    from flax import traverse_util

    block = {s.path for u in plan.units if u.path != () for s in u.slots}

    class _Mark:  # a pytree leaf carrying the path
        def __init__(self, path):
            self.path = path

    def mark(state):
        flat = traverse_util.flatten_dict(state.params)
        marked = traverse_util.unflatten_dict({p: _Mark(p if p in block else None) for p in flat})
        return state.__class__(marked, state.opt_state, state.step, state.plan, state.variables)

    state, *rest = args
    leaves = jax.tree.leaves((mark(state), *rest))
    return [x.path if isinstance(x, _Mark) else None for x in leaves]


def _jaxpr(v):
    return v.jaxpr if isinstance(v, jax.extend.core.ClosedJaxpr) else v


def _is_var(v) -> bool:
    return not isinstance(v, jax.extend.core.Literal)


def _scan_counts(p) -> tuple[int, int]:
    """``(number of consts, number of carries)`` of a ``scan`` eqn's inputs: jax 0.10 names them
    ``num_consts`` / ``num_carry``; jax 0.12 gives the input tree ``ft_in = (consts, carry, xs)``."""
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))


def _routes(eqn) -> list[tuple[Any, list, list]]:
    """``(sub_jaxpr, [(eqn input index, sub input index)], [(sub output index, eqn output index)])``
    for each sub-jaxpr an eqn runs with its inputs; ``[]`` for a primitive without one; ``None``
    for an unknown primitive whose sub-jaxprs' inputs do not line up with its own (not followed)."""
    name, p, n_in, n_out = eqn.primitive.name, eqn.params, len(eqn.invars), len(eqn.outvars)
    ident = lambda n: [(i, i) for i in range(n)]  # noqa: E731
    if name == "scan":
        body = _jaxpr(p["jaxpr"])
        nc, nk = _scan_counts(p)
        # inputs: consts + carry + xs (sliced per step); outputs: carry + ys (stacked); carry loops
        # body output k < nk is the next step's carry: it feeds body input nc + k too
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
    subs = [_jaxpr(v) for v in p.values() if isinstance(v, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))]
    if any(len(s.invars) != n_in or len(s.outvars) != n_out for s in subs):
        return None
    return [(s, ident(n_in), ident(n_out)) for s in subs]


def _refuse(path, var, eqn, plan) -> None:
    rec = plan.layouts.get(path)
    shape = tuple(var.aval.shape)
    logical = "" if rec is None else f", not the parameter of shape {((rec.layers,) if rec.layers else ()) + tuple(rec.shape)}"
    unit = "" if rec is None else f" of block unit {rec.unit!r}"
    try:  # the user's line, where JAX recorded it
        from jax._src import source_info_util

        where = f" at {source_info_util.summarize(eqn.source_info)}"
    except Exception:  # pragma: no cover - private API moved
        where = ""
    raise ValueError(
        f"zshard: parameter {path_str(path)!r}{unit}: the raw padded shard {list(shape)} (this device's "
        f"[n_pad/N] slice of its flat storage{logical}) was read by `{eqn.primitive.name}` in loss_fn{where}. "
        "Inside the step a block unit's parameters hold their shards, so jax.tree.leaves(nnx.state(model)) and "
        "other raw-value walks see slices, and the number would be silently wrong. Read the parameter through "
        "its variable instead, variable[...] (or .value), which gathers it exactly, e.g. "
        "sum(jnp.sum(v[...] ** 2) for v in jax.tree.leaves(nnx.state(model, nnx.Param), "
        "is_leaf=lambda x: isinstance(x, nnx.Variable))); or put an L2 penalty on the optimizer with "
        "optax.add_decayed_weights"
    )


def _walk(jaxpr, tainted: dict, plan, in_loss: bool) -> dict:
    """Follow ``tainted`` (var -> parameter path) through ``jaxpr``; returns the tainted outputs
    as ``{output index: path}``. Raises on a use inside ``loss_fn`` that is not zshard's own."""
    for eqn in jaxpr.eqns:
        used = [(i, tainted[v]) for i, v in enumerate(eqn.invars) if _is_var(v) and v in tainted]
        if not used:
            continue
        stack = str(eqn.source_info.name_stack)
        if any(s in stack for s in _OWN):
            continue  # a gather of the unit or of a read, its prefetch, its backward
        loss = in_loss or LOSS_SCOPE in stack
        name = eqn.primitive.name
        if name in _CARRY:
            for v in eqn.outvars:
                tainted[v] = used[0][1]
            continue
        routes = _routes(eqn)
        if routes is None:
            continue
        if not routes:
            if loss:
                i, path = used[0]
                _refuse(path, eqn.invars[i], eqn, plan)
            continue
        for sub, ins, outs in routes:
            sub_taint = {sub.invars[j]: tainted[eqn.invars[i]] for i, j in ins if _is_var(eqn.invars[i]) and eqn.invars[i] in tainted}
            while True:  # loops: an output fed back as an input, until nothing new is tainted
                out = _walk(sub, dict(sub_taint), plan, loss)
                grew = False
                for k, dest in outs:
                    if k not in out:
                        continue
                    if isinstance(dest, tuple):
                        v = sub.invars[dest[1]]
                        if v not in sub_taint:
                            sub_taint[v], grew = out[k], True
                    else:
                        tainted[eqn.outvars[dest]] = out[k]
                if not grew:
                    break
    return {k: tainted[v] for k, v in enumerate(jaxpr.outvars) if _is_var(v) and v in tainted}


def check_shard_reads(jaxpr, plan, paths: Iterable) -> None:
    """Walk a traced step; raise if ``loss_fn`` uses a block unit's raw shard as a value.

    Args:
      jaxpr: the traced step (``jax.jit(...).trace(...).jaxpr.jaxpr``).
      plan: the step's :class:`~zshard.planner.Plan` (names and shapes in the message).
      paths: per input of ``jaxpr``, the block-unit parameter path of the shard it is, or
        ``None`` (:func:`block_shard_inputs`).

    Raises:
      ValueError: naming the parameter path, the shard's local shape, the primitive that used it
        and the user's line, and the fix (``variable[...]``, or ``optax.add_decayed_weights``).
    """
    paths = list(paths)
    if len(paths) != len(jaxpr.invars):  # pragma: no cover - the step's own arguments, flattened
        raise AssertionError(f"zshard: {len(paths)} marked inputs for a step of {len(jaxpr.invars)} inputs")
    _walk(jaxpr, {v: p for v, p in zip(jaxpr.invars, paths) if p is not None}, plan, False)
