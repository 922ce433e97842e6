"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm, GQA, RoPE) whose MLP is a mixture of experts.

Each token's router logits ``x @ router`` pick its ``top_k`` of ``n_experts`` SwiGLU experts
by softmax probability; the experts' outputs are summed with those probabilities (renormalised
to sum to 1 over the chosen experts with ``norm_topk_prob``), as in Qwen3 (arXiv 2505.09388
section 2) and Hugging Face's ``Qwen3MoeSparseMoeBlock``. Dropless: every token reaches its
experts, none is dropped for capacity, so the result does not depend on how the batch is
split over devices. The experts are stored stacked, ``w_gate_up`` ``[E, C, 2F]`` and
``w_down`` ``[E, F, C]``, and run as grouped matmuls over the tokens sorted by expert
(``jax.lax.ragged_dot``): each token costs ``top_k`` experts' FLOPs, not ``E``.

The router's auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021, arXiv
2101.03961 eq. 4-6; Hugging Face's ``load_balancing_loss_func``) is
``E * sum_e f_e * P_e``, ``f_e`` the fraction of (layer, token) top-k slots routed to expert
``e`` and ``P_e`` its mean router probability, both over the layers and tokens of **one
sequence**; the model's value is the mean over the sequences. Per sequence, so it is the
same number on any mesh (a per-device batch mean of the batch-pooled form would change with
the device count); for one sequence it equals Hugging Face's.

The router z-loss (ST-MoE, Zoph et al. 2022, arXiv 2202.08906 eq. 5) is
``mean over tokens of logsumexp_e(logits)^2``, here over the (layer, token) pairs: it keeps the
router logits small (float32 round-off in the softmax). Its weight ``router_z_loss_coef`` is 0
by default (Hugging Face's models have none; ST-MoE uses 1e-3).

``model(tokens)`` -> logits; ``model(tokens, router_aux=True)`` -> ``(logits, aux_loss)``;
``model(tokens, cache=c, pos=p)`` -> ``(logits, new cache)``. :func:`moe_loss` is the
training loss, ``(cross_entropy + router_aux_coef * aux_loss + router_z_loss_coef * z_loss,
aux)``, for ``zshard.make_train_step(moe_loss, has_aux=True)``; ``aux`` also holds each
expert's share of the routed slots (``expert_load``) and the fraction dropped for capacity.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import zshard

from train.models.core import ACTIVATIONS, Attention
from train.models.loss import chunked_token_nll
from train.models.llama import Llama, LlamaConfig

__all__ = ["MoEConfig", "MoE", "MoEBlock", "Qwen3Moe", "RouterStats", "moe_loss", "router_z"]


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """:class:`LlamaConfig` (``qk_norm`` on, ``family="qwen3_moe"``) plus the experts.

    Attributes:
      n_experts: experts per MoE layer (Hugging Face ``num_experts``).
      top_k: experts per token (``num_experts_per_tok``).
      d_expert: hidden width of each expert's SwiGLU (``moe_intermediate_size``).
      norm_topk_prob: renormalise the chosen experts' probabilities to sum to 1.
      router_aux_coef: weight of the load-balancing loss in :func:`moe_loss`
        (``router_aux_loss_coef``).
      router_z_loss_coef: weight of the router z-loss in :func:`moe_loss` (ST-MoE, arXiv
        2202.08906 eq. 5; 0: off, as in Hugging Face's models; ST-MoE's value is 1e-3).
    """

    qk_norm: bool = True
    family: str = "qwen3_moe"
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 768
    norm_topk_prob: bool = True
    router_aux_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.router_z_loss_coef < 0:
            raise ValueError(f"MoEConfig: router_z_loss_coef {self.router_z_loss_coef} must be >= 0 (0: no z-loss)")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig: top_k {self.top_k} must lie in [1, n_experts = {self.n_experts}]")


class RouterStats(NamedTuple):
    """What the router losses and the metrics read of MoE layers, float32, summed over each
    sequence's tokens (and, after :meth:`Qwen3Moe.trunk_stats`, over the layers).

    Attributes:
      counts: ``[B, E]`` top-k slots given to each expert.
      probs: ``[B, E]`` sum of each expert's router probability.
      z: ``[B]`` sum of ``logsumexp(router logits)^2`` (:func:`router_z`).
      dropped: ``[1]`` slots dropped for capacity on this device (0: dropless; a vector, so that
        it concatenates over the devices of a shard_map like the per-sequence fields).
    """

    counts: jax.Array  # [B, E] f32
    probs: jax.Array  # [B, E] f32
    z: jax.Array  # [B] f32
    dropped: jax.Array  # [1] f32


def router_z(logits):
    """``logsumexp(logits)^2`` per token: float ``[..., E]`` -> float32 ``[...]`` (ST-MoE, arXiv 2202.08906 eq. 5,
    before the mean over tokens)."""
    return jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts: ``x`` (B, T, C) -> ``(y (B, T, C), RouterStats)`` (per
    sequence, for the router losses and the metrics)."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        E, C, F = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.n_experts, self.top_k, self.norm_topk_prob, self.act = E, cfg.top_k, cfg.norm_topk_prob, cfg.act
        self.router = nnx.Linear(C, E, use_bias=False, rngs=rngs)  # kernel [C, E]
        init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.w_gate_up = nnx.Param(init(rngs.params(), (E, C, 2 * F), jnp.float32))  # [E, C, 2F], gate columns first
        self.w_down = nnx.Param(init(rngs.params(), (E, F, C), jnp.float32))  # [E, F, C]

    def __call__(self, x):
        # zshard.moe: router in float32, top-k, grouped matmuls (all-to-all over `expert` when the
        # expert weights hold E/X experts); dropless, so the numbers do not depend on the mesh
        y, stats = zshard.moe(x, self.router.kernel[...], self.w_gate_up[...], self.w_down[...], top_k=self.top_k,
                              norm_topk_prob=self.norm_topk_prob, act=ACTIVATIONS[self.act])
        counts = jax.nn.one_hot(stats.top_e, self.n_experts, dtype=jnp.float32).sum(axis=(1, 2))  # (B, T, k, E) -> (B, E)
        z = router_z(stats.logits).sum(axis=1)  # (B, T, E) -> (B, T) -> (B,)
        dropped = stats.dropped.reshape(1)  # [] -> [1]
        return y, RouterStats(counts, stats.probs.sum(axis=1), z, dropped)  # (B, T, C); (B, E), (B, E), (B,), (1,)


class MoEBlock(nnx.Module):
    """``x + attn(attn_norm(x))``, then ``x + moe(mlp_norm(x))``; ``router_aux=True`` also
    returns the layer's :class:`RouterStats`."""

    def __init__(self, cfg: MoEConfig, *, layer: int = 0, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, **cfg.attention(layer), rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs)
        self.moe = MoE(cfg, rngs=rngs)

    def __call__(self, x, cache=None, pos=None, *, router_aux=False):
        a, new = self.attn(self.attn_norm(x), cache, pos)
        x = x + a
        y, stats = self.moe(self.mlp_norm(x))
        out = x + y
        if router_aux:
            return out, stats
        return out if cache is None else (out, new)


def load_balancing_loss(counts, probs, tokens: int, n_experts: int):
    """``E * sum_e f_e P_e`` per sequence, averaged: ``counts`` / ``probs`` (B, E) summed over
    the layers and ``tokens`` (layers x sequence length) -> scalar."""
    f, p = counts / tokens, probs / tokens  # (B, E): slot fraction (sums to top_k), mean probability
    return n_experts * jnp.mean(jnp.sum(f * p, axis=-1))


class Qwen3Moe(Llama):
    """Tokens (B, T) int32 -> logits (B, T, vocab); see the module docstring for ``router_aux``."""

    block = MoEBlock

    def __call__(self, tokens, cache=None, pos=None, *, router_aux=False):
        if not router_aux:
            return super().__call__(tokens, cache, pos)
        x, aux = self.trunk(tokens)
        return self.logits(x), aux

    def trunk(self, tokens):
        """(B, T) int -> ``(x (B, T, C) before the final norm, load-balancing loss)``."""
        x, stats = self.trunk_stats(tokens)
        return x, load_balancing_loss(stats.counts, stats.probs, self.cfg.n_layers * tokens.shape[1], self.cfg.n_experts)

    def trunk_stats(self, tokens):
        """(B, T) int -> ``(x (B, T, C) before the final norm, RouterStats summed over the layers)``."""
        x = self.embed_tokens(tokens)  # (B, T, C)
        if self.cfg.scan:  # per-layer stats as scan outputs [L, ...] (no carry to initialise)
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            def body(x, block):
                return block(x, router_aux=True)

            x, stats = body(x, self.blocks)
            return x, RouterStats(*(s.sum(axis=0) for s in stats))  # [L, ...] -> [...]
        per_layer = []
        for block in self.blocks:
            x, s = block(x, router_aux=True)
            per_layer.append(s)
        return x, RouterStats(*(sum(parts) for parts in zip(*per_layer)))  # each summed over the layers


def moe_loss(model: Qwen3Moe, batch):
    """``(cross_entropy + router_aux_coef * aux_loss + router_z_loss_coef * z_loss, aux)`` for
    ``zshard.make_train_step(moe_loss, has_aux=True)``; ``batch = (inputs, targets)``.

    ``aux`` (float32; the step averages it over devices and micro-batches, which leaves each
    value the whole batch's, every device holding as many tokens):

    - ``router_aux_loss``: the load-balancing loss (module docstring), ``cross_entropy``;
    - ``router_z_loss``: mean over (layer, token) of ``logsumexp(router logits)^2`` (ST-MoE eq. 5);
    - ``expert_load`` ``[E]``: each expert's share of the top-k slots of all layers (sums to 1;
      ``1 / E`` each when balanced);
    - ``dropped_fraction``: of the ``tokens * top_k * layers`` slots, those dropped for
      capacity (0 when dropless).

    The cross-entropy is :func:`~train.models.loss.chunked_token_nll` of the final hidden
    states and the head: no float32 ``[tokens, V]`` logits (as ``cross_entropy_loss``)."""
    inputs, targets = batch
    cfg = model.cfg
    x, stats = model.trunk_stats(inputs)
    pairs = cfg.n_layers * inputs.shape[1]  # (layer, token) pairs of one sequence
    aux = load_balancing_loss(stats.counts, stats.probs, pairs, cfg.n_experts)
    z = jnp.sum(stats.z) / (pairs * inputs.shape[0])
    ce = chunked_token_nll(model.norm(x), model.output_head(), targets)
    slots = jnp.sum(stats.counts, axis=0)  # [E]: top-k slots of every layer and token
    metrics = {"router_aux_loss": aux, "router_z_loss": z, "cross_entropy": ce, "expert_load": slots / jnp.sum(slots),
               "dropped_fraction": jnp.sum(stats.dropped) / (pairs * inputs.shape[0] * cfg.top_k)}
    return ce + cfg.router_aux_coef * aux + cfg.router_z_loss_coef * z, metrics
