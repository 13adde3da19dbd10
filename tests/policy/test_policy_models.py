"""with_policy on the reference models, linen and NNX alike (strict dtype promotion throughout).

Dtype facts are read from the jaxpr by ``inspect_policy``; numbers are checked against the
unwrapped model (fp32) and against a float64 NumPy backward pass with ml_dtypes rounding.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from policy_testlib import APIS, MODEL_NAMES, build, init_params, loss_and_grads

from fmtkit.policy import Policy, get_preset, inspect_policy, module_paths, with_policy
from fmtkit.policy._policy import OPTIONAL_PATTERNS

BF16, F32 = "bfloat16", "float32"


def _report(case, wrapped):
    return inspect_policy(wrapped, *case.inputs, loss_fn=case.loss_fn)


def _operands(d):
    return d.split(" -> ")[0]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bf16_mixed_dtypes_in_the_jaxpr(api, name):
    case = build(api, name)
    report = _report(case, with_policy(case.model, "bf16-mixed"))
    n_half_dots = 0
    for kind in ("forward", "dgrad", "wgrad"):
        for path, d in report.matmuls(kind):
            # Switch Transformer: router input and logits in f32; every other matmul bf16.
            want = f"{F32} x {F32}" if path.endswith("router") else f"{BF16} x {BF16}"
            assert _operands(d) == want, (path, kind, d)
            n_half_dots += not path.endswith("router")
    assert n_half_dots > 0
    assert report.matmuls("wgrad")  # weight gradients are found and checked too
    for path, m in report.modules.items():
        if m.type_name in ("LayerNorm", "RMSNorm"):
            assert m.norm_dtypes == (F32,), path  # norm statistics in f32
            assert m.output_dtypes == (BF16,), path
        if m.softmax_dtypes:  # attention softmax, router softmax (MoE module)
            assert m.softmax_dtypes == (F32,), path
        assert set(m.reduction_dtypes) <= {F32}, path
        if path.endswith("router"):
            assert m.output_dtypes == (F32,), path
    if "moe" in name:
        routers = [p for p in report.modules if p.endswith("router")]
        assert routers and all(report.modules[p].matmuls["forward"] for p in routers)
    if name.startswith("lm"):
        attn = [m for p, m in report.modules.items() if p.endswith("attn")]
        assert attn and all(m.softmax_dtypes == (F32,) for m in attn)  # attention softmax
        # The head, found by role (tied "attend" in lm_moe_tied): bf16 operands, f32 logits.
        assert report.matmuls("forward", head=True) and all(
            d == f"{BF16} x {BF16} -> {F32}" for _, d in report.matmuls("forward", head=True))
        for kind in ("dgrad", "wgrad"):
            assert all(_operands(d) == f"{BF16} x {BF16}"
                       for _, d in report.matmuls(kind, head=True))
    for path, (stored, grad) in report.params.items():
        assert (stored, grad) == (F32, F32), path
    assert report.output_dtypes == (F32,)
    assert report.loss_dtype == F32


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("preset, half, stored", [("fp16-mixed", "float16", F32),
                                                   ("pure-bf16", BF16, BF16)])
def test_other_presets_on_the_transformer(api, preset, half, stored):
    case = build(api, "lm_moe_tied")
    report = _report(case, with_policy(case.model, preset))
    router_dt = F32 if preset == "fp16-mixed" else half
    for kind in ("forward", "dgrad", "wgrad"):
        for head in (False, True):
            for path, d in report.matmuls(kind, head=head):
                want = router_dt if path.endswith("router") and not head else half
                assert _operands(d) == f"{want} x {want}", (path, kind, d)
    for path, m in report.modules.items():
        if m.type_name in ("LayerNorm", "RMSNorm"):
            assert m.norm_dtypes == (F32,), path  # norm statistics in f32 in every preset
        if path.endswith("attn"):
            assert m.softmax_dtypes == (F32,), path  # attention softmax in f32 in every preset
    assert {v for v in report.params.values()} == {(stored, stored)}
    assert report.output_dtypes == ((F32,) if preset == "fp16-mixed" else (BF16,))


def _grad_jaxpr(case, model, params=None):
    """The jaxpr of value_and_grad(loss) of ``model`` (str; no name stacks in it)."""
    if case.api == "linen":
        fn = jax.value_and_grad(
            lambda p: case.loss_fn(model.apply({"params": p}, *case.inputs)))
        return str(jax.make_jaxpr(fn)(params))
    graphdef, state = nnx.split(model)
    fn = jax.value_and_grad(lambda st: case.loss_fn(nnx.merge(graphdef, st)(*case.inputs)))
    return str(jax.make_jaxpr(fn)(state))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name", ["lm_moe_tied", "moe"])
def test_fp32_preset_is_the_unwrapped_model(api, name):
    """Under "fp32" every op is rebound with the dtypes it was traced with: loss and
    gradients bit-identical to the unwrapped model's."""
    case = build(api, name)
    wrapped = with_policy(case.model, "fp32")
    params = init_params(case) if api == "linen" else None
    ref = loss_and_grads(case, case.model, params)
    got = loss_and_grads(case, wrapped, params)
    assert np.asarray(got[0]) == np.asarray(ref[0])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got[1], ref[1])


def _gelu_f64(h):  # the tanh approximation, which flax's nn.gelu / nnx.gelu use
    c = math.sqrt(2 / math.pi)
    u = c * (h + 0.044715 * h**3)
    gelu = 0.5 * h * (1 + np.tanh(u))
    dgelu = 0.5 * (1 + np.tanh(u)) + 0.5 * h * (1 - np.tanh(u) ** 2) * c * (1 + 3 * 0.044715 * h**2)
    return gelu, dgelu


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("api", APIS)
def test_grad_dtype_rounds_cotangents_like_a_float64_reference(api):
    """g=bf16 with everything else f32: each module's incoming cotangent is rounded to bf16."""
    case = build(api, "mlp")
    (x,) = case.inputs
    t = np.random.default_rng(7).standard_normal((4, 6)).astype(np.float32)
    case.loss_fn = lambda y: jnp.sum(y * jnp.asarray(t))
    rounded = with_policy(case.model, Policy.parse("p=f32,c=f32,o=f32,g=bf16"))
    plain = with_policy(case.model, Policy.parse("p=f32,c=f32,o=f32,g=f32"))
    if api == "linen":
        params = init_params(case)
        w = [(params[f"Dense_{i}"]["kernel"], params[f"Dense_{i}"]["bias"]) for i in (0, 1)]
        _, g_round = loss_and_grads(case, rounded, params)
        _, g_plain = loss_and_grads(case, plain, params)
        gw = [g_round[f"Dense_{i}"]["kernel"] for i in (0, 1)]
        gw_plain = [g_plain[f"Dense_{i}"]["kernel"] for i in (0, 1)]
        names = ["Dense_0", "Dense_1"]
    else:
        layers = case.model.layers
        w = [(layers[i].kernel[...], layers[i].bias[...]) for i in (0, 1)]
        _, g_round = loss_and_grads(case, rounded)
        _, g_plain = loss_and_grads(case, plain)
        gw = [g_round["layers"][i]["kernel"] for i in (0, 1)]
        gw_plain = [g_plain["layers"][i]["kernel"] for i in (0, 1)]
        names = ["layers/0", "layers/1"]
    (w0, b0), (w1, _) = [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in w]
    x64 = np.asarray(x, np.float64)
    h = x64 @ w0 + b0
    a, da = _gelu_f64(h)
    # dL/dW = input^T @ (cotangent entering the layer); the inputs have full column rank, so
    # least squares recovers the cotangent each layer received from its weight gradient.
    def received(inputs, grad):
        return np.linalg.lstsq(inputs.T, np.asarray(grad, np.float64), rcond=None)[0].T

    def off_grid(v):  # relative distance to the nearest bf16 value
        return np.abs(v - _bf16(v)) / np.maximum(np.abs(v), 1e-30)

    # Dense_1 received the loss's cotangent t rounded to bf16 (the input t is exact).
    np.testing.assert_allclose(received(a, gw[1]).T, _bf16(t), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(received(a, gw_plain[1]).T, t, rtol=1e-5, atol=1e-6)
    # Dense_0 received (round(t) @ W1^T) * gelu'(h), rounded to bf16: on the bf16 grid, and
    # within bf16's unit roundoff 2^-8 of the float64 value (recovery error << bf16 spacing).
    ct_h = (_bf16(t) @ w1.T) * da
    got = received(x64, gw[0]).T
    assert off_grid(got).max() < 1e-4
    np.testing.assert_allclose(got, ct_h, rtol=2.0**-8 + 1e-5, atol=1e-6)
    # Without g=bf16 the cotangent is not rounded: mostly off the grid.
    assert np.median(off_grid(received(x64, gw_plain[0]).T)) > 1e-4
    report = _report(case, rounded)
    for name in names:
        for kind in ("forward", "dgrad", "wgrad"):
            assert all(d == f"{F32} x {F32} -> {F32}"
                       for d in report.modules[name].matmuls.get(kind, ()))


@pytest.mark.parametrize("api", APIS)
def test_jitted_train_step_traces_once(api):
    case = build(api, "moe")
    wrapped = with_policy(case.model, "bf16-mixed")
    traces = []
    rng = np.random.default_rng(10)
    tx = optax.sgd(0.1)
    losses = []
    if api == "linen":
        params = init_params(case, wrapped)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, x):
            traces.append(1)
            loss, g = jax.value_and_grad(
                lambda p: case.loss_fn(wrapped.apply({"params": p}, x)))(params)
            updates, opt_state = tx.update(g, opt_state)
            return optax.apply_updates(params, updates), opt_state, loss

        for _ in range(3):
            x = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
            params, opt_state, loss = step(params, opt_state, x)
            losses.append(float(loss))
        stored = jax.tree.leaves(params)
    else:
        opt = nnx.Optimizer(wrapped, tx, wrt=nnx.Param)
        w_in_before = np.asarray(case.model.w_in[...])

        @nnx.jit
        def step(model, opt, x):
            traces.append(1)
            loss, g = nnx.value_and_grad(lambda m: case.loss_fn(m(x)))(model)
            opt.update(model, g)
            return loss

        for _ in range(3):
            x = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
            losses.append(float(step(wrapped, opt, x)))
        stored = jax.tree.leaves(nnx.state(wrapped, nnx.Param))
        # The wrapped model shares its Variables with the original: the update is visible.
        assert not np.array_equal(np.asarray(case.model.w_in[...]), w_in_before)
    assert len(traces) == 1
    assert all(np.isfinite(losses))
    assert all(leaf.dtype == jnp.float32 for leaf in stored)


@pytest.mark.parametrize("api", APIS)
def test_pure_bf16_stores_params_in_bf16(api):
    case = build(api, "mlp")
    wrapped = with_policy(case.model, "pure-bf16")
    if api == "linen":
        leaves = jax.tree.leaves(init_params(case, wrapped))
        ref = jax.tree.leaves(init_params(case))
        # created as the model would, then rounded to bf16
        for got, want in zip(leaves, ref):
            np.testing.assert_array_equal(np.asarray(got),
                                          np.asarray(want).astype(ml_dtypes.bfloat16))
    else:
        leaves = jax.tree.leaves(nnx.state(wrapped, nnx.Param))
    assert leaves and all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    report = _report(case, wrapped)
    assert {g for _, g in report.params.values()} == {BF16}
    assert report.output_dtypes == (BF16,)


@pytest.mark.parametrize("api", APIS)
def test_jax_vmap_over_the_wrapped_model(api):
    case = build(api, "mlp")
    wrapped = with_policy(case.model, "bf16-mixed")
    xs = jnp.asarray(np.random.default_rng(3).standard_normal((3, 4, 8)), jnp.float32)
    if api == "linen":
        params = init_params(case)

        def f(x):
            return wrapped.apply({"params": params}, x)
    else:
        def f(x):
            return wrapped(x)
    batched = jax.jit(jax.vmap(f))(xs)
    assert batched.dtype == jnp.float32
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(jax.jit(f)(xs[i])))


def _wrap_and_init(case, rules, **kwargs):
    """``with_policy``, plus linen's ``init`` (where a linen model learns its modules)."""
    wrapped = with_policy(case.model, rules, **kwargs)
    if case.api == "linen":
        init_params(case, wrapped)


@pytest.mark.parametrize("api", APIS)
def test_unmatched_rule_warns_with_paths_or_raises_when_strict(api):
    case = build(api, "mlp")
    rules = [("Dense|layers", "c=bf16"), ("no_such_module", "f32")]
    with pytest.warns(UserWarning, match="no_such_module") as record:
        _wrap_and_init(case, rules)
    assert ("Dense_1" if api == "linen" else "layers/1") in str(record[0].message)
    with pytest.raises(ValueError, match="no_such_module"):
        _wrap_and_init(case, rules, strict=True)


@pytest.mark.parametrize("api", APIS)
def test_a_typo_in_rules_built_from_a_preset_is_reported(api):
    # A rule list made from a preset with dataclasses.replace keeps the preset's other
    # fields; the preset's own patterns (norms, router: this MLP has neither) stay silent, a
    # pattern of the user's that matches nothing (a typo: Dense_9 / layers/9) does not.
    case = build(api, "mlp")
    preset = get_preset("bf16-mixed")
    typo = "^(Dense_9|layers/9)$"
    rules = dataclasses.replace(preset, rules=[(typo, "f32"), *preset.rules])
    assert rules.check_unmatched and rules.head == preset.head
    with pytest.warns(UserWarning, match=r"match no module") as record:
        _wrap_and_init(case, rules)
    msg = str(record[0].message)
    assert repr([typo]) in msg  # the typo alone: no preset pattern is listed as missing
    assert not any(p in msg for p in OPTIONAL_PATTERNS)
    assert ("'Dense_1' (Dense)" if api == "linen" else "'layers/1' (Linear)") in msg
    with pytest.raises(ValueError, match=r"Dense_9\|layers/9"):
        _wrap_and_init(case, rules, strict=True)


@pytest.mark.parametrize("api", APIS)
def test_inspect_policy_names_the_rule_of_each_module(api):
    case = build(api, "mlp")
    first = "Dense_0" if api == "linen" else "layers/0"
    report = _report(case, with_policy(case.model, [(f"^{first}$", "c=bf16")]))
    assert report.modules[first].rule == f"^{first}$"
    assert report.modules[first].policy == Policy.parse("c=bf16")
    assert all(m.rule is None for path, m in report.modules.items() if path != first)


@pytest.mark.parametrize("api", APIS)
def test_bad_inputs_raise_clear_errors(api):
    case = build(api, "mlp")
    with pytest.raises(ValueError, match="preset"):
        with_policy(case.model, "bf16_mixed")
    with pytest.raises(ValueError, match="FP8 recipe"):
        with_policy(case.model, "p=f32,c=e4m3")
    with pytest.raises(ValueError, match="Allowed"):
        with_policy(case.model, "p=f32,c=bf17")
    wrapped = with_policy(case.model, "fp32")
    with pytest.raises(ValueError, match="already has a policy"):
        with_policy(wrapped, "fp32")
    with pytest.raises(TypeError, match="strict"):
        with_policy(case.model, "fp32", strict="yes")
    with pytest.raises(TypeError, match="instantiate"):
        with_policy(type(case.model), "fp32")


def test_plain_functions_have_no_module_paths():
    with pytest.raises(TypeError, match="plain function"):
        module_paths(lambda x: x)


@pytest.mark.parametrize("obj", [object(), {"params": {}}, None, 3])
def test_non_flax_objects_are_rejected(obj):
    with pytest.raises(TypeError, match=r"flax\.linen\.Module or flax\.nnx\.Module"):
        with_policy(obj, "bf16-mixed")
    with pytest.raises(TypeError, match=r"flax\.linen\.Module or flax\.nnx\.Module"):
        module_paths(obj)
    with pytest.raises(TypeError, match=r"flax\.linen\.Module or flax\.nnx\.Module"):
        inspect_policy(obj)


@pytest.mark.parametrize("api", APIS)
def test_module_paths_are_the_natural_flax_paths(api):
    case = build(api, "lm_moe_tied")
    paths = module_paths(case.model, *case.inputs) if api == "linen" else module_paths(
        case.model)
    if api == "linen":
        expected = {"": "TransformerLM", "embed": "Embed", "Block_0/ln_1": "LayerNorm",
                    "Block_0/attn/query": "DenseGeneral", "Block_0/MoeBlock_0": "MoeBlock",
                    "Block_0/MoeBlock_0/router": "Dense", "ln_f": "RMSNorm"}
    else:
        expected = {"": "NnxTransformerLM", "embed": "Embed", "blocks/0/ln_1": "LayerNorm",
                    "blocks/0/attn/query": "LinearGeneral", "blocks/0/moe": "NnxMoeBlock",
                    "blocks/0/moe/router": "Linear", "ln_f": "RMSNorm"}
    for path, cls in expected.items():
        assert paths[path] == cls
    mlp = build(api, "mlp")
    mlp_paths = (module_paths(mlp.model, *mlp.inputs) if api == "linen"
                 else module_paths(mlp.model))
    assert ({"Dense_0", "Dense_1"} if api == "linen" else {"layers/0", "layers/1"}) <= set(
        mlp_paths)


def test_strict_promotion_is_really_on():
    """Guard: the unwrapped Flax layers raise under this suite's strict promotion."""
    import flax.linen as nn

    x = jnp.ones((2, 4), jnp.bfloat16)
    with pytest.raises(jax.dtypes.TypePromotionError):
        nn.LayerNorm().init(jax.random.key(0), x)
