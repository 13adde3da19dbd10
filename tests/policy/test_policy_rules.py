"""Policy, Rules and presets: parsing, defaults, validation, matching (no models traced)."""

import itertools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fmtkit.formats import get_format
from fmtkit.policy import Policy, Rules, describe_presets, get_preset, list_presets
from fmtkit.policy._plan import Plan
from fmtkit.policy._policy import as_rules

SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def test_defaults_follow_jmp():
    # jmp: params default f32, compute follows params, output follows compute; grad follows
    # compute (this project's addition).
    assert Policy() == Policy("float32", "float32", "float32", "float32")
    p = Policy(param_dtype="f32", compute_dtype="bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype, p.grad_dtype) == (
        "float32", "bfloat16", "bfloat16", "bfloat16")
    p = Policy.parse("c=f16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype, p.grad_dtype) == (
        "float32", "float16", "float16", "float16")
    p = Policy.parse("p=f16,c=bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == ("float16", "bfloat16", "bfloat16")
    p = Policy.parse("p=f32,c=bf16,o=f32")  # jmp's own example string
    assert (p.output_dtype, p.grad_dtype) == ("float32", "bfloat16")
    assert Policy.parse("bf16") == Policy("bf16", "bf16", "bf16", "bf16")
    assert Policy.parse("params=float32, compute=bfloat16, output=full, grad=half") == Policy(
        "float32", "bfloat16", "float32", "float16")


@pytest.mark.parametrize("dts", list(itertools.product(SHORT, repeat=4)))
def test_str_round_trips(dts):
    p = Policy(*dts)
    text = str(p)
    assert text == "p={},c={},o={},g={}".format(*(SHORT[d] for d in dts))
    assert Policy.parse(text) == p
    assert hash(Policy.parse(text)) == hash(p)


def test_accepts_format_names_aliases_and_dtypes():
    for value in ("fp32", "float32", "f32", "full", np.float32, jnp.float32,
                  get_format("float32"), np.dtype("float32")):
        assert Policy(value).param_dtype == "float32"
    for value in ("bf16", "bfloat16", jnp.bfloat16, ml_dtypes.bfloat16):
        assert Policy(compute_dtype=value).compute_dtype == "bfloat16"
    for value in ("f16", "fp16", "half", "float16", np.float16):
        assert Policy(grad_dtype=value).grad_dtype == "float16"


@pytest.mark.parametrize("bad", ["e4m3", "e5m2", "float8_e4m3fn", "fp4", "e8m0", "fp6_e2m3"])
def test_fp8_and_narrower_formats_point_to_fp8_recipes(bad):
    with pytest.raises(ValueError, match="FP8 recipe"):
        Policy(compute_dtype=bad)
    with pytest.raises(ValueError, match="compute_dtype"):
        Policy.parse(f"p=f32,c={bad}")
    with pytest.raises(ValueError, match="param_dtype"):
        Policy(param_dtype=bad)


@pytest.mark.parametrize("spec, match", [
    ("p=f32,c=f8", "Allowed: float32"),
    ("q=f32", "KEY=DTYPE"),
    ("p=f32,p=bf16", "given twice"),
    ("", "empty"),
    ("p=f32,c", "KEY=DTYPE"),
    ("int8", "Allowed"),
])
def test_parse_errors_name_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(spec)


def test_parse_rejects_non_strings_and_non_float_dtypes():
    with pytest.raises(TypeError, match="string"):
        Policy.parse(32)
    with pytest.raises(ValueError, match="Allowed"):
        Policy(param_dtype=np.int32)


def test_policy_is_a_static_argument():
    traces = []

    @jax.jit
    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    f = jax.jit(f.__wrapped__, static_argnums=1)
    x = jnp.ones(3, jnp.float32)
    assert f(x, Policy.parse("c=bf16")).dtype == jnp.bfloat16
    f(x + 1, Policy.parse("c=bf16"))
    assert len(traces) == 1


def test_cast_helpers_touch_only_floating_leaves():
    p = Policy.parse("p=f32,c=bf16,o=f16")
    tree = {"w": jnp.ones(2, jnp.float32), "i": jnp.arange(2), "b": jnp.array([True])}
    out = p.cast_to_compute(tree)
    assert out["w"].dtype == jnp.bfloat16
    assert out["i"].dtype == tree["i"].dtype and out["b"].dtype == jnp.bool_
    assert p.cast_to_output(tree)["w"].dtype == jnp.float16
    assert p.cast_to_param(out)["w"].dtype == jnp.float32


# --------------------------------------------------------------------------------- Rules


def test_first_match_wins_and_re_search_semantics():
    f32, bf16, f16 = Policy(), Policy.parse("c=bf16"), Policy.parse("c=f16")
    rules = Rules([("Dense_1$", f32), ("Dense", f16)], default=bf16)
    assert rules.resolve("Block_0/MlpBlock_0/Dense_1", ("Dense",)) == f32  # search, not match
    assert rules.resolve("Block_0/MlpBlock_0/Dense_0", ("Dense",)) == f16
    assert rules.resolve("Block_0/attn/query", ("DenseGeneral",)) == bf16  # default
    assert Rules([("Dense", f32)]).resolve("embed", ("Embed",)) is None  # untouched


def test_type_patterns_match_class_and_base_names():
    f32 = Policy()
    rules = Rules([("type:^LayerNorm$", f32)])
    assert rules.resolve("Block_0/foo", ("LayerNorm",)) == f32
    assert rules.resolve("x", ("MyNorm", "LayerNorm")) == f32  # a user subclass
    assert rules.resolve("LayerNorm", ("Dense",)) is None  # type: patterns ignore the path
    assert Rules([("LayerNorm", f32)]).resolve("x", ("LayerNorm",)) is None  # and vice versa


def test_rule_validation():
    with pytest.raises(ValueError, match="Invalid rule regex"):
        Rules([("(", "f32")])
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        Rules([("a", "f32", "extra")])
    with pytest.raises(TypeError, match="sequence of"):
        Rules("Dense")
    with pytest.raises(TypeError, match="Policy"):
        Rules([("a", 3)])

    class NotARecipe:
        def dot_general(self, *args):
            raise NotImplementedError

    with pytest.raises(TypeError, match="Fp8Recipe"):
        Rules([("Dense", NotARecipe())])
    with pytest.raises(ValueError, match="FP8 recipe"):
        Rules([("Dense", "c=e4m3")])
    with pytest.raises(ValueError, match="Unknown recipe 'fp9'; FP8 recipes: current"):
        Policy.parse("p=f32,c=bf16,fp8=fp9")


def test_unmatched_lists_patterns_that_match_nothing():
    rules = Rules([("Dense", "f32"), ("type:Norm$", "f32"), ("nothing_here", "f32")])
    mods = [("", ("Model",)), ("Dense_0", ("Dense",)), ("ln", ("LayerNorm",))]
    assert rules.unmatched(mods) == ["nothing_here"]


def test_plan_resolves_each_path_once():
    rules = Rules([("^dense$", "f32"), ("subtree:type:Router$", "c=f32"), ("typo", "f32")],
                  default="c=bf16")
    mods = {"": ("Model",), "dense": ("Dense",), "moe/router": ("TopRouter",),
            "moe/router/proj": ("Linear",), "mlp": ("Mlp",)}
    plan = Plan.of(rules, mods)
    assert Plan.of(rules, dict(mods)) is plan  # kept per (rules, modules)
    # The router's child matches by its ancestor's class (subtree:type:); mlp by no rule.
    assert dict(plan.matches) == {"": None, "dense": 0, "moe/router": 1,
                                  "moe/router/proj": 1, "mlp": None}
    assert plan.rule("moe/router/proj") == "subtree:type:Router$" and plan.rule("mlp") is None
    assert plan.policy("dense") == Policy.parse("f32")
    assert plan.resolve("mlp") == (Policy.parse("c=bf16"), False)
    assert plan.unmatched == ("typo",)
    # Code outside every module: the root's path without class names (what Rules.resolve says).
    assert plan.resolve("", ()) == (rules.resolve("", ()), False)
    # A parameter belongs to the longest module path its keys start with.
    assert plan.owner(["params", "moe", "router", "proj", "kernel"]) == "moe/router/proj"
    assert plan.owner(["moe", "scale"]) == "" and plan.owner(["dense", "bias"]) == "dense"


def test_plan_reports_a_typo_but_not_the_presets_patterns():
    preset = get_preset("bf16-mixed")
    mods = {"": ("Model",), "Dense_0": ("Dense",)}
    with pytest.warns(UserWarning, match=r"(?s)\['Dens_0'\] match no module.*'Dense_0' \(Dense\)"):
        Plan.of(Rules([("Dens_0", "f32"), *preset.rules]), mods).report_unmatched(False)
    with pytest.raises(ValueError, match="Dens_0"):
        Plan.of(Rules([("Dens_0", "f32"), *preset.rules]), mods).report_unmatched(True)
    Plan.of(preset, mods).report_unmatched(True)  # norms and router absent: nothing to say
    off = Rules([("Dens_0", "f32")], check_unmatched=False)
    Plan.of(off, mods).report_unmatched(True)


# -------------------------------------------------------------------------------- presets

LINEN_NORMS = ["Block_0/LayerNorm_0", "Block_0/ln_1", "ln_f", "Block_3/ln_2", "norm",
               "final_norm", "layers_0/attention_norm", "Block_0/norm1"]
NNX_NORMS = ["blocks/0/ln_1", "blocks/11/ln_2", "ln_f", "layers/2/ffn_norm", "model/norm"]
ROUTERS = ["Block_0/MoeBlock_0/router", "blocks/0/moe/router", "layers/1/moe/gate"]
HEADS = ["head", "lm_head", "decoder/logits"]
OTHERS = ["Block_0/MlpBlock_0/Dense_1", "blocks/0/mlp/linear1", "Block_0/attn/query",
          "blocks/0/attn/out", "embed", "pos_embed", "Block_0/MoeBlock_0", "blocks/0/moe",
          "Block_0/normalize_inputs", "Block_0/headless"]


def test_presets_are_listed_and_described():
    names = list_presets()
    assert set(names) >= {"fp32", "bf16-mixed", "fp16-mixed", "pure-bf16"}
    text = describe_presets()
    for name in names:
        assert name in text
    with pytest.raises(ValueError, match="bf16-mixed"):
        get_preset("bf16_mixed")


@pytest.mark.parametrize("half", ["bf16-mixed", "fp16-mixed"])
def test_mixed_presets_keep_norms_router_head_and_root_where_the_seeds_say(half):
    rules = get_preset(half)
    hdt = "bfloat16" if half == "bf16-mixed" else "float16"
    for path in LINEN_NORMS + NNX_NORMS:
        p = rules.resolve(path, ("Whatever",))
        assert (p.compute_dtype, p.output_dtype) == ("float32", hdt), path
    for cls in ("LayerNorm", "RMSNorm", "GroupNorm"):  # by class, whatever the name
        assert rules.resolve("Block_0/pre", (cls,)).compute_dtype == "float32"
    for path in ROUTERS:
        p = rules.resolve(path, ("Dense",))
        assert (p.compute_dtype, p.output_dtype) == ("float32", "float32"), path
    # The head is found by its role (the matmul producing the outputs), not by a name: a
    # module called "head" is an ordinary module to the path rules.
    for path in HEADS + OTHERS:
        p = rules.resolve(path, ("Dense", "MultiHeadDotProductAttention"))
        assert (p.param_dtype, p.compute_dtype, p.output_dtype) == ("float32", hdt, hdt), path
    assert (rules.head.compute_dtype, rules.head.output_dtype, rules.head.fp8) == (
        hdt, "float32", None)
    assert rules.output_dtype == "float32"


def test_fp32_and_pure_bf16_presets():
    assert get_preset("fp32").resolve("anything", ("LayerNorm",)) == Policy()
    p = get_preset("pure-bf16").resolve("Block_0/ln_1", ("LayerNorm",))
    assert p == Policy.parse("bf16")


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "float16", "fp16", "f32", "half", "full"])
def test_bare_dtype_names_are_not_policies(name):
    with pytest.raises(ValueError, match=r"bf16-mixed.*Policy\.parse\('p=" ):
        as_rules(name)
    assert Policy.parse(name).compute_dtype == Policy.parse(name).param_dtype  # still parses


def test_head_rule_refuses_fp8():
    with pytest.raises(ValueError, match="head"):
        Rules((), head="p=f32,c=bf16,fp8=current")


def test_as_rules_normalizes_inputs():
    assert as_rules("bf16-mixed") is get_preset("bf16-mixed")
    assert as_rules("p=f32,c=bf16").default == Policy.parse("c=bf16")
    assert as_rules(Policy()).default == Policy()
    assert as_rules([("Dense", "f32")]).default is None
    with pytest.raises(ValueError, match=re.escape("Did you mean 'bf16-mixed'? Presets: fp32")):
        as_rules("bf17-mixed")
    with pytest.raises(ValueError, match=re.escape("preset (fp32")):
        as_rules("p=f32,q=bf16")
    with pytest.raises(TypeError, match="policy_or_rules"):
        as_rules(3.0)
