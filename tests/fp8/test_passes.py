"""Passes over HBM that quantization adds to one linear layer's three GEMMs, per recipe,
counted in the program fmtkit emits for a GPU (lowered for CUDA, no GPU needed).

Each quantization of a tensor in one layout reads it for its amax (one reduction: over the
whole tensor, per row or per block) and reads it again to write its FP8 values (one convert).
The minimum a recipe allows: a tensor whose tile is the same along both axes (per tensor,
128x128 blocks) is quantized once and its FP8 values serve both GEMMs that read it; a tile
that follows the contraction (rows, 1x128, MX blocks) is quantized once per layout its GEMMs
contract. So x [M, K], w [K, N] and the gradient g [M, N] are quantized:

    recipe                 x   w   g
    current, delayed       1   1   1
    blockwise              2   1   2     (1x128 along K and along M; 128x128 w)
    rowwise, mxfp8         2   2   2

A delayed recipe also reads each tensor for the amax its history records (fused by XLA with
the cast: the scale comes from the history, not from that amax), and once more, under a
``lax.cond``, only on the step that bootstraps an empty history.

The same minimum is then counted in the jaxpr of a train step (backend-independent), through
``dot_general_fn`` and under the ``fp8-*`` presets, and what XLA makes of a weight that a
step reads more than once (compiled for the CPU).
"""

import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from test_cublaslt import DN, _lowered_for_h200

from fmtkit import DelayedScalingState, fp8, with_policy
from fmtkit._switches import flipped

M, K, N = 256, 512, 384  # distinct sizes: each tensor is known by its element count
ROLE = {M * K: "x", K * N: "w", M * N: "g"}
ARGS = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, K), (K, N), (M, N)))
MINIMUM = {"current": (1, 1, 1), "delayed": (1, 1, 1), "blockwise": (2, 1, 2),
           "rowwise": (2, 2, 2), "mxfp8": (2, 2, 2)}


def _step(recipe):
    """y, dx, dw of ``x · w`` and, for a delayed recipe, the amaxes its history observes
    (the cotangent of the state, as a train step takes it), from bf16 x, w, cotangent."""
    dg = fp8.dot_general_fn(recipe)

    def f(x, w, g):
        if not dg.recipe.delayed:
            y, vjp = jax.vjp(lambda a, b: dg(a, b, DN), x, w)
            return (y, *vjp(g))
        hist = fp8.init_state(dg.recipe).amax_history
        y, vjp = jax.vjp(lambda a, b, h: dg(a, b, DN, fp8_state=DelayedScalingState(h)),
                         x, w, hist)
        return (y, *vjp(g))

    return f


def _size(dims: str) -> int:
    n = 1
    for d in dims.split("x"):
        n *= int(d)
    return n


def quantization_passes(text: str) -> dict[str, dict[str, int]]:
    """Per tensor ("x", "w", "g"): the FP8 converts (casts) and the max-reductions (amaxes,
    ``bootstrap`` excluded: those inside ``stablehlo.case`` branches) of a lowered module."""
    count = {r: {"casts": 0, "amaxes": 0, "bootstrap_amaxes": 0} for r in ("x", "w", "g")}
    depth = 0  # inside a stablehlo.case region
    for line in text.splitlines():
        if "stablehlo.case" in line:
            depth += 1
        m = re.search(r"stablehlo\.convert %\S+ : \(tensor<([\dx]+)x(?:f32|bf16)>\) -> "
                      r"tensor<[\dx]+xf8", line)
        if m and _size(m.group(1)) in ROLE:
            count[ROLE[_size(m.group(1))]]["casts"] += 1
        m = re.search(r"reduce.*stablehlo\.maximum.*: \(tensor<([\dx]+)x(?:f32|bf16)>", line)
        if m and _size(m.group(1)) in ROLE:
            key = "bootstrap_amaxes" if depth else "amaxes"
            count[ROLE[_size(m.group(1))]][key] += 1
        if depth and re.match(r"^\s*}\) : \(", line):  # the case op's closing line
            depth -= 1
    return count


@pytest.mark.parametrize("recipe", [  # per tensor in make test, the block recipes in test-all
    r if r in ("current", "delayed") else pytest.param(r, marks=pytest.mark.slow)
    for r in MINIMUM])
def test_each_tensor_is_quantized_once_per_layout(recipe):
    got = quantization_passes(_lowered_for_h200(_step(recipe), *ARGS))
    for role, want in zip("xwg", MINIMUM[recipe]):
        assert got[role]["casts"] == want, (role, got)
        # one amax per cast (its own scale), or, delayed, the history's observation
        assert got[role]["amaxes"] == want, (role, got)


def test_the_count_sees_a_second_quantization():
    """Negative control: the same weight in two dots is quantized twice, and counted so."""
    dg = fp8.dot_general_fn("current")
    x2 = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    text = _lowered_for_h200(lambda a, b, w: dg(a, w, DN) + dg(b, w, DN), x2, x2, ARGS[1])
    got = quantization_passes(text)
    assert got["w"]["casts"] == 2 and got["x"]["casts"] == 2


# The same count in the jaxpr of a train step (backend-independent: what every backend
# compiles, before XLA's fusion), over a two-layer MLP x -> gelu(x·w1) = a -> a·w2, its loss
# differentiated with respect to the weights and x (as a layer inside a stack is): each
# tensor is known by its element count, the activation a and its gradient g1 share one.
TM, TD, TH, TO = 256, 384, 512, 640
T_ROLE = {TM * TD: "x", TD * TH: "w1", TM * TH: "a+g1", TH * TO: "w2", TM * TO: "g2"}


def _train_minimum(recipe: str) -> dict[str, int]:
    """Per tensor of the MLP, the minimum number of quantizations (``MINIMUM``'s per-role
    counts: a is an activation like x, g1 and g2 gradients like g)."""
    qx, qw, qg = MINIMUM[recipe]
    return {"x": qx, "w1": qw, "a+g1": qx + qg, "w2": qw, "g2": qg}


def jaxpr_quantizations(jaxpr, count=None, in_cond=False) -> dict[str, dict[str, int]]:
    """Per tensor of ``T_ROLE``: its converts to an 8-bit float (casts) and its
    ``reduce_max`` (amaxes; ``bootstrap_amaxes``: those under a ``cond``, a delayed recipe's
    first step) in a jaxpr and every jaxpr its equations hold."""
    if count is None:
        count = {r: {"casts": 0, "amaxes": 0, "bootstrap_amaxes": 0} for r in T_ROLE.values()}
    for eqn in jaxpr.eqns:
        role = T_ROLE.get(math.prod(eqn.invars[0].aval.shape)) if eqn.invars else None
        if (role and eqn.primitive.name == "convert_element_type"
                and jnp.dtype(eqn.params["new_dtype"]).itemsize == 1):
            count[role]["casts"] += 1
        if role and eqn.primitive.name == "reduce_max":
            count[role]["bootstrap_amaxes" if in_cond else "amaxes"] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            jaxpr_quantizations(getattr(sub, "jaxpr", sub), count,
                                in_cond or eqn.primitive.name == "cond")
    return count


def _mlp_step(recipe: str):
    """``value_and_grad`` of the MLP's loss through ``fmtkit.fp8.dot_general_fn(recipe)``,
    with respect to the weights, x and (delayed) the two layers' amax histories; and its
    arguments."""
    dg = fp8.dot_general_fn(recipe)
    delayed = dg.recipe.delayed
    dn = (((1,), (0,)), ((), ()))

    def loss(w, x, hist):
        kw = [{"fp8_state": DelayedScalingState(h)} if delayed else {} for h in hist]
        a = jax.nn.gelu(dg(x, w[0], dn, **kw[0]))
        return jnp.mean(jnp.square(dg(a, w[1], dn, **kw[1]).astype(jnp.float32)))

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = [(jax.random.normal(k1, (TD, TH)) / TD**0.5).astype(jnp.bfloat16),
         (jax.random.normal(k2, (TH, TO)) / TH**0.5).astype(jnp.bfloat16)]
    x = jax.random.normal(k3, (TM, TD), jnp.bfloat16)
    hist = [fp8.init_state(dg.recipe).amax_history] * 2 if delayed else [None, None]
    return jax.value_and_grad(loss, argnums=(0, 1, 2) if delayed else (0, 1)), (w, x, hist)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(MINIMUM))
def test_train_step_quantizes_each_tensor_once_per_layout(recipe):
    """In the jaxpr of a train step, each tensor is quantized the minimum number of times
    (one amax per cast; a delayed recipe's amax is its history's observation, and one more
    under ``cond`` for the bootstrap step)."""
    step, args = _mlp_step(recipe)
    got = jaxpr_quantizations(jax.make_jaxpr(step)(*args).jaxpr)
    delayed = fp8.RECIPES[recipe].delayed
    for role, want in _train_minimum(recipe).items():
        assert got[role] == {"casts": want, "amaxes": want,
                             "bootstrap_amaxes": want if delayed else 0}, (role, got)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise"])
def test_reusing_the_quantized_operands_is_exact_and_counted(recipe):
    """Negative control and exactness: quantizing x, w (and a per-tensor g) again for each
    backward GEMM, as the plainer form does, is seen by the count (more casts than the
    minimum) and gives bit-identical loss and gradients (the tile is the same along both
    axes: the same values and scales)."""
    step, args = _mlp_step(recipe)
    shipped = jax.jit(step)(*args)
    with flipped(reuse_quantized_operands=False):
        plain = jax.jit(step)(*args)
        got = jaxpr_quantizations(jax.make_jaxpr(step)(*args).jaxpr)
    minimum = _train_minimum(recipe)
    assert got["w1"]["casts"] == minimum["w1"] + 1 and got["w2"]["casts"] == minimum["w2"] + 1
    assert got["x"]["casts"] > minimum["x"] or recipe == "blockwise"  # (1x128 x: not reused)
    for a, b in zip(jax.tree.leaves(shipped), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise", "mxfp8"])
def test_preset_train_step_quantizes_each_tensor_once_per_layout(recipe):
    """The same minimum under ``with_policy(fn, "fp8-NAME")`` on a plain function of three
    dense layers (the third is the output head, which presets keep out of FP8: its input a2
    is not quantized, its cotangent g2 is, by the second layer's backward)."""
    tp = 128  # the head's width: T_ROLE's element counts stay distinct

    def mlp(params, x):
        a = jax.nn.gelu(x @ params["w1"])
        a = jax.nn.gelu(a @ params["w2"])
        return a @ params["w3"]

    f = with_policy(mlp, f"fp8-{recipe}")
    delayed = fp8.RECIPES[recipe].delayed
    ks = jax.random.split(jax.random.key(1), 4)
    params = {n: jax.random.normal(k, s) / s[0]**0.5 for n, k, s in
              zip(("w1", "w2", "w3"), ks, ((TD, TH), (TH, TO), (TO, tp)))}
    x = jax.random.normal(ks[3], (TM, TD))

    def loss(p, x, state):
        kw = {"fp8_state": state} if delayed else {}
        return jnp.mean(jnp.square(f(p, x, **kw).astype(jnp.float32)))

    state = f.init_fp8_state(params, x) if delayed else None
    step = jax.value_and_grad(loss, argnums=(0, 1, 2) if delayed else (0, 1))
    got = jaxpr_quantizations(jax.make_jaxpr(step)(params, x, state).jaxpr)
    # ("g2", [M, O], holds a2 too, the head's input: not quantized)
    for r, n in _train_minimum(recipe).items():
        assert got[r] == {"casts": n, "amaxes": n,
                          "bootstrap_amaxes": n if delayed else 0}, (r, got)


# What XLA makes of the jaxpr's count where one weight is read more than once in a step:
# compiled for the CPU here (XLA:GPU runs the same CSE and loop-invariant code motion passes,
# not checked here).
def _hlo_computations(text: str) -> dict[str, list[str]]:
    """The computations of a compiled HLO module, by name (the entry one: "ENTRY")."""
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%([\w.\-]+) ", line)
        if m:
            name = "ENTRY" if m.group(1) else m.group(2)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def _reachable(comps: dict[str, list[str]], root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", line)
    return seen


def _abs_of_size(lines: list[str], size: int) -> int:
    """How many ``abs`` (the first step of an amax) of ``size`` elements ``lines`` hold."""
    return sum(1 for line in lines for dims in re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} abs\(",
                                                          line)
               if math.prod(int(d) for d in dims.split(",")) == size)


def _weight_twice(recipe: str, same: bool):
    dg = fp8.dot_general_fn(recipe)

    def loss(w, v, x):
        a = dg(x, w, DN_KN) + dg(2 * x, w if same else v, DN_KN)
        return jnp.mean(jnp.square(a.astype(jnp.float32)))

    w = jnp.ones((TD, TH), jnp.bfloat16)
    return jax.value_and_grad(loss, argnums=(0, 1)), (w, 2 * w, jnp.ones((TM, TD), jnp.bfloat16))


DN_KN = (((1,), (0,)), ((), ()))  # x [M, K] · w [K, N]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_a_weight_read_by_two_dots_is_quantized_once_after_cse(recipe):
    """The jaxpr quantizes the weight once per dot; the compiled step computes its amax once
    (XLA's CSE merges the identical quantizations). Negative control: two different weights
    of that shape have two amaxes."""
    step, args = _weight_twice(recipe, same=True)
    got = jaxpr_quantizations(jax.make_jaxpr(step)(*args).jaxpr)
    assert got["w1"]["casts"] == 2 * MINIMUM[recipe][1]
    compiled = jax.jit(step).lower(*args).compile().as_text()
    assert _abs_of_size(compiled.splitlines(), TD * TH) == 1
    step, args = _weight_twice(recipe, same=False)
    compiled = jax.jit(step).lower(*args).compile().as_text()
    assert _abs_of_size(compiled.splitlines(), TD * TH) == 2


@pytest.mark.slow
def test_a_weight_read_in_each_micro_batch_is_quantized_before_the_loop():
    """Gradient accumulation in a ``lax.scan``: the weight's quantization is loop-invariant
    and XLA computes it once, before the loop. Negative control: a weight that changes with
    each micro-batch is quantized inside the loop, and counted there."""
    dg = fp8.dot_general_fn("current")

    def step(w, xs, invariant):
        def body(acc, x):
            def loss(w):
                v = w if invariant else w * (1 + 0 * x[0, 0])
                return jnp.mean(jnp.square(dg(x, v, DN_KN).astype(jnp.float32)))
            return acc + jax.grad(loss)(w).astype(jnp.float32), None
        return jax.lax.scan(body, jnp.zeros(w.shape), xs)[0]

    w, xs = jnp.ones((TD, TH), jnp.bfloat16), jnp.ones((4, TM, TD), jnp.bfloat16)
    for invariant in (True, False):
        comps = _hlo_computations(jax.jit(step, static_argnums=2).lower(w, xs, invariant)
                                  .compile().as_text())
        bodies = [n for line in comps["ENTRY"] for n in re.findall(r"body=%([\w.\-]+)", line)]
        assert len(bodies) == 1, bodies
        in_loop = sum(_abs_of_size(comps[c], TD * TH) for c in _reachable(comps, bodies[0]))
        total = sum(_abs_of_size(lines, TD * TH) for lines in comps.values())
        assert (in_loop, total) == ((0, 1) if invariant else (1, 1)), (invariant, in_loop, total)
