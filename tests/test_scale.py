"""``train.scale.live_peak``: the live set read from XLA's buffer assignment and live ranges.

The scale table (``python -m train.scale``, docs/memory.md) compares its formula with the most
bytes live at one instant of the compiled step; these tests pin that reading on programs whose
buffers are known.
"""

import tempfile

import jax
import jax.numpy as jnp
import pytest

from train.scale import DUMP_OPTIONS, live_peak

N = 256
BUF = 4 * N * N  # one f32[256, 256], bytes


def _compile_and_read(fn, *args):
    with tempfile.TemporaryDirectory() as dump:
        compiled = jax.jit(fn).lower(*args).compile({**DUMP_OPTIONS, "xla_dump_to": dump})
        live = live_peak(dump)
    ma = compiled.memory_analysis()
    heap = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    return live, heap


def test_two_operands_of_a_matmul_and_its_result_are_live_at_once():
    def _step(x):  # the module must be jit__step, as zshard's train step is
        return jnp.sin(x) @ jnp.cos(x)

    live, heap = _compile_and_read(_step, jax.ShapeDtypeStruct((N, N), jnp.float32))
    # at the dot: the argument, sin(x), cos(x) and the result, nothing else
    assert live["bytes"] == 4 * BUF, live
    assert heap == live["bytes"]
    assert live["op"]  # the instruction scheduled at that instant is named


def test_a_loop_holds_its_argument_carry_and_body_temporaries():
    def _step(x):
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.sin(c) @ c, x)

    live, heap = _compile_and_read(_step, jax.ShapeDtypeStruct((N, N), jnp.float32))
    # inside the body, at the dot: the argument, the carry, sin(c) and the dot's output, and the
    # loop counter (4 bytes); the carry's values (loop, body parameter, result) share one buffer
    assert live["bytes"] == 4 * BUF + 4, live
    assert live["bytes"] <= heap and "while/body" in live["op"]


def test_values_sharing_memory_at_one_instant_count_once(tmp_path):
    """An instruction that reuses its operand's buffer (an in-place update) has both values
    live at its instant; they occupy the same bytes. Synthetic dump: ``a`` (instants 0-1) and
    ``b`` (1-2) share allocation 0's 100 bytes, ``c`` (0-2) has allocation 1's 40."""
    (tmp_path / "module_0001.jit__step.cpu_after_optimizations-buffer-assignment.txt").write_text(
        "BufferAssignment:\n"
        "allocation 0: size 100, preallocated-temp:\n"
        " value: <1 a @0> (size=100,offset=0): f32[25]{0}\n"
        " value: <2 b @0> (size=100,offset=0): f32[25]{0}\n"
        "allocation 1: size 40, parameter 0:\n"
        " value: <3 c @0> (size=40,offset=0): f32[10]{0}\n")
    (tmp_path / "module_0001.jit__step.cpu_after_optimizations-live-range.txt").write_text(
        "HloLiveRange (max 3):\n  InstructionSequence:\n    0:c\n    1:b\n    2:d\n"
        "  BufferLiveRange:\n    a{}:0-1\n    b{}:1-2\n    c{}:0-2\n  Live ranges at 1 (peak):\n")
    (tmp_path / "module_0001.jit__step.cpu_after_optimizations.txt").write_text(
        '  %b = f32[25]{0} fusion(f32[25]{0} %a), kind=kLoop, metadata={op_name="jit(_step)/sin"}\n')
    assert live_peak(tmp_path) == {"bytes": 140, "instant": 0, "op": "c"}  # 100 + 40, not 240 at instant 1


def test_no_dump_is_a_clear_error(tmp_path):
    import pytest  # noqa: PLC0415

    with pytest.raises(FileNotFoundError, match="DUMP_OPTIONS"):
        live_peak(tmp_path)


def test_help_lists_the_choices(capsys):
    from train.scale import SCALE_MODELS, SCALE_STRATEGIES, main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for name in (*SCALE_MODELS, *SCALE_STRATEGIES, "64,512"):
        assert name in text, name


def test_a_small_llama_step_holds_what_the_formula_says(monkeypatch):
    """The scale table's measurement on a 2-block Llama (d 256, f 1024, 128 tokens, 1x8
    FULL_SHARD): live / expected within 2%. Before the fused projections' own backward
    (``train.models.linear.fused_projection``) XLA:CPU copied ``w_gate_up`` and ``wqkv``
    transposed right after their re-gather and held the copies beside them through the
    recomputed attention (1.034 here; llama-7b on 64 devices 1.067)."""
    import dataclasses

    import train.scale as scale

    cfg = dataclasses.replace(scale.PLAN_PRESETS["llama-7b"], d_model=256, n_layers=2, n_heads=4, n_kv_heads=4,
                              d_ff=1024, vocab_size=512, seq_len=128)
    monkeypatch.setitem(scale.PLAN_PRESETS, "test-llama", cfg)
    from jax._src import compilation_cache  # jax memoises whether the persistent cache is used

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a program read from the cache writes no dump
    compilation_cache.reset_cache()
    try:
        (row,) = scale.scale_worker(8, ["test-llama"], ["FULL_SHARD"], seq=128)
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()
    assert 0.98 <= row["live_ratio"] <= 1.02, (row["live"], row["expected"], row["moment"], row["live_op"])


def test_fused_projection_matches_linear_general_forward_and_backward():
    """``fused_projection`` is ``nnx.LinearGeneral.__call__`` with another backward: the same
    values and gradients (kernel, bias, input) on a [C, 3, 5, 4] kernel."""
    from flax import nnx

    from train.models.linear import fused_projection

    layer = nnx.LinearGeneral(16, (3, 5, 4), use_bias=True, rngs=nnx.Rngs(0))
    graph, params = nnx.split(layer)
    params = jax.tree.map(lambda v: jax.random.normal(jax.random.key(2), v.shape), params)
    x = jax.random.normal(jax.random.key(1), (2, 7, 16))

    def loss(params, x, fused):
        m = nnx.merge(graph, params)
        y = fused_projection(m, x) if fused else m(x)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)

    assert jnp.allclose(loss(params, x, True), loss(params, x, False), rtol=1e-6)
    got, want = (jax.grad(loss, argnums=(0, 1))(params, x, fused) for fused in (True, False))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.allclose(a, b, atol=1e-5), float(jnp.max(jnp.abs(a - b)))
