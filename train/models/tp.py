"""The tensor- and expert-parallel plans of the main job's models: which dimension of which
parameter is split over the ``tensor`` mesh axis (``zshard.init(..., tensor_parallel=tensor_plan(cfg, T))``)
and which over the ``expert`` axis (``zshard.init(..., expert_parallel=expert_plan(cfg, X))``).

Megatron-LM's split (Shoeybi et al. 2019, arXiv 1909.08053 section 3): the fused q|k|v
projection and the MLP's input projection column-parallel (output dimension: heads, MLP
columns), the attention and MLP output projections row-parallel (input dimension); the
vocabulary splits the token embedding and the head. Norms, position tables and row-parallel
biases are not split. An MoE's experts are not split (they are gathered with their block, as
without tensor parallelism: expert parallelism is their split; docs/eval-and-hf.md).
"""

from __future__ import annotations

from train.models.gpt import GPTConfig
from train.models.moe import MoEConfig

__all__ = ["expert_plan", "tensor_plan"]

_BLOCKS = "blocks*."  # blocks.0. (an nnx.List) and blocks. (stacked layers run by nnx.scan)


def _need(what: str, size: int, tensor: int, fix: str) -> None:
    if size % tensor:
        raise ValueError(f"tensor={tensor} does not divide {what} ({size}): each device of a tensor group holds "
                         f"1/{tensor} of them; {fix}")


def tensor_plan(cfg, tensor: int) -> dict[str, int]:
    """``{glob on the parameter path: dimension}`` for a ``train.models`` config (``{}`` for ``T = 1``).

    The vocabulary is split only where ``T`` divides it (GPT-2's 50257 does not: its embedding
    and head then stay whole on each tensor device, FSDP-sharded as without tensor parallelism).

    Raises:
      ValueError: ``T`` does not divide the heads (GPT), the key/value heads (Llama family:
        each device holds whole groups of query heads with their key/value head) or the MLP width.
    """
    if tensor <= 1:
        return {}
    b = _BLOCKS
    if isinstance(cfg, GPTConfig):
        _need("the attention heads (n_heads)", cfg.n_heads, tensor, "pick a tensor size that divides n_heads")
        plan = {b + "attn.qkv.kernel": -1, b + "attn.proj.kernel": 0, b + "mlp.fc.kernel": -1, b + "mlp.fc.bias": -1,
                b + "mlp.proj.kernel": 0}
        if cfg.qkv_bias:
            plan[b + "attn.qkv.bias"] = -1
        embedding = "wte.embedding"
    else:  # the Llama family (Llama, Mistral, Qwen2/3, Gemma 2/3) and Qwen3-MoE's attention
        _need("the key/value heads (n_kv_heads)", cfg.n_kv_heads, tensor, "pick a tensor size that divides n_kv_heads")
        plan = {b + "attn.wqkv.kernel": 1, b + "attn.wo.kernel": 0}
        if cfg.qkv_bias:
            plan[b + "attn.wqkv.bias"] = 0
        if not isinstance(cfg, MoEConfig):
            _need("the MLP width (d_ff)", cfg.d_ff, tensor, "pick a tensor size that divides d_ff")
            plan.update({b + "mlp.w_gate_up.kernel": -1, b + "mlp.w_down.kernel": 0})
        embedding = "embed.embedding"
    if cfg.vocab_size % tensor == 0:
        plan[embedding] = 0  # [V, C]: the lookup's output all-reduced over tensor
        if not cfg.tie_embeddings:
            plan["head.kernel"] = -1  # [C, V]: logits split over the vocabulary
    return plan


def expert_plan(cfg, expert: int) -> dict[str, int]:
    """``{glob on the parameter path: expert dimension}`` of an MoE config (``{}`` for ``X = 1``).

    The experts of every MoE layer (:class:`~train.models.moe.MoE`: ``w_gate_up`` ``[E, C, 2F]``,
    ``w_down`` ``[E, F, C]``) are split over the ``expert`` axis along ``E`` (dimension 0 within
    one layer, so the stacked ``[L, E, ...]`` of a scanned model matches too): each device of
    an expert group holds ``E / X`` whole experts. The router ``[C, E]`` stays a dense
    parameter (every device routes its tokens to all ``E`` experts). Qwen3-MoE and Mixtral
    (``from_hf``'s ``builder.config``) and the MoE presets.

    Raises:
      ValueError: ``X < 1``; a config without experts and ``X > 1`` (a dense model has nothing
        to split: the fix named); ``X`` not dividing the experts (``n_experts``).
    """
    if expert < 1:
        raise ValueError(f"expert={expert}: the expert axis size must be >= 1 (1: no expert parallelism)")
    if expert == 1:
        return {}
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"expert={expert}: {type(cfg).__name__} has no experts (a dense model: nothing to split over the "
                         "expert axis); use expert=1 (--expert 1), or train a mixture of experts (a Qwen3-MoE or Mixtral "
                         "checkpoint, an MoE preset)")
    if cfg.n_experts % expert:
        fits = [x for x in range(2, cfg.n_experts + 1) if cfg.n_experts % x == 0]
        raise ValueError(f"expert={expert} does not divide the experts (n_experts = {cfg.n_experts}): each device of an "
                         f"expert group holds n_experts / expert whole experts; use expert = "
                         f"{', '.join(map(str, fits[:8]))}{' ...' if len(fits) > 8 else ''} (or 1: none)")
    return {_BLOCKS + "moe.w_gate_up": 0, _BLOCKS + "moe.w_down": 0}
