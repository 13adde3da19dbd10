"""fmtkit.debug in a training step: the program without it, the logging schedule without
recompiles, overrides visible in the jaxpr and the loss, configuration files and errors."""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_utils import dot_operand_dtypes, iter_eqns

import fmtkit.debug as debug
import fmtkit.fp8
from fmtkit import with_policy
from fmtkit.policy import Rules, get_preset, intercept_gemms


class Mlp3(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Dense(64)(x))
        h = jax.nn.relu(nn.Dense(48)(h))
        return nn.Dense(8)(h)


def _setup(policy="fp8-current"):
    model = with_policy(Mlp3(), policy)
    x = jax.random.normal(jax.random.key(1), (16, 32))
    v = model.init(jax.random.key(0), x)

    def loss(v):
        return jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))

    return loss, v


def test_without_a_configuration_the_program_is_unchanged():
    loss, v = _setup()
    step = jax.jit(jax.value_and_grad(loss))
    plain = step.lower(v).as_text()

    def passthrough(site, run, a, b):
        return run(a, b, site.fp8)

    with intercept_gemms(passthrough):
        hooked = jax.jit(jax.value_and_grad(loss)).lower(v).as_text()
    assert hooked == plain
    # Negative control: logging statistics does change the program.
    cfg = debug.DebugConfig([debug.Rule("Dense_0", stats=("amax",))])
    state = debug.init(cfg, loss, v)

    def f(v, s, i):
        with debug.capture(cfg, s, i):
            return loss(v)

    logged = jax.jit(jax.grad(f, argnums=(0, 1))).lower(v, state, 0).as_text()
    assert logged != plain


def test_statistics_appear_exactly_at_the_configured_steps_without_recompiling():
    loss, v = _setup()
    cfg = debug.DebugConfig([debug.Rule("Dense_1", tensors=("wgrad", "activation"),
                                        stats=("amax", "underflow_share"), freq=3,
                                        start_step=2, end_step=8)])
    state = debug.init(cfg, loss, v)
    assert jax.tree.structure(state) == jax.tree.structure(
        {"Dense_1": {"dot_general_0": {"activation": {"amax": 0, "underflow_share": 0},
                                       "wgrad": {"amax": 0}}}})
    traces = []

    @jax.jit
    def step(v, state, i):
        traces.append(1)

        def f(v, s):
            with debug.capture(cfg, s, i):
                return loss(v)

        _, (_, stats) = jax.value_and_grad(f, argnums=(0, 1))(v, state)
        return stats, cfg.logs_at(i)

    seen = []
    for i in range(12):
        stats, flag = step(v, state, jnp.int32(i))
        leaves = np.array(jax.tree.leaves(stats))
        assert bool(flag) == bool(np.isfinite(leaves).all())
        assert np.isfinite(leaves).all() or np.isnan(leaves).all()
        if bool(flag):
            seen.append(i)
    assert seen == [2, 5, 8]
    assert len(traces) == 1


def test_static_schedule_logs_the_active_rules_and_quiet_steps_have_no_statistics():
    import functools

    loss, v = _setup()
    cfg = debug.DebugConfig([
        debug.Rule("Dense_0", tensors=("output_grad",), stats=("l2_norm",), freq=4),
        debug.Rule("Dense_1", tensors=("weight",), stats=("amax",), freq=2, start_step=1)])
    assert [sorted(cfg.active_rules(i)) for i in range(6)] == [[0], [1], [], [1], [0], [1]]
    state = debug.init(cfg, loss, v)
    traces = []

    @functools.partial(jax.jit, static_argnames="active")
    def step(v, s, active):
        traces.append(active)

        def f(v, s):
            with debug.capture(cfg, s, active=active):
                return loss(v)

        return jax.grad(f, argnums=(0, 1))(v, s)

    traced = []

    @jax.jit
    def step_traced(v, s, i):
        traced.append(1)

        def f(v, s):
            with debug.capture(cfg, s, i):
                return loss(v)

        return jax.grad(f, argnums=(0, 1))(v, s)

    for i in range(6):
        got = step(v, state, cfg.active_rules(i))
        want = step_traced(v, state, jnp.int32(i))
        # the same statistics (NaN alike) and gradients as the traced schedule
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
        on = [not np.isnan(float(x)) for x in jax.tree.leaves(got[1])]
        assert on == [0 in cfg.active_rules(i), 1 in cfg.active_rules(i)]  # leaf order
    assert len(traces) == 3 and len(traced) == 1  # {0}, {1}, {} once each
    # A quiet step compiles to the program without fmtkit.debug (but for the NaN outputs):
    # the same GEMMs, and no conditional.
    def ops(compiled, name):
        return len(re.findall(rf"= \S+ {name}\(", compiled.as_text()))

    quiet = jax.jit(functools.partial(step, active=frozenset())).lower(v, state).compile()
    plain = jax.jit(jax.grad(loss)).lower(v).compile()
    assert ops(quiet, "dot") == ops(plain, "dot") > 0
    assert ops(quiet, "conditional") == 0


def _rules_with(preset: str, module: str, policy) -> Rules:
    base = get_preset(preset)
    return Rules([(module, policy), *base.rules], default=base.default, head=base.head,
                 output_dtype=base.output_dtype)


def _forward_dots(fn, v) -> list[list[str]]:
    """Operand dtypes of the forward dots (Dense_0, Dense_1, the head Dense_2), FP8 formats
    where an emulated FP8 GEMM reads them widened."""
    return [[jnp.dtype(d).name for d in dots]
            for dots in dot_operand_dtypes(jax.make_jaxpr(fn)(v))]


@pytest.mark.parametrize("override", ["compute", "current", "fake_quant:e5m2"])
def test_an_override_shows_in_the_jaxpr_and_the_loss(override):
    loss, v = _setup("fp8-rowwise")
    cfg = debug.DebugConfig([debug.Rule("^Dense_0$", tensors=(), override=override)])

    def with_override(v):
        with debug.capture(cfg):
            return loss(v)

    e4m3, bf16 = ["float8_e4m3fn"] * 2, ["bfloat16"] * 2
    assert _forward_dots(loss, v) == [e4m3, e4m3, bf16]
    want_dense0 = e4m3 if override == "current" else bf16
    assert _forward_dots(with_override, v) == [want_dense0, e4m3, bf16]
    got = jax.jit(with_override)(v)
    assert got != jax.jit(loss)(v)
    # The same loss as a policy that gives Dense_0 that setting.
    preset = get_preset("fp8-rowwise").default
    if override == "compute":
        same = dataclasses.replace(preset, fp8=None)
    elif override == "current":
        same = dataclasses.replace(preset, fp8=dataclasses.replace(
            preset.fp8, name="current", x_tile="tensor", w_tile="tensor", grad_tile="tensor"))
    else:
        return  # fake quantization: test_fake_quantization_...
    base = get_preset("fp8-rowwise")
    rules = Rules([("^Dense_0$", same), *base.rules], default=base.default, head=base.head,
                  output_dtype=base.output_dtype)
    ref_loss, _ = _setup(rules)
    assert jax.jit(ref_loss)(v) == got


def test_fake_quantization_quantizes_operands_and_the_output_gradient():
    import fmtkit

    loss, v = _setup("fp8-rowwise")
    cfg = debug.DebugConfig([debug.Rule("^Dense_1$", tensors=(), override="fake_quant:e5m2")])

    def with_override(v):
        with debug.capture(cfg):
            return loss(v)

    q = fmtkit.TensorScaling()

    @jax.custom_vjp
    def qdq_grad(y):
        return y

    qdq_grad.defvjp(lambda y: (y, None), lambda _, g: (fmtkit.qdq(g, "e5m2", q),))

    def by_hand(site, run, a, b):
        # What the override means: the operands quantized-dequantized to E5M2 (per tensor),
        # the GEMM in the compute dtype, its output gradient quantized-dequantized too.
        if site.path != "Dense_1":
            return run(a, b, site.fp8)
        return qdq_grad(run(fmtkit.qdq(a, "e5m2", q), fmtkit.qdq(b, "e5m2", q), None))

    def reference(v):
        with intercept_gemms(by_hand):
            return loss(v)

    got = jax.jit(jax.value_and_grad(with_override))(v)
    want = jax.jit(jax.value_and_grad(reference))(v)
    assert got[0] == want[0] != jax.jit(loss)(v)
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(got[1]),
                                                    jax.tree.leaves(want[1])))
    e4m3, bf16 = ["float8_e4m3fn"] * 2, ["bfloat16"] * 2
    assert _forward_dots(with_override, v) == [e4m3, bf16, bf16]


class Wide(nn.Module):
    """Two 256-wide layers and a head: contractions of two 128-blocks."""

    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Dense(256)(x))
        h = jax.nn.relu(nn.Dense(256)(h))
        return nn.Dense(8)(h)


def _amax_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Output shapes of the reductions that give the scales (``reduce_max``), in program
    order: ``()`` for a per-tensor scale, one element per tile or block otherwise."""
    return [tuple(e.outvars[0].aval.shape) for e in iter_eqns(jaxpr)
            if e.primitive.name == "reduce_max"]


def _fp8_cast_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Input shapes of the casts to an FP8 format, in program order: the quantized operands,
    laid out by tile (``[rows, tiles, 128]``, ``[blocks, 128, blocks, 128]``) or whole."""
    return [tuple(e.invars[0].aval.shape) for e in iter_eqns(jaxpr)
            if e.primitive.name == "convert_element_type"
            and jnp.dtype(e.params["new_dtype"]).name.startswith("float8")]


def test_the_blockwise_override_scales_its_gemm_per_tile_and_block():
    model = with_policy(Wide(), "fp8-current")
    x = jax.random.normal(jax.random.key(1), (8, 256)).at[:, 3].mul(1e3)  # an outlier channel
    v = model.init(jax.random.key(0), x)

    def loss_of(model):
        return lambda v: jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))

    loss = loss_of(model)
    cfg = debug.DebugConfig([debug.Rule("^Dense_0$", tensors=(), override="blockwise")])

    def with_override(v):
        with debug.capture(cfg):
            return loss(v)

    fwd = jax.make_jaxpr(with_override)(v)
    # Forward: Dense_0's activation [8, 256] gets one scale per 1x128 tile, [8, 2], and its
    # weight [256, 256] one per 128x128 block, [2, 2]; Dense_1 keeps one scale per operand;
    # the head (bf16 under the preset) none.
    assert [s for s in _amax_shapes(fwd) if s] == [(8, 2), (2, 2)]
    assert _fp8_cast_shapes(fwd) == [(8, 2, 128), (2, 128, 2, 128), (8, 256), (256, 256)]
    assert [s for s in _amax_shapes(jax.make_jaxpr(loss)(v)) if s] == []
    # Backward (after the forward's two): Dense_0's output gradient [8, 256] in 1x128 tiles
    # along its 256 columns for the data gradient, [8, 2]; for the weight gradient it and
    # the activation are tiled along their 8 rows (the contraction, zero-padded to one
    # 128-tile): one scale per column each, [256]. Dense_1's gradients stay per tensor.
    bwd = _amax_shapes(jax.make_jaxpr(jax.grad(with_override))(v))
    assert [s for s in bwd if s] == [(8, 2), (2, 2), (8, 2), (256,), (256,)]
    # The loss and gradients of a policy whose recipe for Dense_0 is DeepSeek-V3's
    # fine-grained scaling with fp8-current's formats, written out by hand.
    preset = get_preset("fp8-current").default
    fine = dataclasses.replace(preset, fp8=fmtkit.fp8.Fp8Recipe(
        "fine", x_format="e4m3", w_format="e4m3", grad_format="e5m2", x_tile="1x128",
        w_tile="128x128", grad_tile="1x128"))
    ref = loss_of(with_policy(Wide(), _rules_with("fp8-current", "^Dense_0$", fine)))
    got = jax.jit(jax.value_and_grad(with_override))(v)
    want = jax.jit(jax.value_and_grad(ref))(v)
    assert got[0] == want[0] != jax.jit(loss)(v)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_blockwise_override_of_a_gemm_without_a_recipe_is_e4m3_throughout():
    # Under bf16-mixed no GEMM has a recipe: the override gives Dense_0 DeepSeek-V3's,
    # E4M3 activations, weights and gradients.
    model = with_policy(Wide(), "bf16-mixed")
    x = jax.random.normal(jax.random.key(1), (8, 256))
    v = model.init(jax.random.key(0), x)
    cfg = debug.DebugConfig([debug.Rule("^Dense_0$", tensors=(), override="blockwise")])

    def with_override(v):
        with debug.capture(cfg):
            return jnp.mean(jnp.square(model.apply(v, x).astype(jnp.float32)))

    e4m3, bf16 = ["float8_e4m3fn"] * 2, ["bfloat16"] * 2
    assert _forward_dots(with_override, v) == [e4m3, bf16, bf16]
    assert [s for s in _amax_shapes(jax.make_jaxpr(with_override)(v)) if s] == [(8, 2), (2, 2)]
    grad = jax.make_jaxpr(jax.grad(with_override))(v)
    formats = {jnp.dtype(d).name for dots in dot_operand_dtypes(grad) for d in dots}
    assert formats == {"float8_e4m3fn", "bfloat16"}  # no E5M2 gradient


def test_a_pattern_that_matches_no_gemm_names_it_and_lists_the_gemms():
    loss, v = _setup()
    cfg = debug.DebugConfig([debug.Rule("Dense_0"), debug.Rule("Attention")])
    with pytest.raises(ValueError, match=r"'Attention'.*matches no GEMM") as err:
        debug.init(cfg, loss, v)
    assert "'Dense_2' / dot_general_0" in str(err.value)

    def f(v):
        with debug.capture(debug.DebugConfig([debug.Rule("Dense_9", override="compute",
                                                         tensors=())])):
            return loss(v)

    with pytest.raises(ValueError, match="Dense_9"):
        jax.jit(f)(v)


def test_a_model_applied_twice_in_one_capture_raises():
    loss, v = _setup()
    cfg = debug.DebugConfig([debug.Rule("Dense_0", stats=("amax",))])
    with pytest.raises(ValueError, match="ran in two policied calls"):
        debug.init(cfg, lambda v: loss(v) + loss(v), v)


def test_statistics_of_a_gemm_inside_a_scan_have_one_slot_per_iteration():
    # (their values: tests/debug/test_capture_scan.py)
    def f(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w), None

        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    model = with_policy(f, "bf16-mixed")
    ws, x = jnp.ones((3, 4, 4)), jnp.ones((2, 4))
    cfg = debug.DebugConfig([debug.Rule("", stats=("amax",))])
    state = debug.init(cfg, model, ws, x)
    assert {a.shape for a in jax.tree.leaves(state)} == {(3,)}
    # An override alone works there too.
    ocfg = debug.DebugConfig([debug.Rule("", tensors=(), override="fake_quant:e4m3")])

    def g(ws):
        with debug.capture(ocfg):
            return model(ws, x)

    assert jnp.isfinite(jax.jit(jax.grad(g))(ws)).all()


def test_configuration_files_load_like_python(tmp_path):
    want = debug.DebugConfig([
        debug.Rule("type:Dense", gemm="dot_general_0", tensors=("activation", "dgrad"),
                   stats=("amax", "sqnr_db"), freq=10, start_step=5, end_step=100),
        debug.Rule("subtree:Block_1", tensors=(), override="fake_quant:e5m2")])
    (tmp_path / "d.yaml").write_text(
        "rules:\n"
        "  - pattern: 'type:Dense'\n    gemm: dot_general_0\n"
        "    tensors: [activation, dgrad]\n    stats: [amax, sqnr_db]\n"
        "    freq: 10\n    start_step: 5\n    end_step: 100\n"
        "  - {pattern: 'subtree:Block_1', tensors: [], override: 'fake_quant:e5m2'}\n")
    (tmp_path / "d.toml").write_text(
        "[[rules]]\npattern = 'type:Dense'\ngemm = 'dot_general_0'\n"
        "tensors = ['activation', 'dgrad']\nstats = ['amax', 'sqnr_db']\n"
        "freq = 10\nstart_step = 5\nend_step = 100\n"
        "[[rules]]\npattern = 'subtree:Block_1'\ntensors = []\n"
        "override = 'fake_quant:e5m2'\n")
    assert debug.DebugConfig.load(tmp_path / "d.yaml") == want
    assert debug.DebugConfig.load(tmp_path / "d.toml") == want


@pytest.mark.parametrize("fields, match", [
    ({"pattern": "x", "stats": ["amaks"]}, r"rules\[0\]: stats: unknown name\(s\) \['amaks'\]"),
    ({"pattern": "x", "tensors": ["grad"]}, r"tensors: unknown name"),
    ({"pattern": "x", "freq": 0}, r"freq must be an int >= 1"),
    ({"pattern": "x", "override": "bf16"}, r"override must be one of"),
    ({"pattern": "x", "override": "fake_quant:e9m9"}, r"fake_quant:e9m9"),
    ({"pattern": "(", "override": None}, r"Invalid rule regex"),
    ({"pattern": "x", "every": 3}, r"unknown field\(s\) \['every'\]"),
])
def test_bad_rules_raise_naming_the_field(fields, match):
    with pytest.raises((ValueError, TypeError), match=match):
        debug.DebugConfig.from_dict({"rules": [fields]})


# fp8-current warns that the conv runs bf16 (tested in tests/policy/test_conv_fp8_warning.py).
@pytest.mark.filterwarnings("ignore:Convolutions in module:UserWarning")
def test_a_convolution_logs_its_six_tensors_without_quantization_statistics():
    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.Conv(4, (3, 3))(x).reshape(x.shape[0], -1))

    model = with_policy(Conv(), "fp8-current")
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    v = model.init(jax.random.key(1), x)

    def loss(v):
        return jnp.sum(model.apply(v, x).astype(jnp.float32))

    cfg = debug.DebugConfig([debug.Rule("Conv", stats=("amax", "sqnr_db"),
                                        override="fake_quant:e4m3")])
    state = debug.init(cfg, loss, v)
    # sqnr_db is a quantization statistic: a dot_general's only (see fmtkit.debug)
    assert state == {"Conv_0": {"conv_general_dilated_0": {
        t: {"amax": 0.0} for t in debug.TENSORS}}}

    def f(v, s):
        with debug.capture(cfg, s, 0):
            return loss(v)

    stats = jax.jit(jax.grad(f, argnums=(0, 1)))(v, state)[1]
    got = stats["Conv_0"]["conv_general_dilated_0"]
    assert float(got["activation"]["amax"]) == float(jnp.max(jnp.abs(
        x.astype(jnp.bfloat16))))
