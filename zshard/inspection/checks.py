"""Refuse, before compiling, traced steps that would hang or give a silently wrong number.

Both checks read the jaxpr the step traced anyway (no extra trace, no compile), with the
walker helpers of :mod:`zshard.inspection.jaxprs`; :func:`traced` runs that trace and explains the one
error model code meets while being traced (a pmap-era axis name):

- :func:`check_uniform_collectives`: every device of a shard group must issue the same
  all-gathers and reduce-scatters in the same order. A unit called under ``lax.cond`` (or
  ``lax.switch``, or a ``while_loop``) whose predicate differs from device to device (it
  depends on the device's slice of the batch) makes some devices wait in a collective the
  others never enter: XLA aborts after a timeout on CPU, a GPU hangs. Inside ``shard_map``
  every value's type records the mesh axes it varies over, so the traced step shows it.
- :func:`check_shard_reads`: inside the step a block unit's parameters hold this device's
  padded shards (``[n_pad/N]``, ``[L, n_pad/N]`` stacked; zshard/programs/intercept.py), so that the
  module passes through ``nnx.scan`` / ``nnx.remat`` / ``jax.vmap`` like any module. Read
  through the module (``variable[...]``, ``.value``, a method of the unit) a parameter is
  gathered exactly; but ``jax.tree.leaves(nnx.state(model, nnx.Param))`` walks the raw values,
  and an L2 penalty written that way sums the squares of each device's padded slice. The
  step's inputs that are block-unit shards are followed through the primitives that only
  carry them into the sub-jaxprs; inside ``loss_fn`` (the named scope
  :data:`zshard.inspection.jaxprs.LOSS_SCOPE`) any other primitive that uses one outside zshard's own
  scopes is refused, naming the parameter. Outside ``loss_fn`` the step's own code
  (accumulation, the optimizer update of the shards) is not judged.
- :func:`traced`: model code written for ``pmap`` names its axis (``nnx.BatchNorm(...,
  axis_name='batch')``, Linen's ``nn.BatchNorm`` in flax's ImageNet ResNet,
  ``jax.lax.pmean(x, 'data')``); zshard's step is a ``shard_map`` over ``("replica",
  "shard")``, where JAX fails on the unknown name with a bare ``AssertionError`` (or a
  ``NameError``). The trace is then repeated with JAX's traceback filtering off, and the
  collective's frame gives the axis name, the module (its path in the model) and the line.
  Model code written for JAX's explicit sharding (an activation's ``out_sharding=`` or
  ``jax.sharding.reshard`` naming a mesh axis) is explained the same way
  (:func:`zshard.params.tp.activation_annotation_error`).
- :func:`warn_uniform_keys`: a random draw in ``loss_fn`` (``random_bits``: dropout masks,
  noise) whose key is the same on every device (made in ``loss_fn``, ``nnx.Rngs(dropout=0)``,
  ``jax.random.key(step)``: its type does not vary over ``replica`` / ``shard``) and whose bits
  then meet per-device data element for element (an operation whose result varies over those
  axes and has the bits' shape: ``select``, ``mul``) gives every device the same mask for its
  own rows: warned once per call site, naming it and ``zshard.device_key``. The
  model's own ``nnx.Rngs`` streams are folded per device (zshard/programs/intercept.py) and pass; draws
  outside ``loss_fn`` (initialisers run in ``zshard.init``; Optax noise, handled by the
  optimizer) and draws that meet the batch only through a contraction (a random weight in a
  matmul) or never are not flagged.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
from flax import nnx, traverse_util

from zshard.inspection.jaxprs import LOSS_SCOPE, is_own, is_var, routes, scope_owner, sub_jaxprs, varying
from zshard.params.tp import activation_annotation_error
from zshard.params.units import path_str

__all__ = ["block_shard_inputs", "check_shard_reads", "check_traced", "check_uniform_collectives", "traced",
           "warn_uniform_keys"]

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
        # offload="optimizer+master": the units read the masters' device copies (zshard.optim.offload)
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
      plan: the step's :class:`~zshard.plan.planner.Plan` (names and shapes in the message).
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
    (``collectives=False``: the shard reads only), and the warning of :func:`warn_uniform_keys`."""
    if collectives:
        check_uniform_collectives(jaxpr)
    check_shard_reads(jaxpr, state.plan, block_shard_inputs(state.plan, (state, batch)))
    warn_uniform_keys(jaxpr, batch)


# --- a collective over an axis name the mesh does not have (pmap-era code) ------------------------------

_PARALLEL = str(Path("jax") / "_src" / "lax" / "parallel.py")


def _frames(tb) -> list:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _module_path(model, target) -> str | None:
    """``'blocks.0.bn'``: where ``target`` sits in ``model`` (``nnx.iter_graph``; ``''``: the model), or ``None``."""
    try:
        for path, node in nnx.iter_graph(model):
            if node is target:
                return ".".join(str(k) for k in path)  # "" for the model itself
    except Exception:  # noqa: BLE001 - a model graph that cannot be walked mid-trace: no path
        return None
    return None


def _which_module(frames) -> str:
    """The innermost module (``self``) of the failing call, with its path in the model when known:
    ``"module 'blocks.0.bn' (nnx.BatchNorm)"``; a Linen module inside ``nnx.bridge.ToNNX`` adds its scope path."""
    model = next((f.f_locals["model"] for f, _ in frames if isinstance(f.f_locals.get("model"), nnx.Module)), None)
    outer = None  # the innermost NNX module holding a Linen one (bridge.ToNNX)
    for f, _ in frames:
        obj = f.f_locals.get("self")
        if isinstance(obj, nnx.Module):
            outer = obj
    for f, _ in reversed(frames):
        obj = f.f_locals.get("self")
        home = type(obj).__module__
        kind = f"{home.split('.')[1] if home.startswith('flax.') else home}.{type(obj).__qualname__}"  # nnx.BatchNorm, linen.BatchNorm
        if isinstance(obj, nnx.Module):
            path = None if model is None else _module_path(model, obj)
            return f"module {path!r} ({kind})" if path else f"the model ({kind})" if path == "" else f"module {kind}"
        scope = getattr(obj, "scope", None)
        if type(obj).__module__.startswith("flax.linen") or (scope is not None and hasattr(scope, "path") and hasattr(obj, "setup")):
            inner = "/".join(getattr(scope, "path", ()) or ())
            bridge = None if model is None or outer is None else _module_path(model, outer)
            held = "" if bridge is None else (" inside the nnx.bridge model" if bridge == "" else f" inside the nnx.bridge module {bridge!r}")
            return f"Linen module {inner!r} ({kind}{held})" if inner else f"Linen module {kind}{held}"
    return "the model"


def _unknown_axis_error(trace: Callable[[], Any], mesh) -> ValueError | None:
    prev = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")  # the collective's own frame names the axis
    try:
        trace()
        return None
    except (AssertionError, NameError) as e:
        frames = _frames(e.__traceback__)
    finally:
        jax.config.update("jax_traceback_filtering", prev)
    first = next((i for i, (f, _) in enumerate(frames) if f.f_code.co_filename.endswith(_PARALLEL) and "axis_name" in f.f_locals), None)
    if first is None or first == 0:
        return None
    axis_name = frames[first][0].f_locals["axis_name"]
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    unknown = [a for a in names if a not in mesh.axis_names]
    if not unknown:
        return None
    def at(i: int) -> str:
        f, line = frames[i]
        return f"{f.f_code.co_filename}:{line} ({f.f_code.co_name})"

    library = ("site-packages", "dist-packages", str(Path(__file__).parent.parent))
    user = next((i for i in range(first - 1, -1, -1) if not any(x in frames[i][0].f_code.co_filename for x in library)), None)
    where = at(first - 1) + ("" if user in (None, first - 1) else f", called from {at(user)}")
    data = tuple(a for a in mesh.axis_names if a != "tensor")
    return ValueError(
        f"zshard: {_which_module(frames[:first])} calls jax.lax.{frames[first][0].f_code.co_name} over the axis name "
        f"{unknown[0]!r} at {where}, but the step runs in a shard_map over the mesh axes {tuple(mesh.axis_names)}: "
        f"{unknown[0]!r} is an axis name of pmap-era code (pmap(..., axis_name={unknown[0]!r})) and does not exist here. "
        f"Name the data axes instead, axis_name={data!r} (for BatchNorm: statistics over every device's rows, equal to "
        "one device on the global batch, as PyTorch's SyncBatchNorm), or drop axis_name (each device normalises "
        "its own rows, as DDP without SyncBatchNorm); docs/your-model.md, 'BatchNorm'"
    )


def traced(trace: Callable[[], Any], mesh) -> Any:
    """``trace()`` (a jitted step's ``.trace(...)``), with two errors explained.

    Raises:
      ValueError: (before compiling) the model calls a collective (``psum``, ``pmean``,
        ``axis_index``, ...) over an axis name ``mesh`` does not have, as code written for
        ``pmap(..., axis_name='batch')`` does; the message names the module (its path in the
        model), the axis name, the line, and the fix (``axis_name=("replica", "shard")``).
        Or the model annotates an activation with mesh axes, as code written for JAX's explicit
        sharding does (:func:`zshard.params.tp.activation_annotation_error`): named with the line and the fix.
      Anything else ``trace()`` raises, unchanged.
    """
    try:
        return trace()
    except (AssertionError, NameError):
        error = _unknown_axis_error(trace, mesh)
        if error is None:
            raise
    except ValueError as e:
        error = activation_annotation_error(e, mesh)
        if error is None:
            raise
    raise error


# --- a key that is the same on every device, drawn for per-device rows ------------------------------------

_DATA = frozenset(("replica", "shard"))
_DRAWS = frozenset(("random_bits", "threefry2x32"))
_warned: set = set()  # call sites warned about (once per process)


class UniformKeyWarning(UserWarning):
    """A random draw in ``loss_fn`` uses a key that is the same on every device (:func:`warn_uniform_keys`)."""


def _call_site(eqn) -> str:
    try:  # the innermost frame outside the installed libraries, else JAX's own summary
        from jax._src import source_info_util  # noqa: PLC0415  (private: guarded)

        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
        mine = [f for f in frames if "site-packages" not in f.file_name and "dist-packages" not in f.file_name]
        f = (mine or frames)[0]
        return f"{f.file_name}:{f.start_line} ({f.function_name})"
    except Exception:  # pragma: no cover - private API moved
        return "loss_fn"


def _key_walk(jaxpr, tainted: dict, in_loss: bool, found: list) -> dict:
    """Follow the bits of uniform-key draws through ``jaxpr`` (``tainted``: var -> the loss_fn-level
    equation that drew them); append to ``found`` each such equation whose bits reach a value
    varying over the data axes. Returns the tainted outputs as ``{output index: eqn}``."""
    for eqn in jaxpr.eqns:
        loss = in_loss or LOSS_SCOPE in str(eqn.source_info.name_stack)
        if not loss:  # the step's own code: only loss_fn inside it is judged
            for sub in sub_jaxprs(eqn):
                _key_walk(sub, {}, False, found)
            continue
        if eqn.primitive.name in _DRAWS and is_var(eqn.invars[0]) and not varying(eqn.invars[0]) & _DATA:
            for v in eqn.outvars:
                tainted[v] = eqn
            continue
        used = [tainted[v] for v in eqn.invars if is_var(v) and v in tainted]
        subs = routes(eqn) or []
        if not used and not subs:
            continue
        if used and not subs:
            rows = [v for v in eqn.outvars if varying(v) & _DATA]
            if eqn.primitive.name in _CARRY or not rows:  # still the same bits (a cast, a broadcast, pvary)
                for v in eqn.outvars:
                    tainted[v] = used[0]
            elif any(v in tainted and v.aval.shape == rows[0].aval.shape for v in eqn.invars if is_var(v)):
                found.append(used[0])  # element for element with per-device values: the same mask on every device's rows
            continue
        for sub, ins, outs in subs:  # a call, a loop, a branch: draws inside it, bits carried through it
            sub_taint = {sub.invars[j]: tainted[eqn.invars[i]] for i, j in ins if is_var(eqn.invars[i]) and eqn.invars[i] in tainted}
            before = len(found)
            out = _key_walk(sub, sub_taint, True, found)
            for k in range(before, len(found)):  # name the draw by the loss_fn-level equation holding it
                if found[k] not in tainted.values():
                    found[k] = eqn
            for k, dest in outs:
                if k in out and not isinstance(dest, tuple):
                    tainted[eqn.outvars[dest]] = eqn if out[k] not in tainted.values() else out[k]
    return {k: tainted[v] for k, v in enumerate(jaxpr.outvars) if is_var(v) and v in tainted}


def _same_batch_keys(batch) -> list[str]:
    """``"batch leaf [i]"`` for each typed key array in ``batch`` (``jax.random.key``, split over
    the devices with the rows) whose rows are all one key: its type varies over the devices, its
    value does not. Read from the host only for key leaves, once per trace."""
    same = []
    for i, x in enumerate(jax.tree.leaves(batch)):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) and x.ndim and x.shape[0] > 1:
            if getattr(x, "is_fully_addressable", True):
                data = np.asarray(jax.random.key_data(x)).reshape(x.shape[0], -1)  # [B, key words]
                if (data == data[:1]).all():
                    same.append(f"batch leaf [{i}] ({x.shape[0]} copies of one key)")
    return same


def warn_uniform_keys(jaxpr, batch=None) -> list[str]:
    """Warn (:class:`UniformKeyWarning`, once per call site) about each random draw in
    ``loss_fn`` whose key is the same on every device while its bits meet per-device data,
    and about a key array in ``batch`` whose rows are all one key; returns what was found
    (``"file:line (function)"``, ``"batch leaf [i] ..."``)."""
    found: list = []
    _key_walk(jaxpr, {}, False, found)
    sites = list(dict.fromkeys(_call_site(e) for e in found)) + ([] if batch is None else _same_batch_keys(batch))
    for site in sites:
        if site in _warned:
            continue
        _warned.add(site)
        what = (f"{site} is the same key on every device" if site.startswith("batch leaf") else
                f"the random draw at {site} in loss_fn uses a key that is the same on every device (made in loss_fn, "
                "e.g. nnx.Rngs(dropout=0) or jax.random.key(step), or passed in)")
        warnings.warn(
            f"zshard: {what}, so every device draws the same dropout mask / noise for its own rows. Fold the device "
            "in: key = zshard.device_key(key) inside loss_fn (or keep the stream in the model, nnx.Dropout(rate, "
            "rngs=rngs), which zshard folds per device); docs/your-model.md, 'RNG streams'",
            UniformKeyWarning,
            stacklevel=2,
        )
    return sites
