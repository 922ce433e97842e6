"""Per-device memory of the compiled step (``compiled.memory_analysis()``), docs/design.md section 6.

1. Model state: params + AdamW (mu, nu) take exactly (4 + 8) * sum(n_pad) / N bytes per
   device in fp32 (N = devices one parameter is split over), i.e. (4+8)*Psi/N up to padding;
   the arguments are that plus the adam count, the step counter and the batch slice.
2. The ZeRO-3 property: gathered weights are dropped after each block, so the temporary
   bytes of an 8-block model (~1 MB per block) stay well below the whole model's bytes,
   and adding blocks adds only their shard-sized state, not the blocks themselves.
"""

from __future__ import annotations

import functools

import jax
import optax
import pytest
from flax import nnx

import zshard
from conftest import ResMLP, built, mlp_batches, mse_loss

F32 = 4


@functools.cache
def _mlp(d_in, d, d_out, n_blocks):
    """A builder of ``ResMLP(d_in, d, d_out, n_blocks)`` (one function per size: conftest.built's key)."""
    return lambda: ResMLP(d_in, d, d_out, n_blocks=n_blocks, rngs=nnx.Rngs(0))


@functools.cache
def _compiled(strategy, r, s, d_in, d, d_out, n_blocks, batch=16, prefetch=1, abstract=False):
    """``(state, batch, compiled step, its memory analysis)``; ``abstract``: the state's shapes and
    shardings only (no initialiser compiles or runs), for a test that reads the compiled program only;
    else the model built once, eagerly, and copied to the shards (the builder's path, every strategy on
    both meshes: tests/test_strategies.py)."""
    state = zshard.init(
        _mlp(d_in, d, d_out, n_blocks) if abstract else built(_mlp(d_in, d, d_out, n_blocks)),
        optax.adamw(1e-3),
        zshard.make_mesh(r, s),
        strategy=strategy,
        abstract=abstract,
    )
    step = zshard.make_train_step(mse_loss, prefetch=prefetch)
    b = mlp_batches(1, batch, d_in, d_out)[0]
    compiled = step.lower(state, b).compile()
    return state, b, compiled, compiled.memory_analysis()


def _local_bytes(tree) -> int:
    """Bytes of one device's shards of every array leaf (device 0's view)."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += x.addressable_shards[0].data.nbytes
    return total


STATE_CASES = [
    ("FULL_SHARD", 1, 8, 13, 19, 3, 2),
    ("HYBRID_SHARD", 2, 4, 13, 19, 3, 2),
    ("HYBRID_SHARD", 4, 2, 13, 19, 3, 2),
    ("FULL_SHARD", 1, 8, 16, 64, 16, 4),
    ("HYBRID_SHARD", 2, 4, 16, 64, 16, 4),
]


@pytest.mark.parametrize("case", STATE_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[4]}" for c in STATE_CASES])
def test_model_state_bytes(case):
    strategy, r, s = case[:3]
    state, batch, compiled, mem = _compiled(*case)
    plan = state.plan
    n = plan.num_shards
    assert n == (r * s if strategy == "FULL_SHARD" else s)

    slots = [slot for u in plan.units for f in u.flats for slot in f.slots]
    psi = sum(slot.size for slot in slots)
    psi_pad = sum(slot.padded for slot in slots)
    assert psi == plan.num_params()
    assert psi_pad % n == 0
    expected_state = (4 + 8) * psi_pad // n  # fp32 params + mu + nu, one device

    # from the state's own shards
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")
    nu = optax.tree_utils.tree_get(state.opt_state, "nu")
    got_state = _local_bytes(state.params) + _local_bytes(mu) + _local_bytes(nu)
    assert got_state == expected_state
    # (4+8)*Psi/N within padding: each parameter pads by fewer than N elements
    assert (4 + 8) * psi / n <= got_state <= (4 + 8) * (psi + len(slots) * (n - 1)) / n

    # the compiled step's per-device arguments: that, + adam count + step + the batch slice
    scalars = 4 + 4  # int32 adam count, int32 step
    batch_slice = sum(x.nbytes // plan.world for x in jax.tree.leaves(batch))
    assert mem.argument_size_in_bytes == expected_state + scalars + batch_slice, mem
    # the state is donated: every state buffer is reused for the new state
    assert mem.alias_size_in_bytes == expected_state + scalars, mem


BIG = dict(d_in=64, d=512, d_out=64, abstract=True)  # a block: 512*512 + 512 fp32 = 1.05 MB; compiled only


@pytest.mark.parametrize(
    "strategy,r,s", [("FULL_SHARD", 1, 8), ("HYBRID_SHARD", 2, 4), ("HYBRID_SHARD_OPT", 2, 4)],
    ids=["FULL_SHARD-1x8", "HYBRID_SHARD-2x4", "HYBRID_SHARD_OPT-2x4"],
)
def test_temp_bytes_zero3(strategy, r, s):
    # without prefetch: one unit's gather at a time (prefetch's extra units: test_prefetch.py)
    state8, _, _, mem8 = _compiled(strategy, r, s, n_blocks=8, prefetch=0, **BIG)
    state4, _, _, mem4 = _compiled(strategy, r, s, n_blocks=4, prefetch=0, **BIG)
    n = state8.plan.num_shards
    d = BIG["d"]
    block_bytes = F32 * (d * d + d)
    model_bytes = F32 * state8.plan.num_params()
    # the gradient held to the end of backward: [n_pad/M] per parameter, M = the optimizer's
    # shard count (N; R*S for HYBRID_SHARD_OPT, reduce-scattered over replica in backward)
    grad_shard_bytes = F32 * sum(f.padded_size for u in state8.plan.units for f in u.flats) // state8.plan.opt_shards
    temp = mem8.temp_size_in_bytes
    info = (
        f"{strategy} {r}x{s}: temp {temp / 1e6:.2f} MB (4 blocks: {mem4.temp_size_in_bytes / 1e6:.2f} MB), "
        f"model {model_bytes / 1e6:.2f} MB, block {block_bytes / 1e6:.2f} MB, gradient shards {grad_shard_bytes / 1e6:.2f} MB"
    )
    if strategy != "HYBRID_SHARD":
        # gathered weights are not kept: far below the model (keeping them costs >= 1x)
        assert temp < 0.5 * model_bytes, info
    if strategy == "HYBRID_SHARD_OPT":
        # FULL_SHARD's temp on as many devices, + at most one block's gradient shard: the
        # replica reduce-scatter's input [R, L_u/(R S)] concatenates the unit's per-parameter
        # shards (collectives.replica_slices; FULL_SHARD reduce-scatters per parameter, no copy).
        # Seen: 2.28 MB against 2.11 MB (equal, 1.10 MB each, while both concatenated).
        full = _compiled("FULL_SHARD", 1, 8, n_blocks=8, prefetch=0, **BIG)[3].temp_size_in_bytes
        assert full * 0.98 <= temp <= full + block_bytes / s, info + f"; FULL_SHARD on 1x8: {full / 1e6:.2f} MB"
    # beyond this device's gradient shards (Psi/N, needed until the optimizer runs), only a
    # few blocks are alive at once (gathered weights + full gradient of the current block)
    assert temp - grad_shard_bytes <= 4 * block_bytes, info
    # four more blocks cost about their shard-sized state, not four whole blocks
    delta = mem8.temp_size_in_bytes - mem4.temp_size_in_bytes
    assert delta <= 1.5 * 4 * block_bytes / n, info + f"; +4 blocks added {delta / 1e6:.2f} MB of temp"


# --------------------------------------------------------------------------------------
# train/model.py: the loss and embedding gradients written out, the units_with_ends policy
# (docs/memory.md, "Llama-2-70B on 8x8")
# --------------------------------------------------------------------------------------


def test_written_out_gradients_equal_autodiff():
    import jax.numpy as jnp
    import numpy as np

    from train.model import Embed, _token_nll

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 11)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, size=(2, 5)), jnp.int32)

    def plain(z, t):  # the loss as autodiff sees it
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), t[..., None], axis=-1))

    # each side one jitted program, as a train step runs it: eagerly, each of their operations compiled a
    # program of its own (about 50)
    (loss, grad), (want_loss, want_grad) = (jax.jit(jax.value_and_grad(f))(logits, targets) for f in (_token_nll, plain))
    assert float(jax.jit(_token_nll)(logits, targets)) == pytest.approx(float(want_loss), rel=1e-7)  # called alone
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-7)  # its forward rule, under value_and_grad
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)

    emb = Embed(11, 4, rngs=nnx.Rngs(0))
    ids = jnp.asarray([[1, 3, 3, 0], [10, 1, 1, 1]], jnp.int32)  # repeated ids: the rows' gradients add
    w = jnp.asarray(rng.normal(size=(2, 4, 4)), jnp.float32)
    got = nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids) * w)))(emb)["embedding"][...]
    want = jax.jit(jax.grad(lambda tb: jnp.sum(jnp.take(tb, ids, axis=0) * w)))(emb.embedding[...])
    np.testing.assert_array_equal(got, want)


def _loss_models():
    from train.model import GPT, Gemma, GemmaConfig, GPTConfig, Llama, LlamaConfig

    small = dict(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    return {
        "llama": lambda: Llama(LlamaConfig(**small), rngs=nnx.Rngs(0)),  # untied head [C, V]
        "gemma-softcap": lambda: Gemma(GemmaConfig(**small, head_dim=8, final_softcap=3.0), rngs=nnx.Rngs(0)),  # tied [V, C]
        "gpt-tied": lambda: GPT(GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=2,
                                          tie_embeddings=True), rngs=nnx.Rngs(0)),
    }


@functools.cache
def _logits_loss(arch):
    """``(graphdef, params, tokens, targets, (loss, gradients))`` of token_nll of model(tokens), fp32: computed
    once per model (read-only), for each of its chunk sizes."""
    import jax.numpy as jnp
    import numpy as np

    from train.model import _token_nll

    rng = np.random.default_rng(0)
    tokens, targets = (jnp.asarray(rng.integers(0, 97, (3, 16)), jnp.int32) for _ in range(2))
    graphdef, params = nnx.split(_loss_models()[arch]())

    def plain(p):
        return _token_nll(nnx.merge(graphdef, p)(tokens).astype(jnp.float32), targets)

    return graphdef, params, tokens, targets, jax.jit(jax.value_and_grad(plain))(params)


@pytest.mark.parametrize("arch,chunk", [("llama", None), ("llama", 6), ("gemma-softcap", 7), ("gpt-tied", 5),
                                        pytest.param("gemma-softcap", None, marks=pytest.mark.exhaustive)])
def test_chunked_loss_equals_the_logits_loss(arch, chunk):
    # the chunked loss (hidden states and head, no [tokens, V] logits) against token_nll of model(tokens):
    # the value and every parameter's gradient, fp32 (48 tokens: one chunk, 8 of 6, or padded chunks of 5 and 7)
    import numpy as np

    from train.models.loss import chunked_token_nll

    graphdef, params, tokens, targets, (want, want_g) = _logits_loss(arch)

    def chunked(p):
        model = nnx.merge(graphdef, p)
        return chunked_token_nll(model.hidden(tokens), model.output_head(), targets, chunk=chunk)

    got, got_g = jax.jit(jax.value_and_grad(chunked))(params)
    assert float(got) == pytest.approx(float(want), rel=2e-7)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _logits_sized(hlo: str, tokens: int, vocab: int, allowed=()) -> list[str]:
    """The float32 shapes in ``hlo`` of ``tokens`` (or a multiple) x ``vocab`` elements, ``vocab`` last."""
    import math
    import re

    shapes = {tuple(int(d) for d in m.split(",")) for m in re.findall(r"f32\[([\d,]+)\]", hlo)}
    return sorted(str(s) for s in shapes if s[-1] == vocab and s not in allowed
                  and math.prod(s[:-1]) >= tokens and math.prod(s[:-1]) % tokens == 0)


def test_chunked_loss_has_no_tokens_by_vocab_buffer(monkeypatch):
    # In the sharded step: no float32 [tokens, V] logits in forward or backward, only one chunk's [4, V],
    # and no logits-sized scatter (left to autodiff, the loss's gradient is a scatter of -1/n that depends
    # on the targets only: XLA computed it at the start of the step and held it through the forward
    # pass, Llama-2-70B on 8x8: 0.52 GB). d_model 24: the head [24, V] is not a multiple of the 16 tokens.
    from conftest import gpt_batches

    import train.models.loss as loss_module
    from train.model import Llama, LlamaConfig, cross_entropy_loss

    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 4 * 256)  # 4 tokens per chunk: 4 chunks of a device's 16
    cfg = LlamaConfig(vocab_size=256, seq_len=16, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    state = zshard.init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3), zshard.make_mesh(2, 4), strategy="FULL_SHARD",
                        abstract=True)  # compiled only
    step = zshard.make_train_step(cross_entropy_loss)
    hlo = step.lower(state, gpt_batches(1)[0]).compile().as_text()  # one sequence of 16 tokens per device
    assert not _logits_sized(hlo, 16, cfg.vocab_size)
    assert "f32[4,256]" in hlo  # one chunk's logits: the check looks at the right shapes
    scatters = [line for line in hlo.splitlines() if " scatter(" in line and "= f32[4,256]" in line]
    assert not scatters, scatters[:2]


def test_default_chunk_splits_a_large_vocabulary():
    # the default budget (loss_module.LOSS_CHUNK_ELEMENTS) on 1024 tokens of V = 32768: 512-token chunks; no [1024, V]
    import jax.numpy as jnp

    from train.models.loss import Head, chunked_token_nll, loss_chunk

    assert loss_chunk(1024, 32768) == 512 and loss_chunk(10, 32768) == 10 and loss_chunk(8, 1 << 30) == 1
    h, w = jax.ShapeDtypeStruct((2, 512, 8), jnp.bfloat16), jax.ShapeDtypeStruct((8, 32768), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((2, 512), jnp.int32)
    grad = jax.jit(jax.grad(lambda h, w, t: chunked_token_nll(h, Head(w, 1), t), argnums=(0, 1)))
    hlo = grad.lower(h, w, t).compile().as_text()
    assert not _logits_sized(hlo, 1024, 32768, allowed={(8, 32768)}) and "f32[512,32768]" in hlo


def _ends_model(arch):
    from train.model import GPT, GPTConfig, Llama, LlamaConfig

    if arch == "llama":
        return Llama(LlamaConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48),
                     rngs=nnx.Rngs(0))
    tied = arch == "gpt-tied"
    return GPT(GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=tied, scan=not tied), rngs=nnx.Rngs(0))


@functools.cache
def _ends_reference(arch):
    """3 SGD steps of ``arch`` on one device, computed once per model for both meshes."""
    from conftest import gpt_batches, reference_run

    from train.model import cross_entropy_loss

    # as test_plan.py: Adam turns rounding into sign flips
    return reference_run(lambda: _ends_model(arch), optax.sgd(0.5), cross_entropy_loss, gpt_batches(3))


# 4x2 (4 replicas of 2 shards) takes 2x4's path with other padding: -m exhaustive
@pytest.mark.parametrize("mesh", [(2, 4), pytest.param((4, 2), marks=pytest.mark.exhaustive)], ids=["2x4", "4x2"])
@pytest.mark.parametrize("arch", ["llama", "gpt-tied", "gpt-scan"])
def test_units_with_ends_matches_single_device(arch, mesh):
    import numpy as np
    from conftest import gpt_batches, zshard_run

    from train.model import cross_entropy_loss, units_with_ends

    def make():
        return _ends_model(arch)

    data = gpt_batches(3)
    want = _ends_reference(arch)
    # the tied GPT from its builder (initialised under jit: the tied GPT's builder path, tests/test_plan.py's
    # presets test names this one); the Llama and the scanned GPT built once, eagerly, and copied (their
    # builders' paths: tests/test_plan.py's test_abstract_init_matches_concrete[FULL_SHARD],
    # tests/test_scan.py)
    got = zshard_run(make if arch == "gpt-tied" else built(_ends_model, arch), optax.sgd(0.5), zshard.make_mesh(*mesh), "HYBRID_SHARD_OPT", cross_entropy_loss, data,
                     unit=units_with_ends)
    units = [u.name for u in zshard.init(make, optax.adamw(3e-3), zshard.make_mesh(*mesh), strategy="HYBRID_SHARD_OPT",
                                         unit=units_with_ends, abstract=True).plan.units]
    assert ("wte" if arch.startswith("gpt") else "embed") in units and (arch == "gpt-tied") != ("head" in units), units
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
    for path, ref in want.params.items():
        np.testing.assert_allclose(got.params[path], ref, rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_plan_cli_unit_ends(capsys):
    """``python -m train.plan --unit ends`` as its own process (its exit status 0; the other plan tests call
    its ``main`` in the test process)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    base = [sys.executable, "-m", "train.plan", "--model", "llama-1b", "--mesh", "2x4", "--strategy", "HYBRID_SHARD_OPT", "--seq-len", "64"]
    out = subprocess.run(base + ["--unit", "ends"], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--unit ends" in out.stdout and "FITS" in out.stdout, out.stdout[-1500:]
    from train import plan  # noqa: PLC0415  (refused by argparse: in this process, no second interpreter)

    with pytest.raises(SystemExit) as e:
        plan.main(base[3:] + ["--unit", "root"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'root'" in err, err[-500:]
