"""Host offload: the optimizer state (and the fp32 masters) in pinned host memory, updated on the device.

``zshard.init(..., offload=...)`` (ZeRO-Offload's layout, Ren et al. 2021, arXiv 2101.06840
sections 4.1-4.2; MaxText's ``optimizer_memory_host_offload``; FSDP2's ``CPUOffloadPolicy``):

- ``"optimizer"``: every Optax state leaf with at least one dimension (Adam's ``mu`` / ``nu``,
  each a parameter's ``[n_pad/N]`` slice; Adafactor's factors) lives in ``pinned_host``; the
  scalars (``count``) and the parameters stay in device memory. Adam in fp32, per device: the
  device keeps ``4 Psi / N`` of parameters, the host holds ``8 Psi / N``.
- ``"optimizer+master"``: with ``MixedPrecision(param_dtype=...)`` narrower than the parameters,
  each such trainable parameter (its fp32 *master* shard) lives in ``pinned_host`` too, and
  :attr:`ShardedState.device_params <zshard.ShardedState>` keeps a ``param_dtype`` copy of it in
  device memory, which the all-gathers read: the device keeps ``2 Psi / N`` of parameters, the
  host ``4 Psi / N + 8 Psi / N``.

Gradients never leave the device. Each step moves every offloaded leaf to the device and back
once: ``2 * (8 Psi / N)`` bytes per device per step for Adam (``2 * (12 Psi / N)`` with the
masters), ZeRO-Offload's "2 x" of section 4.2 (its CPU update replaced by a device update: the
update stays on the accelerator, as MaxText, axlearn and Megatron do).

This module owns where each leaf lives (:func:`state_shardings`, :func:`master_paths`), the
checks before anything compiles (:func:`check_backend`, :func:`check_masters`,
:func:`check_placement`), the transfers around the optimizer update (:func:`update_offloaded`,
[Note: offload update]), the device copies of the masters (:func:`with_device_params`), and
the accounting of host / device bytes against the GPU program exported on any machine
(:func:`exported_placements`, :func:`offload_report`).

What a CPU cannot show: XLA:CPU treats a transfer inside a program as a no-op and
``memory_analysis()`` reports 0 host bytes there; the placement of every array (its
``sharding.memory_kind``) and the GPU program's ``annotate_device_placement`` calls
(``jax.export.export(..., platforms=["cuda"])``, which runs on a CPU-only machine) can be
checked anywhere; the HBM saved and the time of the transfers only on a GPU
(``python -m train.bench --offload``).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding

from zshard.inspection.jaxprs import varying

__all__ = [
    "DEVICE", "HOST", "MODES", "check_backend", "check_masters", "check_placement", "compute_params", "device_param_specs",
    "exported_placements", "gather_source", "is_host", "master_paths", "memory_kind", "memory_split", "offload_report",
    "opt_shardings", "parse_offload", "state_shardings", "to_device", "to_host", "traced_naming_host_leaf", "update_offloaded",
    "with_device_params",
]  # fmt: skip

HOST = "pinned_host"
DEVICE = "device"
MODES = ("optimizer", "optimizer+master")


# --- policy ----------------------------------------------------------------------------------------


def parse_offload(value) -> str | None:
    """``None`` / ``"none"`` -> ``None``; ``"optimizer"`` / ``"optimizer+master"`` as they are.

    Raises:
      ValueError: any other value, naming the choices.
    """
    if value is None or value == "none":
        return None
    if value not in MODES:
        raise ValueError(f"offload={value!r}: choose None (everything in device memory), 'optimizer' or 'optimizer+master'")
    return value


def check_backend(mesh, mode: str) -> None:
    """Every device of ``mesh`` this process addresses has ``pinned_host`` memory.

    Raises:
      ValueError: naming the first device without it, its platform and its memory kinds, and the fix.
    """
    for d in np.asarray(mesh.devices).flat:
        if getattr(d, "process_index", 0) != jax.process_index():
            continue
        try:
            kinds = [m.kind for m in d.addressable_memories()]
        except (AttributeError, NotImplementedError, RuntimeError):
            kinds = []
        if HOST not in kinds:
            raise ValueError(
                f"offload={mode!r}: device {d} (platform {getattr(d, 'platform', '?')!r}) has no {HOST!r} memory "
                f"(its memory kinds: {kinds or 'none reported'}); host offload needs a backend with pinned host memory "
                "(GPU, TPU, or CPU): use offload=None on this backend"
            )


def master_paths(plan) -> frozenset:
    """Paths of the trainable parameters whose master lives on the host (``"optimizer+master"``):
    those gathered in a narrower dtype than they are stored in (``MixedPrecision.param_dtype``)."""
    if plan.offload != "optimizer+master":
        return frozenset()
    return frozenset(
        p for p, rec in plan.layouts.items()
        if rec.trainable and np.dtype(plan.mp.gather_dtype(rec.dtype)).itemsize < rec.dtype.itemsize
    )  # fmt: skip


def check_masters(plan) -> None:
    """``"optimizer+master"`` needs at least one master to offload.

    Raises:
      ValueError: no trainable parameter has a lower ``param_dtype`` (naming the dtypes and the fix).
    """
    if plan.offload == "optimizer+master" and not master_paths(plan):
        dtypes = sorted({rec.dtype.name for rec in plan.layouts.values() if rec.trainable})
        raise ValueError(
            f"offload='optimizer+master' keeps a param_dtype copy of each fp32 master on the device for the gathers, "
            f"so it needs MixedPrecision(param_dtype=...) lower than the trainable parameters' dtype ({', '.join(dtypes)}); "
            f"got param_dtype={None if plan.mp.param_dtype is None else plan.mp.param_dtype.name}. Pass "
            "mixed_precision=zshard.MixedPrecision(param_dtype='bfloat16'), or offload='optimizer'"
        )


def _offloaded_leaf(x) -> bool:
    """An optimizer-state leaf that ``offload`` puts on the host: one with a dimension (scalars stay)."""
    return len(getattr(x, "shape", ())) >= 1


def opt_shardings(plan, opt_shapes):
    """The ``NamedSharding`` of each optimizer-state leaf: ``plan.opt_specs``, in ``pinned_host``
    for the leaves :func:`_offloaded_leaf` selects when ``plan.offload`` is set."""
    return jax.tree.map(
        lambda x, spec: NamedSharding(plan.mesh, spec, memory_kind=HOST if plan.offload and _offloaded_leaf(x) else None),
        opt_shapes,
        plan.opt_specs,
    )


def state_shardings(state, base):
    """``base`` (a :class:`~zshard.ShardedState` of ``NamedSharding``\\ s on the device) with the
    memory kinds of ``state.plan.offload``: the offloaded optimizer leaves and masters in
    ``pinned_host``; everything else, ``device_params`` included, in device memory."""
    plan = state.plan
    if not plan.offload:
        return base
    masters = master_paths(plan)
    host = lambda sh: sh.with_memory_kind(HOST)  # noqa: E731
    params = {p: host(sh) if p in masters else sh for p, sh in traverse_util.flatten_dict(base.params).items()}
    opt = jax.tree.map(lambda x, sh: host(sh) if _offloaded_leaf(x) else sh, state.opt_state, base.opt_state)
    return dataclasses.replace(base, params=traverse_util.unflatten_dict(params), opt_state=opt)


def device_param_specs(plan) -> dict:
    """PartitionSpecs of ``ShardedState.device_params``: each master's own (``{}`` without masters)."""
    masters = master_paths(plan)
    return traverse_util.unflatten_dict({p: plan.layouts[p].spec for p in masters}) if masters else {}


# --- inside a program ------------------------------------------------------------------------------


def is_host(x) -> bool:
    """``x`` (traced or concrete) is in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_device(x):
    """``x`` in device memory (a copy from the host inside a program; ``x`` itself when it is there)."""
    return jax.device_put(x, jax.memory.Space.Device) if is_host(x) else x


def to_host(x):
    """``x`` in pinned host memory (inside a program)."""
    return jax.device_put(x, jax.memory.Space.Host)


def compute_params(plan, state, train: dict) -> dict:
    """The trainable shards the step gathers and differentiates: ``train`` itself, or with
    ``"optimizer+master"`` each host master's device copy (``param_dtype``) in its place
    ([Note: master cotangents]).

    The gathers cast a shard to ``param_dtype`` before they move it, so the copies
    (``param_dtype(master)``) give the bits a ``MixedPrecision`` step without offload gathers."""
    masters = master_paths(plan)
    if not masters:
        return train
    copies = traverse_util.flatten_dict(state.device_params)
    flat = traverse_util.flatten_dict(train)
    return traverse_util.unflatten_dict({p: copies[p] if p in masters else x for p, x in flat.items()})


# [Note: master cotangents] With ``"optimizer+master"`` the step differentiates the ``param_dtype``
# copies, and each gather's backward hands back the reduced gradient in the *master* dtype (as it
# does without offload: ``zshard.wire.collectives.reduce_flats``), a wider floating cotangent than its
# primal, which JAX accepts for a custom_vjp (``_temporary_dtype_exception`` in
# ``jax/_src/custom_derivatives.py``, jax 0.10 to 0.12; tests/test_offload.py pins it). So the
# gradients are bitwise those of the same mixed precision without offload, whatever the
# ``reduce_dtype``, and no master-dtype view of the copies exists on the device: upcasting the
# copies first (``copy.astype(float32)``, a differentiable fp32 input) would be exact too, but a
# stacked unit's ``[L, n_pad/N]`` upcast is an operand of the scan over layers, which XLA
# materialises whole (``4 Psi / N`` on the device, more than the ``2 Psi / N`` saved).


def gather_source(state) -> dict:
    """``state.params`` with each host master replaced by its device copy: what the eval step and
    :func:`zshard.make_forward` gather (they cast to ``param_dtype`` anyway, so the result is the same)."""
    if not state.device_params:
        return state.params
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(state.params), **traverse_util.flatten_dict(state.device_params)})


# [Note: offload update] Inside the step, after the gradients are reduced and clipped: each
# offloaded leaf (optimizer state, and masters) is moved to the device
# (``annotate_device_placement`` "device" in the GPU program), the Optax update runs on the device
# exactly as without offload (elementwise on the slices, or the global view), ``skip_nonfinite``
# keeps the old values there, the new master's ``param_dtype`` copy is cut on the device, and each
# updated leaf goes back to the host ("pinned_host"). One transfer each way per leaf and step: ``2 *
# host bytes``. Each leaf is its own transfer, its update depends only on it (and the scalars), so
# the GPU scheduler can stream them; the order is XLA's, after the backward
# ([Note: copies after the backward]). A stacked parameter (``[L, n_pad/N]``, run with ``nnx.scan``)
# is one leaf for all its layers, so its moments are on the device whole while it is updated;
# streaming them a layer at a time (a ``lax.scan`` over the layers) is not done: the scan body fuses
# the parameter update differently, and XLA:CPU's always-on FMA contraction then rounds the last
# bits differently (measured: docs/offload.md, "Measured"), which the bitwise contract forbids. A
# leaf never meets device data while on the host, which JAX refuses ("memory_space of all inputs ...
# must be the same"; :func:`check_placement` names the leaf).


# [Note: copies after the backward] The host leaves pass an ``optimization_barrier`` together with
# the reduced gradients before they are copied to the device, so no copy can start before the
# backward has produced every gradient. Without it XLA:GPU's scheduler issued the host-to-device
# copies early (to hide them behind compute), and every moment sat in HBM through the backward's
# activation peak: measured on one H200 (``python -m train.bench --offload``, GPT d 1024, 8 scanned
# layers, batch 8 x 1024, 2026-12-04): the step's argument bytes fell by the 0.76 GiB of moments
# but its temp grew by 1.01 GiB, and the peak bytes in use were 0.22 GiB *above* the run without
# offload; with the barrier the same run saves 0.71 GiB (docs/offload.md, "Measured on a GPU").
# Only the host leaves take the barrier's outputs (the update reads the gradients themselves), and
# XLA:CPU drops the barrier, so the numbers stay bitwise.
def _after(grads, tree):
    """``tree`` with its host leaves ordered after ``grads`` (``optimization_barrier``; other leaves as they are).

    One barrier per set of varying mesh axes: a barrier's outputs vary over every axis any of its
    operands varies over, so each group of host leaves is tied to the gradients that vary over
    no other axis (a replicated leaf stays replicated)."""
    leaves, treedef = jax.tree.flatten(tree)
    groups = {}
    for i, x in enumerate(leaves):
        if is_host(x):
            groups.setdefault(varying(x), []).append(i)
    for axes, at in groups.items():
        after = [g for g in jax.tree.leaves(grads) if varying(g) <= axes]
        if after:
            host, _ = jax.lax.optimization_barrier(([leaves[i] for i in at], after))
            for i, x in zip(at, host):
                leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def update_offloaded(plan, update, params: dict, grads: dict, opt_state, keep=None):
    """The optimizer update of offloaded state ([Note: offload update]); inside ``shard_map``.

    Args:
      plan: the plan (``plan.offload`` set).
      update: ``(params, grads, opt_state) -> (params, opt_state)`` on device values
        (:func:`zshard.optim.apply_optimizer`).
      params: trainable parameter shards ``[n_pad/N]`` (masters in host memory with ``"optimizer+master"``).
      grads: reduced gradients, device memory, shaped like the update takes them.
      opt_state: the local Optax state, offloaded leaves in host memory.
      keep: a boolean scalar or ``None``: where ``False`` (``skip_nonfinite`` and a non-finite
        step), the old parameters and state are kept.

    Returns:
      ``(params, opt_state, device_params)``: each leaf back in the memory it came from, and the
      new ``param_dtype`` copies of the host masters (device memory; ``{}`` without masters).
    """
    params, opt_state = _after(grads, (params, opt_state))  # [Note: copies after the backward]
    with jax.named_scope("zshard.offload.to_device"):
        params_d = jax.tree.map(to_device, params)  # [n_pad/N] host --copy--> device (masters only)
        state_d = jax.tree.map(to_device, opt_state)  # each offloaded leaf host --copy--> device
    new_params, new_state = update(params_d, grads, state_d)
    if keep is not None:
        new_params = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new_params, params_d)
        new_state = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new_state, state_d)
    masters = master_paths(plan)
    flat = traverse_util.flatten_dict(new_params)
    copies = {p: flat[p].astype(plan.mp.gather_dtype(plan.layouts[p].dtype)) for p in masters if p in flat}
    back = lambda n, o: to_host(n) if is_host(o) else n  # noqa: E731
    with jax.named_scope("zshard.offload.to_host"):
        new_params = jax.tree.map(back, new_params, params)  # device --copy--> host, where it came from
        new_state = jax.tree.map(back, new_state, opt_state)
    return new_params, new_state, traverse_util.unflatten_dict(copies) if copies else {}


# --- placement on the host side --------------------------------------------------------------------


def with_device_params(state):
    """``state`` with ``device_params``: the ``param_dtype`` copy, in device memory, of each master
    (wherever the master is: host after :func:`zshard.init` and ``restore``); abstract leaves stay abstract."""
    plan = state.plan
    masters = master_paths(plan)
    if not masters:
        return dataclasses.replace(state, device_params={})
    flat = traverse_util.flatten_dict(state.params)
    dtype = {p: plan.mp.gather_dtype(plan.layouts[p].dtype) for p in masters}
    out = {p: NamedSharding(plan.mesh, plan.layouts[p].spec) for p in masters}
    if any(isinstance(flat[p], jax.ShapeDtypeStruct) for p in masters):
        copies = {p: jax.ShapeDtypeStruct(flat[p].shape, dtype[p], sharding=out[p]) for p in masters}
    else:
        # [n_pad] master (host) --copy--> device --convert--> [n_pad] param_dtype, one program
        cast = jax.jit(lambda xs: {p: to_device(x).astype(dtype[p]) for p, x in xs.items()}, out_shardings=out)
        copies = cast({p: flat[p] for p in masters})
    return dataclasses.replace(state, device_params=traverse_util.unflatten_dict(copies))


def memory_kind(x) -> str:
    """The memory kind of an array (or of a sharding): ``"device"`` or ``"pinned_host"``."""
    sharding = x if isinstance(x, jax.sharding.Sharding) else getattr(x, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    return DEVICE if kind is None else kind


def check_placement(state, where: str = "the train step") -> None:
    """Every leaf of ``state`` (parameters, optimizer state, device copies) is in the memory its
    plan says (:meth:`ShardedState.shardings <zshard.ShardedState.shardings>`), before tracing.

    A leaf on the host that the plan keeps on the device (e.g. an optimizer state moved by hand
    with ``jax.device_put(..., memory_kind="pinned_host")``) would be used in arithmetic on the
    host, which JAX refuses while tracing without naming it ("memory_space of all inputs ...
    must be the same"); the reverse would silently keep it on the device.

    Raises:
      ValueError: naming the first misplaced leaf, where it is, where the plan keeps it, and the fix.
    """
    expected = state.shardings()
    for name in ("params", "opt_state", "device_params"):
        have = jax.tree_util.tree_flatten_with_path(getattr(state, name))[0]
        want = jax.tree.leaves(getattr(expected, name))
        for (path, x), sh in zip(have, want):
            if getattr(x, "sharding", None) is None:
                continue  # an abstract leaf without a sharding: nothing placed
            got, planned = memory_kind(x), memory_kind(sh)
            if got != planned:
                what = "optimizer state leaf" if name == "opt_state" else "parameter" if name == "params" else "device copy"
                leaf = f"{name}{jax.tree_util.keystr(path)}"
                hint = (
                    "JAX would refuse to use it in arithmetic with device data (\"memory_space of all inputs ... must be "
                    "the same\")" if got == HOST else "it would stay on the device and use the memory offload frees"
                )
                raise ValueError(
                    f"{where}: {what} {leaf} is in {got!r} memory, but this state's plan (offload={state.plan.offload!r}) "
                    f"keeps it in {planned!r} memory: {hint}. Let zshard place it: zshard.init(..., offload="
                    f"{'optimizer' if got == HOST else None!r}) (or zshard.restore with it), or "
                    "jax.device_put the leaves with state.shardings()"
                )


_MIXED = "memory_space of all inputs"  # JAX's words for arithmetic mixing host and device values


def traced_naming_host_leaf(trace, state, *args):
    """``trace(state, *args)``, with JAX's refusal of arithmetic on a host value re-raised naming
    the leaf of ``state`` it came from (found by tracing again with halves of the host leaves
    placed on the device: a few traces, on this error only).

    Raises:
      ValueError: naming the leaf and the fix, when the traced program uses a host leaf in
        arithmetic with device data; other errors as they are.
    """
    try:
        return trace(state, *args)
    except ValueError as e:
        if _MIXED not in str(e):
            raise
        error = e
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    host = [i for i, (_, x) in enumerate(leaves) if memory_kind(x) == HOST]
    all_host = frozenset(host)

    def fails(on_host: set) -> bool:  # only ``on_host`` of the host leaves stay on the host
        placed = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if i in on_host or i not in all_host else x.sharding.with_memory_kind(DEVICE))
            for i, (_, x) in enumerate(leaves)
        ]
        try:
            trace(jax.tree.unflatten(treedef, placed), *args)
        except ValueError as e:
            return _MIXED in str(e)
        return False

    while len(host) > 1:
        half = host[: len(host) // 2]
        host = half if fails(set(half)) else host[len(host) // 2 :]
    name = jax.tree_util.keystr(leaves[host[0]][0]).lstrip(".") if host else "?"
    raise ValueError(
        f"zshard: {name} is in pinned_host memory and the program uses it in arithmetic with device data (JAX: "
        f"{str(error).splitlines()[0][:160]}); with offload, zshard moves each optimizer leaf to the device only "
        "around the Optax update (zshard.optim.offload.update_offloaded): read it outside the step "
        "(jax.device_get), or use offload=None"
    ) from error


# --- accounting ------------------------------------------------------------------------------------


def _itemsize(dtype) -> int:
    """Bytes per element; a PRNG key (``add_noise``'s state) counts its key data (threefry: 8)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 4 * int(np.prod(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape))
    return np.dtype(dtype).itemsize


def _local_bytes(x) -> int:
    """Bytes of one device's shard of ``x`` (an array or a ``ShapeDtypeStruct`` with a sharding)."""
    return int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * _itemsize(x.dtype)


def memory_split(state) -> dict:
    """Model-state bytes per device in ``device`` and ``host`` memory, read from each leaf's
    shard shape and memory kind (not from ``memory_analysis``, whose host fields are 0 on CPU)."""
    out = {DEVICE: 0, "host": 0}
    for x in jax.tree.leaves((state.params, state.opt_state, state.device_params)):
        out["host" if memory_kind(x) == HOST else DEVICE] += _local_bytes(x)
    return out


_PLACEMENT = re.compile(r'annotate_device_placement\((?:[^)]*)\).*?_xla_buffer_placement = "(\w+)".*?->\s*tensor<([^>]*)>')


def _tensor_bytes(text: str) -> int:
    *dims, dtype = text.split("x")
    size = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "ui32": 4, "i64": 8, "i8": 1, "ui8": 1, "i1": 1, "i16": 2}.get(dtype, 4)
    return int(np.prod([int(d) for d in dims], dtype=np.int64)) * size


def exported_placements(exported) -> dict:
    """The transfers of an exported program (``jax.export.Exported``, e.g.
    :meth:`zshard.TrainStep.export`: the GPU program, exported on any machine): per placement
    (``"device"``: host -> device, ``"pinned_host"``: device -> host), the ``count`` of
    ``annotate_device_placement`` calls in the program, their ``bytes`` per device and step (local
    shapes inside the ``shard_map``) and the ``largest`` one's. The program's own output
    annotations (the values ``@main`` returns, one per output when any output has a memory kind)
    are not counted."""
    text = exported.mlir_module()
    calls, returned, func = [], set(), None  # (function, result, placement, type) of every call; what @main returns
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            func = re.search(r"@([\w.$-]+)\(", line).group(1)
        m = _PLACEMENT.search(line)
        if m:
            calls.append((func, line.split("=", 1)[0].strip(), m.group(1), m.group(2)))
        elif func == "main" and line.lstrip().startswith("return "):
            returned |= {("main", r) for r in re.findall(r"%[\w#]+", line.split(":", 1)[0])}
    counts = {DEVICE: {"count": 0, "bytes": 0, "largest": 0}, HOST: {"count": 0, "bytes": 0, "largest": 0}}
    for func, result, kind, tensor in calls:
        if (func, result) in returned:
            continue  # the program's boundary: the placement of an output
        entry = counts.setdefault(kind, {"count": 0, "bytes": 0, "largest": 0})
        size = _tensor_bytes(tensor)
        entry["count"] += 1
        entry["bytes"] += size
        entry["largest"] = max(entry["largest"], size)
    return counts


def offload_report(step, state, batch, formula: dict) -> dict:
    """The offload lines of :func:`zshard.report`: model state in device and host memory, measured
    from the leaves and against the formula, and the host <-> device bytes per step of the GPU
    program (:func:`exported_placements`) against ``2 * host``.

    ``formula``: the report's model-state formula with ``params``, ``opt_state``, ``opt_state_host``
    (bytes per device of the optimizer leaves with a dimension) and ``masters`` / ``copies`` (bytes
    per device of the host masters and of their ``param_dtype`` copies).
    """
    measured = memory_split(state)
    host = formula["opt_state_host"] + formula["masters"]
    device = formula["total"] - host + formula["copies"]
    try:
        moves = exported_placements(step.export(state, batch))
        moved = {"to_device": moves[DEVICE]["bytes"], "to_host": moves[HOST]["bytes"], "largest": moves[DEVICE]["largest"],
                 "calls": {k: v["count"] for k, v in moves.items()}}
    except Exception as e:  # pragma: no cover - an export failure is reported, not fatal
        moved = {"to_device": float("nan"), "to_host": float("nan"), "largest": 0, "calls": {}, "error": f"{type(e).__name__}: {e}"[:200]}
    moved["per_param"] = moved["calls"].get(DEVICE, 0) / max(len(state.plan.trainable), 1)  # transfers of one parameter's update
    return {
        "mode": state.plan.offload,
        "measured": measured,
        "formula": {DEVICE: device, "host": host},
        "transfer": {"measured": moved["to_device"] + moved["to_host"], "formula": 2 * host, **moved},
    }
