"""Autoregressive sampling with a KV cache for the GPT and Llama of ``train/model.py``, on
the sharded state.

One :func:`generate` call is one call of a sharded forward (``zshard.make_forward``,
:func:`decoder`): the prefill and every decoding step run inside it, in one
``lax.fori_loop``. Two ways to hold the parameters while decoding (``gather_once``):

- ``False`` (default, sharded): in every decoding step the root unit and each block unit are
  all-gathered just in time and dropped, as in training. Per device: parameters at rest ``Psi / N`` plus about
  two gathered units; per generated token, all-gathers of the whole model,
  ``Psi * (N - 1) / N`` elements received per device. Use it when the model does not fit
  on one device, or for a few tokens (sampling during training).
- ``True``: every parameter is all-gathered once per :func:`generate` call, before the loop,
  then all tokens are decoded with the whole model on every device. Per device: ``Psi`` (the whole model)
  plus the cache; no communication per token. Use it when the whole model fits with the
  cache beside it and many tokens are generated: the gathers are paid once, not per token.

Either way the batch is split over all devices of the mesh (rows padded up to a multiple
of the device count; the padding rows are dropped), each device keeps the KV cache of its
own rows, ``[rows, length, n_kv_heads, head_size]`` per layer for keys and values.

Sampling is reproducible for a seed: the token of row ``r`` at step ``t`` is drawn with
``jax.random.fold_in(fold_in(key(seed), r), t)``, independent of the mesh, the strategy and
``gather_once`` (and equal to :func:`generate_local` on one device).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import zshard
from train.model import GPTConfig, init_cache

__all__ = ["chunks", "continue_tokens", "decoder", "generate", "generate_local", "lower", "nucleus"]


def nucleus(logits, top_p):
    """Nucleus (top-p) filtering (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", section 3.1): per row of ``logits`` float32 ``[b, V]``, keep the most likely
    tokens whose probabilities, taken in decreasing order, first reach ``top_p`` (the most likely
    token always; ties with the last kept logit too) and set the others to ``-inf``.
    ``top_p >= 1`` returns ``logits`` unchanged. Returns float32 ``[b, V]``."""
    ranked = -jnp.sort(-logits, axis=-1)  # [b, V], decreasing
    probs = jax.nn.softmax(ranked, axis=-1)
    above = jnp.cumsum(probs, axis=-1) - probs  # [b, V]: the mass of the tokens ranked before each
    cutoff = jnp.min(jnp.where(above < top_p, ranked, jnp.inf), axis=-1, keepdims=True)  # [b, 1]: the last kept logit
    return jnp.where((top_p >= 1) | (logits >= cutoff), logits, -jnp.inf)


def _pick(logits, rows, t, seed, temperature, top_p):
    """Next token per row from ``logits`` [b, V]: argmax when ``temperature == 0``, else a draw
    from ``softmax(logits / temperature)`` restricted to the ``top_p`` nucleus (:func:`nucleus`),
    keyed by (seed, row, step). Returns int32 [b]."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), r), t))(rows)  # [b]
    scaled = nucleus(logits / jnp.maximum(temperature, 1e-6), top_p)  # [b, V]
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


def _config(plan):
    """The model config (``.cfg``) of a plan, without materialising any parameter."""
    return nnx.merge(plan.graphdef, nnx.from_flat_state(list(plan.template) + list(plan.var_template))).cfg


def _check(cfg, prompts: np.ndarray, n: int, temperature: float = 0.0, top_p: float = 1.0):
    if not temperature >= 0:
        raise ValueError(f"generate: temperature={temperature}: give 0 (greedy) or a positive number")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p}: give a probability mass in (0, 1] (1: no nucleus filtering)")
    if prompts.ndim != 2 or prompts.shape[1] < 1:
        raise ValueError(f"generate: prompts must be int [batch, tokens] with at least one token, got shape {prompts.shape}")
    if n < 1:
        raise ValueError(f"generate: n={n}: generate at least one token")
    if isinstance(cfg, GPTConfig) and prompts.shape[1] + n > cfg.seq_len:
        raise ValueError(
            f"generate: prompt {prompts.shape[1]} + {n} new tokens > seq_len {cfg.seq_len} (the GPT's position table); "
            f"shorten the prompt or generate fewer tokens"
        )
    if prompts.min() < 0 or prompts.max() >= cfg.vocab_size:
        raise ValueError(f"generate: prompt tokens must lie in [0, {cfg.vocab_size}), got [{prompts.min()}, {prompts.max()}]")


# ----------------------------------------------------------------------------------------
# One device, plain model (the reference)
# ----------------------------------------------------------------------------------------


@functools.partial(nnx.jit, static_argnames=("length",))
def _local_step(model, tokens, cache, pos, t, rows, seed, temperature, top_p, length=None):
    if cache is None:
        cache = init_cache(model.cfg, tokens.shape[0], length)
    logits, cache = model(tokens, cache=cache, pos=pos)  # [b, T, V]
    return _pick(logits[:, -1], rows, t, seed, temperature, top_p), cache


def generate_local(model: nnx.Module, prompts, n: int, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> np.ndarray:
    """:func:`generate` for a plain ``nnx.Module`` on one device (no sharding).

    Returns int32 ``[batch, n]``, the generated tokens (the prompt excluded).
    """
    prompts = np.asarray(prompts, np.int32)
    _check(model.cfg, prompts, n, temperature, top_p)
    b, t0 = prompts.shape
    rows, seed, temp, p = jnp.arange(b, dtype=jnp.int32), jnp.int32(seed), jnp.float32(temperature), jnp.float32(top_p)
    tok, cache = _local_step(model, jnp.asarray(prompts), None, jnp.int32(0), jnp.int32(0), rows, seed, temp, p, length=t0 + n)
    out = [tok]
    for t in range(1, n):
        tok, cache = _local_step(model, tok[:, None], cache, jnp.int32(t0 + t - 1), jnp.int32(t), rows, seed, temp, p)
        out.append(tok)
    return np.asarray(jnp.stack(out, axis=1))


# ----------------------------------------------------------------------------------------
# Sharded: the whole decode loop inside one sharded forward call
# ----------------------------------------------------------------------------------------


@functools.cache
def decoder(n: int, gather_once: bool = False, prefetch: int | None = None):
    """The sharded forward (``zshard.make_forward``) that decodes ``n`` tokens in one call.

    ``decoder(n, ...)(state, prompts, rows, seed, temperature, top_p)``: ``prompts`` int32 ``[B, T0]``
    and ``rows`` int32 ``[B]`` (each row's index, for its random stream) split over the devices
    (``B`` a multiple of the device count; with several processes each passes its rows
    ``[i*B/P, (i+1)*B/P)``); ``seed`` int32, ``temperature`` and ``top_p`` float32 scalars. Returns int32
    ``[B, n]`` (a global ``jax.Array``), split the same way. Per device: the prefill, then ``n - 1``
    decoding steps in one ``lax.fori_loop`` over this device's rows and KV cache
    ``[rows, T0 + n, n_kv_heads, head_size]`` per layer. ``gather_once``: the whole model is
    gathered once, before the loop; otherwise each unit is gathered just in time in every step.
    """

    def decode(model, prompts, rows, seed, temperature, top_p):
        b, t0 = prompts.shape
        cache = init_cache(model.cfg, b, t0 + n)
        logits, cache = model(prompts, cache=cache, pos=jnp.int32(0))  # prefill: [b, T0, V]
        tok = _pick(logits[:, -1], rows, jnp.int32(0), seed, temperature, top_p)  # [b]
        out = jnp.zeros((b, n), jnp.int32).at[:, 0].set(tok)

        def step(t, carry):
            model, tok, cache, out = carry
            logits, cache = model(tok[:, None], cache=cache, pos=t0 + t - 1)  # [b, 1, V]
            tok = _pick(logits[:, -1], rows, t, seed, temperature, top_p)
            return model, tok, cache, out.at[:, t].set(tok)

        # nnx.fori_loop: the model goes in the carry (a stacked model's own nnx.scan may not
        # reach a module captured from outside the loop's trace)
        return nnx.fori_loop(1, n, step, (model, tok, cache, out))[3]  # [b, n]

    return zshard.make_forward(decode, gather_once=gather_once, prefetch=prefetch)


def _placed(plan, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of the prompts, padded to a multiple of the devices: ``(prompts int32
    [B/P, T0], rows int32 [B/P])`` (the padding rows, zeros, are dropped from the result)."""
    b, t0 = prompts.shape
    bp = -(-b // plan.world) * plan.world  # rows padded to a multiple of the devices (padding rows dropped)
    padded = np.zeros((bp, t0), np.int32)
    padded[:b] = prompts
    rows = np.arange(bp, dtype=np.int32)
    i, procs = jax.process_index(), jax.process_count()
    mine = slice(i * bp // procs, (i + 1) * bp // procs)  # several processes: each passes its rows (make_forward's rule)
    return padded[mine], rows[mine]


def _scalars(seed: int, temperature: float, top_p: float) -> tuple:
    return jnp.int32(seed), jnp.float32(temperature), jnp.float32(top_p)


def generate(
    state, prompts, n: int, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, gather_once: bool = False,
    prefetch: int | None = None
) -> np.ndarray:
    """Sample ``n`` tokens after each prompt from a sharded GPT / Llama (``train.model``).

    Args:
      state: a ``zshard.ShardedState`` of a ``train.model`` GPT or Llama (not donated, not changed).
      prompts: int ``[batch, tokens]``, every prompt of the same length.
      n: tokens to generate per prompt.
      temperature: ``0``: greedy (argmax); ``> 0``: sample from ``softmax(logits / temperature)``.
      top_p: with ``temperature > 0``, draw only from the smallest set of most likely tokens
        whose probability reaches ``top_p`` (nucleus sampling, :func:`nucleus`); ``1``: all tokens.
      seed: the sampling seed (same seed, same tokens, on any mesh and strategy).
      gather_once: ``False``: parameters gathered per unit per decoding step (memory of a
        sharded model); ``True``: the whole model gathered once per call (memory of the
        whole model per device, no communication per token). See the module docstring.
      prefetch: sharded mode: units gathered ahead, as for ``zshard.make_eval_step``
        (``0``: about one gathered unit at a time).

    Returns:
      int32 ``[batch, n]``: the generated tokens (without the prompt).

    Raises:
      ValueError: ``prompts`` not ``[batch, tokens]``, tokens outside the vocabulary,
        (GPT) prompt + ``n`` longer than the position table ``seq_len``, a negative
        ``temperature`` or ``top_p`` outside ``(0, 1]``.
    """
    plan = state.plan
    prompts = np.asarray(prompts, np.int32)
    _check(_config(plan), prompts, n, temperature, top_p)
    tokens = decoder(n, gather_once, prefetch)(state, *_placed(plan, prompts), *_scalars(seed, temperature, top_p))
    if not tokens.is_fully_addressable:  # several processes: every process gets every row
        return np.asarray(multihost_utils.process_allgather(tokens, tiled=True))[: len(prompts)]
    return np.asarray(tokens)[: len(prompts)]


def lower(state, prompts, n: int, *, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, gather_once: bool = False,
          prefetch: int | None = None) -> jax.stages.Lowered:
    """The program :func:`generate` runs for these arguments, lowered (``.compile()`` compiles it
    ahead: the call that follows reuses the executable; ``.compile().as_text()``: its HLO)."""
    plan = state.plan
    prompts = np.asarray(prompts, np.int32)
    _check(_config(plan), prompts, n, temperature, top_p)
    return decoder(n, gather_once, prefetch).lower(state, *_placed(plan, prompts), *_scalars(seed, temperature, top_p))


def chunks(prompt_len: int, n: int, seq_len: int) -> list[tuple[int, int]]:
    """``(context tokens, new tokens)`` of each :func:`continue_tokens` call: the context is at most
    ``seq_len`` tokens; when it is full, generation continues from the last ``seq_len // 2``."""
    out, have, made = [], prompt_len, 0
    while made < n:
        ctx = seq_len // 2 if have >= seq_len else have
        k = min(n - made, seq_len - ctx)
        out.append((ctx, k))
        have, made = ctx + k, made + k
    return out


def continue_tokens(state, prompt: list[int], n: int, *, seq_len: int, temperature: float = 0.0, top_p: float = 1.0,
                    seed: int = 0, gather_once: bool = False, prefetch: int | None = None) -> list[int]:
    """``n`` token ids after one ``prompt`` (a list of ids), in windows of at most ``seq_len`` tokens.

    Each window is one :func:`generate` call (:func:`chunks`: once the context is full, the last
    ``seq_len // 2`` tokens are the next call's prompt); call ``c`` draws with seed
    ``(seed * 1000 + c) % 2**31``. ``python -m train``'s samples and ``python -m train.sample``
    both run this. Returns the new ids (the prompt excluded).
    """
    tokens = list(prompt)
    new: list[int] = []
    for c, (ctx, k) in enumerate(chunks(len(tokens), n, seq_len)):
        got = generate(state, [tokens[len(tokens) - ctx:]], k, temperature=temperature, top_p=top_p,
                       seed=(seed * 1000 + c) % 2**31, gather_once=gather_once, prefetch=prefetch)[0]
        tokens += got.tolist()
        new += got.tolist()
    return new


if __name__ == "__main__":  # the library has no command line of its own
    import sys

    print("python -m train.generate is the sampling library (train/generate.py); to sample a run folder or a Hugging Face "
          "directory use: python -m train.sample RUN --prompt TEXT --tokens N (python -m train.sample --help)", file=sys.stderr)
    sys.exit(2)
