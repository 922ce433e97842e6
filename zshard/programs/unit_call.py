"""One unit call, in named phases: forward, re-gather, splice, reduce.

:func:`run_unit` runs ``apply(params, inputs)`` with the unit's parameters all-gathered just in
time (FSDP's ``pre_forward`` / ``post_forward`` / ``pre_backward`` / ``post_backward``):

- **forward** (:meth:`UnitCall.forward`): gather (waiting for the unit's input, or for the
  input of the unit ``prefetch`` calls earlier), run the unit, keep only the
  :class:`Residuals`: the shards, the inputs, the activations the remat policy saves, and the
  gathered weights only where they are kept (SHARD_GRAD_OP);
- **re-gather** (:meth:`UnitCall.regather`): in backward, gather again once the unit's output
  cotangent exists (or the token a later unit hands back, prefetching);
- **splice** (:meth:`UnitCall.pullback`): rebuild the pullback with the weights put back
  where the forward's pullback held them ([Note: pullback splice], docs/design.md 8.3);
- **reduce** (:meth:`UnitCall.reduce`): the parameter gradients through the gradient exit,
  :func:`zshard.wire.grad_exit.reduce_flats` (reduce-scatter, then the step's replica decision).

The gathered weights are never residuals under reshard-after-forward (ZeRO-3 / FSDP
``reshard_after_forward=True``); with ZeRO++ hpZ (``comm.hpz``, zshard/wire/hpz.py) the forward keeps
their ``[n_pad/S]`` slices instead, and the re-gather is over ``shard`` only. Remat policies (:func:`checkpointed`) and the prefetch chain
(:class:`PrefetchLink`, [Note: prefetch chain], docs/design.md 8.2) live here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import Offloadable, Recompute

from zshard.mesh.axes import vary, varying_axes
from zshard.wire.collectives import after, after_tree, gather_flats, schedule_token
from zshard.wire.grad_exit import exit_dtypes_of, reduce_flats
from zshard.wire.wire import UnitComm
from zshard.params.flat import FlatParameter
from zshard.wire.hpz import gather_keeping_secondary, regather_secondary
from zshard.inspection.jaxprs import unit_scope
from zshard.context.sequence import in_backward

__all__ = ["REMAT_POLICIES", "PrefetchLink", "Residuals", "UnitCall", "checkpointed", "offload_dots", "remat_policy", "run_unit"]

REMAT_POLICIES = ("none", "block", "dots", "offload")


def remat_policy(remat):
    """Validate a ``remat=`` value; returns it (a name, or a ``jax.checkpoint`` policy callable).

    Raises:
      ValueError: not one of ``"none"``, ``"block"``, ``"dots"``, ``"offload"`` or a callable.
    """
    if callable(remat) or remat in REMAT_POLICIES:
        return remat
    raise ValueError(
        f"remat={remat!r}: use one of {', '.join(map(repr, REMAT_POLICIES))} or a jax.checkpoint policy "
        "(for example jax.checkpoint_policies.dots_with_no_batch_dims_saveable)"
    )


def offload_dots(prim, *_, **__):
    """The ``"offload"`` policy: what ``"dots"`` saves (every ``dot_general`` output), moved to host
    memory (``pinned_host``) in forward and back to the device in backward; the rest recomputed.

    ``jax.checkpoint_policies.offload_dot_with_no_batch_dims`` offloads only the dots without batch
    dimensions (the weight matmuls); this one offloads exactly ``"dots"``'s set, so the two save the
    same values and differ only in where they live (docs/memory.md, "Remat policies").
    """
    if prim is jax.lax.dot_general_p:
        return Offloadable(src="device", dst="pinned_host")
    return Recompute


def checkpointed(apply: Callable, remat) -> Callable:
    """``apply`` under the activation-checkpointing policy ``remat`` (gathered weights are inputs).

    ``"none"``: no recompute, every activation saved; ``"block"``: save only the inputs
    (``jax.checkpoint``, recompute the whole block); ``"dots"``: save matmul outputs
    (``jax.checkpoint_policies.dots_saveable``), recompute the rest; ``"offload"``: the matmul
    outputs saved in host memory (:func:`offload_dots`); a callable:
    ``jax.checkpoint(apply, policy=remat)``.

    Raises:
      ValueError: any other ``remat``.
    """
    match remat:
        case "none":
            return apply
        case "block":
            return jax.checkpoint(apply)
        case "dots":
            return jax.checkpoint(apply, policy=jax.checkpoint_policies.dots_saveable)
        case "offload":
            return jax.checkpoint(apply, policy=offload_dots)
        case _ if callable(remat):
            return jax.checkpoint(apply, policy=remat)
        case _:
            raise ValueError(f"remat={remat!r}: not a remat policy (see remat_policy)")


@dataclasses.dataclass(eq=False)
class PrefetchLink:
    """One block-unit call's place in the prefetch chain ([Note: prefetch chain]).

    Attributes:
      token: float32 scalar zero that depends on the call's inputs only; a later call's
        forward gather waits on it instead of on its own input.
      trace: the JAX trace the call was made in; a link is only followed from the same
        trace (a unit called inside ``jax.checkpoint``, ``lax.scan``, ``vmap`` ... of the
        model's own code is not prefetched across that boundary).
      taken: set when a later call waits on ``token``; that call's backward then hands a
        token of its output cotangent back, and this call's re-gather waits on it.
    """

    token: Any = None
    trace: Any = None
    taken: bool = False


class Residuals(NamedTuple):
    """What a unit's forward keeps for its backward.

    Attributes:
      shards: per FlatParameter, this device's per-parameter shards ``([n_pad/N], ...)``.
      kept: the gathered parameters (logical shapes) when they are kept for backward
        (``comm.reshard`` false: SHARD_GRAD_OP, HYBRID_SHARD_ZERO2), else ``[]``.
      inputs: the call's inputs (a pytree of arrays).
      saved: the activations the remat policy saved (``remat != "block"``): the pullback's
        leaves that are not gathered weights, in order; ``[]`` for ``remat="block"``.
      feedback: error feedback: per FlatParameter, the residuals ``f32[n_pad]`` the call was
        given as its gradient exit values (zshard/wire/feedback.py), else ``None``.
      secondary: hpZ (``comm.hpz``, zshard/wire/hpz.py): per parameter (slot order), this device's
        ``[n_pad/S]`` (split over tensor: ``[T, n_pad/S]``) of the gathered weights in the gather
        dtype, split over ``shard`` only (``M/S`` bytes per unit of ``M``);
        backward gathers them over ``shard`` instead of the shards over the world. Else ``None``.
    """

    shards: tuple
    kept: list
    inputs: Any
    saved: list
    feedback: Any = None
    secondary: Any = None


@dataclasses.dataclass(eq=False)
class PullbackLayout:
    """[Note: pullback splice] Where the gathered weights sat in the forward's pullback.

    Filled while tracing a call's forward, read while tracing the same call's backward.

    Attributes:
      treedef: the pullback's pytree structure (``jax.tree.flatten`` of the ``jax.vjp`` closure).
      weight: per pullback leaf, the index of the gathered parameter it is (by identity), or
        ``None`` for a saved activation.
    """

    treedef: Any = None
    weight: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class UnitCall:
    """The static part of one unit call: what its phases share.

    Attributes:
      apply: ``(list of parameters in logical shapes, inputs) -> outputs``; closes over no
        tracer (only static structure).
      flats: the unit's FlatParameters.
      comm: the step's :class:`~zshard.wire.collectives.UnitComm`.
      name: the unit's name (``zshard.unit.<name>.forward`` / ``.backward`` scopes).
      after: an earlier call's link the forward gather waits on (prefetch), or ``None``.
      link: this call's own link (``link.token`` set by the call).
      exit_dtypes: per flat, the optimizer slices' dtypes (gradient exit ``TO_SLICES``), else ``None``.
      after_vma: the mesh axes ``after.token`` varies over (its cotangent gets the same type).
      layout: the pullback splice record.
    """

    apply: Callable
    flats: tuple[FlatParameter, ...]
    comm: UnitComm
    name: str
    after: PrefetchLink | None
    link: PrefetchLink
    exit_dtypes: Any = None
    after_vma: frozenset = frozenset()
    layout: PullbackLayout = dataclasses.field(default_factory=PullbackLayout)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, bufs, inputs, after_token, feedback=None):
        """Gather, run the unit, keep :class:`Residuals`; returns ``((out, out_token), res)``."""
        comm = self.comm
        # The gather may not start before the unit's input exists (or, prefetching, the input of
        # the earlier unit call), so the gathered copy is alive only around this unit (and the one
        # before it). [Note: forced schedule]
        ready = None if self.after is None else inputs  # prefetched: slice only once this unit's input exists
        bufs_now = after(bufs, inputs if self.after is None else after_token)
        secondary = None
        if comm.hpz:  # ZeRO++ hpZ: also keep this device's [n_pad/S] of the gathered weights (zshard/wire/hpz.py)
            params, secondary = gather_keeping_secondary(self.flats, bufs_now, comm, ready)
        else:
            params = gather_flats(self.flats, bufs_now, comm, ready)
        kept = [] if comm.reshard else params
        out_token = schedule_token(inputs)
        if comm.remat == "block":
            return (self.apply(params, inputs), out_token), Residuals(bufs, kept, inputs, [], feedback, secondary)
        out, pullback = jax.vjp(checkpointed(self.apply, comm.remat), params, inputs)
        # The pullback's leaves are the saved activations plus the gathered weights; keep the
        # activations, drop the weights (backward gathers them again, or kept has them).
        leaves, self.layout.treedef = jax.tree.flatten(pullback)
        self.layout.weight = [next((j for j, p in enumerate(params) if leaf is p), None) for leaf in leaves]
        saved = [leaf for leaf, j in zip(leaves, self.layout.weight) if j is None]
        return (out, out_token), Residuals(bufs, kept, inputs, saved, feedback, secondary)

    # -- re-gather -----------------------------------------------------------------------------
    def regather(self, res: Residuals, g, g_token):
        """The parameters for backward, and the inputs / saved activations to recompute from."""
        if self.comm.reshard:
            # The re-gather depends on a cotangent, so it cannot be merged with the forward
            # gather: this unit's own, or (prefetch) the token a later unit handed back as soon
            # as its own backward began.
            taken = self.link.taken
            ready = g if taken else None  # prefetched: slice only once this unit's cotangent exists
            if res.secondary is not None:  # hpZ: [n_pad/S] --all_gather(shard)--> [n_pad], inside the node
                params = regather_secondary(self.flats, after(res.secondary, g_token if taken else g), self.comm, ready)
                return params, res.inputs, res.saved
            return gather_flats(self.flats, after(res.shards, g_token if taken else g), self.comm, ready), res.inputs, res.saved
        # Kept weights: make the recompute depend on the cotangent instead, or XLA folds it into
        # the forward pass and keeps every activation alive.
        return res.kept, after_tree(res.inputs, g), after_tree(res.saved, g)

    # -- splice --------------------------------------------------------------------------------
    def pullback(self, params, inputs, saved, g):
        """``(pullback, g)``: recomputed (``remat="block"``) or spliced from the saved activations."""
        if self.comm.remat == "block":
            out, pullback = jax.vjp(self.apply, params, inputs)
            # The recompute's inputs may vary over more mesh axes than in forward (tied to the
            # cotangent above): give each cotangent the type of the output it belongs to.
            return pullback, jax.tree.map(lambda c, o: vary(c, tuple(varying_axes(o))) if _is_real(c) else c, g, out)
        rest = iter(saved)
        leaves = [next(rest) if j is None else params[j] for j in self.layout.weight]
        return jax.tree.unflatten(self.layout.treedef, leaves), g

    # -- reduce --------------------------------------------------------------------------------
    def reduce(self, res: Residuals, d_params):
        """Parameter gradients -> ``(cotangents of the shards, cotangents of the exit values)``."""
        return reduce_flats(self.flats, res.shards, d_params, self.comm, self.exit_dtypes, res.feedback)

    def backward(self, res: Residuals, cts):
        g, g_token = cts
        params, inputs, saved = self.regather(res, g, g_token)
        pullback, g = self.pullback(params, inputs, saved, g)
        d_params, d_inputs = pullback(g)
        # An input that is the same on every device (an invariant value, e.g. a BatchNorm
        # statistic) was used by every device: its cotangent is the sum over the axes the
        # computation varied over (the transpose of the implicit broadcast).
        d_inputs = jax.tree.map(_cotangent_like, d_inputs, res.inputs)
        # the earlier unit's re-gather may start now
        d_after = () if self.after is None else _like(schedule_token(g), self.after_vma)
        d_bufs, d_exits = self.reduce(res, d_params)
        return d_bufs, d_exits, d_inputs, d_after


def run_unit(
    apply: Callable,
    flats: Sequence[FlatParameter],
    bufs: Sequence,
    inputs,
    comm: UnitComm,
    *,
    after: PrefetchLink | None = None,
    link: PrefetchLink | None = None,
    name: str = "unit",
    exits=None,
):
    """Run ``apply(params, inputs)`` with the unit's parameters gathered just in time.

    Args:
      apply: ``(list of parameters in logical shapes, inputs) -> outputs``; closes over no
        tracer (only static structure).
      flats / bufs: the unit's FlatParameters and, per flat, this device's per-parameter
        shards ``([n_pad/N], ...)`` (or one concatenated ``[L_k/N]``).
      inputs: pytree of arrays, the unit's dynamic inputs.
      comm: axes, mixed precision, replica reduction, remat policy and reshard-after-forward.
        ``comm.reshard`` (FULL_SHARD, HYBRID_SHARD): the gathered weights are never residuals,
        whatever ``comm.remat``; backward all-gathers again. Otherwise (SHARD_GRAD_OP,
        HYBRID_SHARD_ZERO2) they are kept from forward to backward.
      after: an earlier call's :class:`PrefetchLink` (prefetch): the forward gather waits
        only for that call's *input*; backward hands a token of this call's output cotangent
        back to it, so that unit's re-gather can be issued before this unit's backward
        computes. ``None``: no prefetch.
      link: this call's own link, filled in here (``link.token``); a later call may take it.
      name: the unit's name, for ``jax.named_scope`` (``zshard.unit.<name>.forward`` / ``.backward``).
      exits: the gradient exit values ([Note: gradient exit], zshard/wire/grad_exit.py). Where the
        gradients land in optimizer slices (``comm.exit.to_slices``, HYBRID_SHARD_OPT, docs/memory.md):
        per flat, a tuple of per-parameter arrays ``[n_pad/(R*S)]`` of the parameter dtype
        whose values are never read (``()`` for a frozen flat). The caller differentiates
        with respect to them; backward returns the gradient reduce-scattered over ``shard``
        and ``replica`` as their cotangent. With error feedback (``comm.exit.residuals``): per
        flat the residuals ``f32[n_pad]`` (``f32[0]`` where not quantized); backward adds them
        before quantizing and returns the new residuals as their cotangent.

    Returns:
      ``apply``'s outputs. Residuals: :class:`Residuals`.

    Raises:
      ValueError: ``exits`` given where the gradient exit takes none, or missing where it lands in slices.
    """
    flats = tuple(flats)
    ex = comm.exit
    ex.check(exits, any(f.trainable for f in flats), f"run_unit ({name})")
    ef = ex.residuals  # the exit values are the residuals, read by backward (zshard/wire/feedback.py)
    call = UnitCall(
        apply, flats, comm, name, after, link if link is not None else PrefetchLink(), None if ef else exit_dtypes_of(exits),
        frozenset() if after is None else varying_axes(after.token),
    )

    @jax.custom_vjp
    def _unit(bufs, exits, inputs, after_token):
        return apply(gather_flats(flats, bufs, comm), inputs), schedule_token(inputs)

    def fwd(bufs, exits, inputs, after_token):  # the exit values are read only as residuals (error feedback)
        with jax.named_scope(unit_scope(name, "forward")):
            return call.forward(bufs, inputs, after_token, exits if ef else None)

    def bwd(res, cts):
        with jax.named_scope(unit_scope(name, "backward")), in_backward():
            return call.backward(res, cts)

    _unit.defvjp(fwd, bwd)
    out, call.link.token = _unit(tuple(bufs), None if exits is None else tuple(exits), inputs, () if after is None else after.token)
    return out


def _is_real(c) -> bool:
    return hasattr(c, "dtype") and c.dtype != jax.dtypes.float0


def _cotangent_like(c, primal):
    """``c`` summed over the mesh axes it varies over and ``primal`` does not."""
    if not _is_real(c):
        return c
    extra = tuple(sorted(varying_axes(c) - varying_axes(primal)))
    c = jax.lax.psum(c, extra) if extra else c
    return vary(c, tuple(sorted(varying_axes(primal))))


def _like(t: jax.Array, vma: frozenset) -> jax.Array:
    """``t`` with the varying mesh axes ``vma`` of the value it is the cotangent of; a
    constant zero where ``t`` varies over more (an earlier unit whose inputs were integers
    only: its token was a constant, and nothing waits on it)."""
    have = varying_axes(t)
    if have <= vma:
        return vary(t, tuple(sorted(vma)))
    zero = jnp.zeros((), t.dtype)
    return vary(zero, tuple(sorted(vma))) if vma else zero
