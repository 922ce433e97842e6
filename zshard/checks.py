"""Refuse, before compiling, traced steps that would hang or give a silently wrong number.

Both checks read the jaxpr the step traced anyway (no extra trace, no compile), with the
walker helpers of :mod:`zshard.jaxprs`:

- :func:`check_uniform_collectives`: every device of a shard group must issue the same
  all-gathers and reduce-scatters in the same order. A unit called under ``lax.cond`` (or
  ``lax.switch``, or a ``while_loop``) whose predicate differs from device to device (it
  depends on the device's slice of the batch) makes some devices wait in a collective the
  others never enter: XLA aborts after a timeout on CPU, a GPU hangs. Inside ``shard_map``
  every value's type records the mesh axes it varies over, so the traced step shows it.
- :func:`check_shard_reads`: inside the step a block unit's parameters hold this device's
  padded shards (``[n_pad/N]``, ``[L, n_pad/N]`` stacked; zshard/intercept.py), so that the
  module passes through ``nnx.scan`` / ``nnx.remat`` / ``jax.vmap`` like any module. Read
  through the module (``variable[...]``, ``.value``, a method of the unit) a parameter is
  gathered exactly; but ``jax.tree.leaves(nnx.state(model, nnx.Param))`` walks the raw values,
  and an L2 penalty written that way sums the squares of each device's padded slice. The
  step's inputs that are block-unit shards are followed through the primitives that only
  carry them into the sub-jaxprs; inside ``loss_fn`` (the named scope
  :data:`zshard.jaxprs.LOSS_SCOPE`) any other primitive that uses one outside zshard's own
  scopes is refused, naming the parameter. Outside ``loss_fn`` the step's own code
  (accumulation, the optimizer update of the shards) is not judged.
"""

from __future__ import annotations

import dataclasses

from typing import Iterable

import jax
from flax import traverse_util

from zshard.jaxprs import LOSS_SCOPE, is_own, is_var, routes, scope_owner, sub_jaxprs, varying
from zshard.units import path_str

__all__ = ["block_shard_inputs", "check_shard_reads", "check_traced", "check_uniform_collectives"]

# --- a unit under device-dependent control flow ----------------------------------------------------------

_COLLECTIVES = ("all_gather", "psum_scatter", "reduce_scatter", "psum", "all_to_all", "ppermute", "pmax", "pmin")


def _first_collective(eqns):
    for eqn in eqns:
        if eqn.primitive.name.startswith(_COLLECTIVES):
            return eqn
        for sub in sub_jaxprs(eqn):
            found = _first_collective(sub.eqns)
            if found is not None:
                return found
    return None


def check_uniform_collectives(jaxpr) -> None:
    """Walk a traced step; raise if a collective sits under device-dependent control flow.

    Raises:
      ValueError: naming the unit (or parameter) whose all-gather / reduce-scatter is under
        a ``cond`` / ``switch`` / ``while_loop`` whose predicate varies over mesh axes, and the fix.
    """
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        predicate = frozenset()
        if name == "cond":
            predicate = varying(eqn.invars[0])
        elif name == "while":
            predicate = varying(eqn.params["cond_jaxpr"].jaxpr.outvars[0])
        if predicate:
            found = _first_collective([e for sub in sub_jaxprs(eqn) for e in sub.eqns])
            if found is not None:
                where = scope_owner(str(found.source_info.name_stack)) or f"a collective ({found.primitive.name})"
                raise ValueError(
                    f"zshard: {where} is called under a jax.lax.{'cond/switch' if name == 'cond' else 'while_loop'} "
                    f"whose predicate differs between devices (it varies over mesh axes {sorted(predicate)}): devices "
                    "would disagree on which all-gathers and reduce-scatters to run and wait for each other forever. "
                    "Make the predicate the same on every device (compute it from parameters or constants, or reduce "
                    "it first, e.g. jax.lax.pmax(flag, ('replica', 'shard'))), or compute both branches and select "
                    "with jnp.where"
                )
        for sub in sub_jaxprs(eqn):
            check_uniform_collectives(sub)


# --- a block unit's raw shard used as a value ------------------------------------------------------------

# Primitives that hand a shard on with its values unchanged (a view, a copy, a type or
# placement mark, a layer's slice of a stacked parameter, a broadcast or concatenation): their
# outputs are followed like the shard itself, and a value computed from them is refused where
# it is computed (``reduce_sum``, ``mul``, ...).
_CARRY = frozenset(
    """pvary pcast copy copy_p device_put sharding_constraint mesh_cast reshard convert_element_type reshape
    squeeze expand_dims broadcast_in_dim concatenate slice dynamic_slice gather transpose optimization_barrier""".split()
)


def block_shard_inputs(plan, args) -> list:
    """Per leaf of ``jax.tree.leaves(args)`` (the traced step's inputs, in order), the path of
    the block-unit parameter whose shard it is, or ``None``.

    ``args``: the step's arguments, e.g. ``(state, batch)``, with ``state`` a
    :class:`zshard.ShardedState`; only ``state.params`` leaves are marked.
    """
    block = {s.path for u in plan.units if u.path != () for s in u.slots}

    class _Mark:  # a pytree leaf carrying the path
        def __init__(self, path):
            self.path = path

    def mark(state):
        flat = traverse_util.flatten_dict(state.params)
        marked = traverse_util.unflatten_dict({p: _Mark(p if p in block else None) for p in flat})
        # offload="optimizer+master": the units read the masters' device copies (zshard.offload)
        copies = traverse_util.flatten_dict(state.device_params) if state.device_params else {}
        marked_copies = traverse_util.unflatten_dict({p: _Mark(p if p in block else None) for p in copies}) if copies else {}
        return dataclasses.replace(state, params=marked, device_params=marked_copies)

    state, *rest = args
    leaves = jax.tree.leaves((mark(state), *rest))
    return [x.path if isinstance(x, _Mark) else None for x in leaves]


def _refuse(path, var, eqn, plan) -> None:
    rec = plan.layouts.get(path)
    shape = tuple(var.aval.shape)
    logical = "" if rec is None else f", not the parameter of shape {rec.logical_shape}"
    unit = "" if rec is None else f" of block unit {rec.unit!r}"
    try:  # the user's line, where JAX recorded it
        from jax._src import source_info_util  # noqa: PLC0415  (private: guarded)

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
        used = [(i, tainted[v]) for i, v in enumerate(eqn.invars) if is_var(v) and v in tainted]
        if not used:
            continue
        stack = str(eqn.source_info.name_stack)
        if is_own(stack):
            continue  # a gather of the unit or of a read, its prefetch, its backward
        loss = in_loss or LOSS_SCOPE in stack
        if eqn.primitive.name in _CARRY:
            for v in eqn.outvars:
                tainted[v] = used[0][1]
            continue
        subs = routes(eqn)
        if subs is None:
            continue
        if not subs:
            if loss:
                i, path = used[0]
                _refuse(path, eqn.invars[i], eqn, plan)
            continue
        for sub, ins, outs in subs:
            sub_taint = {sub.invars[j]: tainted[eqn.invars[i]] for i, j in ins if is_var(eqn.invars[i]) and eqn.invars[i] in tainted}
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
    return {k: tainted[v] for k, v in enumerate(jaxpr.outvars) if is_var(v) and v in tainted}


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


def check_traced(jaxpr, state, batch, *, collectives: bool = True) -> None:
    """Both checks of a traced step whose inputs are ``(state, batch)`` flattened
    (``collectives=False``: the shard reads only)."""
    if collectives:
        check_uniform_collectives(jaxpr)
    check_shard_reads(jaxpr, state.plan, block_shard_inputs(state.plan, (state, batch)))
