"""Adam / AdamW with the moments stored in bf16, fp16 or FP8 (with scales), computed in f32.

optax's Adam has ``mu_dtype`` but no ``nu_dtype`` (optax #1552). Here each moment has a
storage format and an optional scaling recipe; every step dequantizes to f32, runs optax's
Adam arithmetic, and stores the new moments back:

    g = f32(g);  m = f32(mu);  v = f32(nu)
    m = (1 - b1) g + b1 m;     v = (1 - b2) g² + b2 v          (optax.tree.update_moment*)
    t = count + 1
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t) + eps_root) + eps)
    mu = store(m);  nu = store(v)                              (the update uses f32 m, v)

``store`` rounds to the storage format (nearest-even, or stochastic), or with a scaling
recipe quantizes (``fmtkit.scaling.quantize``: ``x ≈ values * scale``, f32 scales per tensor
or per block). MS-AMP's O2 recipe (Peng et al. 2023, "FP8-LM", section 3.2) keeps m in FP8
E4M3 and v in FP16, both with per-tensor scales: ``mu_dtype="e4m3", nu_dtype="fp16",
nu_scaling=TensorScaling()``.

Storage traps, and the defaults that avoid them:

* Range. ``nu`` holds squared gradients. fp16's smallest subnormal is 2^-24 ≈ 6e-8 = (2.4e-4)²,
  and the first step stores ``(1 - b2) g²``, which rounds to 0 for |g| < 5.5e-3: with
  gradients around 1e-4 an unscaled fp16 ``nu`` stays 0 and the updates are
  ``sqrt(bc2 / (1 - b2))`` times optax's (measured against ``optax.adam`` on a steady
  gradient of 1e-4: 3.2x at step 10, 9.7x at step 100, 31x at step 3000). So every ``nu``
  format with less exponent range than f32 (fp16, FP8, FP6, ...: fewer than 8 exponent bits)
  gets a per-tensor scale (``TensorScaling()``) by default, and every ``mu`` format of 8 bits
  or fewer (MS-AMP's choices); ``mu_scaling="none"`` / ``nu_scaling="none"`` opt out. With
  the scale, fp16 moments track optax within 1% over 3000 steps (what is left is the fp16
  ``mu``'s own nearest-rounding stall, below).
* Precision. A scale does not help bf16, whose range is f32's but whose ulp is 2^-7..2^-8
  of the value. With round-to-nearest, a bf16 ``nu`` stops *growing* once the step
  ``(1 - b2)(g² - v)`` is below half an ulp of ``v`` (2^-9..2^-8 of v), i.e. at some ``v``
  between ``g² / (1 + 2^-8 / (1 - b2))`` = g²/4.9 and ``g² / (1 + 2^-9 / (1 - b2))`` =
  g²/2.95, while f32 Adam's ``v`` keeps growing to g² (a bf16 ``mu`` stalls the same way,
  within 2^-8 / (1 - b1) ≈ 4% of g): on a steady gradient the updates come out
  ``sqrt(v_f32 / v_bf16)`` times
  optax's, 1.5x at step 1000 and 1.85x at step 3000 (measured; bounds [1.37, 1.76] and
  [1.67, 2.16] from the stall interval). Noisy gradients keep kicking ``v`` and hide most of
  it (1.05x at 50% noise). It also stops *decaying*: ``b2 = 0.999`` changes ``v`` by 0.1%,
  less than half a bf16 ulp, so ``store(0.999 v) == v``. Remedy: ``rounding="stochastic"``
  (unbiased, so ``v`` grows and decays in expectation: within 0.1% of optax on average over
  3000 steps), or an f32 ``nu`` (``nu_dtype=None`` with f32 parameters).
"""

from __future__ import annotations

import numbers
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fmtkit.casting import cast
from fmtkit.formats import Format, get_format
from fmtkit.optim._common import (
    F32,
    check_float_leaves,
    check_seed,
    increment,
    leaf_keys,
    step_key,
)
from fmtkit.scaling import (
    AxisScaling,
    BlockScaling,
    ScaledArray,
    TensorScaling,
    compute_scale,
    dequantize,
    quantize,
)

__all__ = ["ScaleByAdamState", "adam", "adamw", "scale_by_adam"]

_RECIPES = (TensorScaling, AxisScaling, BlockScaling)
_ROUNDINGS = ("nearest", "stochastic")
_F32_EXPONENT_BITS = 8  # nu formats with fewer exponent bits than f32 get a scale by default


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``.

    Attributes:
      count: int32 step count.
      mu: the first moment, in the parameters' tree structure; each leaf an array of the
        storage dtype, or a ``ScaledArray`` (values + f32 scales) with a scaling recipe.
      nu: the second moment, stored as ``mu`` is.
      seed: int32 seed of stochastic rounding, or ``None`` for round-to-nearest.
    """

    count: jax.Array
    mu: Any
    nu: Any
    seed: jax.Array | None


class _Storage(NamedTuple):
    fmt: Format | None  # None: the parameter's dtype
    recipe: Any
    auto: str | None = None  # "mu" / "nu": the default scaling rule applies per parameter


def _needs_scale(fmt: Format, name: str) -> bool:
    """The default: FP8 storage without a scale would underflow (MS-AMP); so would squared
    gradients in any format with less range than f32 (fp16: see the module docstring)."""
    return fmt.bits <= 8 or (name == "nu" and fmt.exponent_bits < _F32_EXPONENT_BITS)


def _storage(dtype: Any, recipe: Any, name: str) -> _Storage:
    fmt = None if dtype is None else get_format(dtype)
    unscaled = isinstance(recipe, str) and recipe == "none"
    if unscaled:
        if fmt is None:
            raise ValueError(f"{name}_scaling='none' needs an explicit {name}_dtype.")
        recipe = None
    if recipe is not None and not isinstance(recipe, _RECIPES):
        raise TypeError(f"{name}_scaling must be None (the default for {name}_dtype), 'none', "
                        f"TensorScaling, AxisScaling or BlockScaling, got {recipe!r}.")
    if fmt is not None and recipe is None and not unscaled and _needs_scale(fmt, name):
        recipe = TensorScaling()
    if recipe is not None and fmt is None:
        raise ValueError(f"{name}_scaling needs an explicit {name}_dtype.")
    if fmt is not None and not fmt.signed:
        raise ValueError(f"{name}_dtype={fmt.name} cannot store signed values.")
    # in the parameters' dtype (dtype None), the same default applies per parameter
    return _Storage(fmt, recipe, name if fmt is None and recipe is None else None)


def _load(x: Any) -> jax.Array:
    if isinstance(x, ScaledArray):
        return dequantize(x, F32)
    return x.astype(F32)


def _store(x: jax.Array, like: jax.Array, st: _Storage, key: jax.Array | None,
           path: str) -> Any:
    fmt = st.fmt or get_format(like.dtype)
    rounding = "nearest" if key is None else "stochastic"
    if st.recipe is None and st.auto is not None and _needs_scale(fmt, st.auto):
        st = st._replace(recipe=TensorScaling())
    if st.recipe is None:
        return cast(x, fmt, rounding=rounding, key=key)
    try:
        if key is None:
            return quantize(x, fmt, st.recipe)
        scale = compute_scale(x, fmt, st.recipe)
        full = ScaledArray(x, scale, fmt, st.recipe).expanded_scale()
        v = jnp.clip(x / full, -fmt.max, fmt.max)
        return ScaledArray(cast(v, fmt, rounding="stochastic", key=key, overflow="saturate"),
                           scale, fmt, st.recipe)
    except ValueError as e:
        raise ValueError(f"Adam moment of the parameter at {path}: {e}") from e


def _concrete(value: Any) -> float | None:
    """``float(value)``, or None for a traced value (``optax.inject_hyperparams`` passes its
    hyperparameters as arrays, traced under ``jit``: those are validated at ``init``)."""
    try:
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return None


def _hyper(value: Any, name: str) -> Any:
    """A numeric hyperparameter: a Python number stays one (weakly typed); an array (from
    ``optax.inject_hyperparams``, in the parameters' dtype) becomes f32, the arithmetic's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    if isinstance(value, numbers.Real):
        return float(value)
    if jnp.shape(value) != ():
        raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(value)}.")
    return jnp.asarray(value, F32)


def _check_decay(value: Any, name: str) -> Any:
    dtype = getattr(value, "dtype", None)
    value = _hyper(value, name)
    v = _concrete(value)
    if v is not None and not 0.0 <= v < 1.0:
        hint = ""
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and (
                jnp.finfo(dtype).bits < 32):
            hint = (f" It arrived as {jnp.dtype(dtype).name}: optax.inject_hyperparams keeps "
                    "hyperparameters in the parameters' dtype unless told otherwise, and "
                    "0.999 rounds to 1 in bfloat16; pass hyperparam_dtype=jnp.float32.")
        raise ValueError(f"{name} must be in [0, 1), got {value!r}.{hint}")
    return value


def scale_by_adam(
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: jax.typing.DTypeLike | str | None = None,
    nu_dtype: jax.typing.DTypeLike | str | None = None,
    mu_scaling: Any = None,
    nu_scaling: Any = None,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    seed: int = 0,
) -> optax.GradientTransformation:
    """Adam's scaling (optax ``scale_by_adam`` arithmetic in f32) with chosen moment storage.

    Args:
      b1: the first moment's decay rate, in [0, 1) (Kingma & Ba 2015 default 0.9).
      b2: the second moment's decay rate, in [0, 1) (Kingma & Ba 2015 default 0.999).
      eps: as in ``optax.scale_by_adam``. Numeric hyperparameters may be scalar
        arrays (``optax.inject_hyperparams``); traced ones are not validated.
      eps_root: as in ``optax.scale_by_adam``.
      mu_dtype: storage format of the first moment (any
        ``fmtkit.get_format`` name or dtype: "f32", "bf16", "fp16", "e4m3", "e5m2", ...);
        ``None`` stores each moment in its parameter's dtype (optax's default).
      nu_dtype: storage format of the second moment, as ``mu_dtype``.
      mu_scaling: ``TensorScaling()``, ``AxisScaling(...)`` or
        ``BlockScaling(...)`` to store ``values`` + f32 scales (``fmtkit.quantize``), or
        "none" for plain storage. ``None`` (default): ``TensorScaling()`` for ``mu``
        formats of 8 bits or fewer and for ``nu`` formats with less exponent range than
        f32 (fp16, FP8: squared gradients underflow them, see the module docstring),
        plain storage otherwise; with ``*_dtype=None`` the rule applies to each
        parameter's dtype (fp16 parameters get a scaled ``nu``).
      nu_scaling: the second moment's scaling, as ``mu_scaling``.
      rounding: ``"nearest"`` or ``"stochastic"`` rounding of the stored moments.
      seed: seed of the stochastic rounding (with the step count: reproducible).

    Returns:
      An ``optax.GradientTransformation`` with ``ScaleByAdamState``; updates have the
      gradients' dtype.

    Raises:
      ValueError: a decay outside [0, 1), an unknown format or rounding, a block that does not
        divide a parameter's shape (at ``init``; the message names the parameter).
      TypeError: an unsupported scaling recipe, non-floating parameters.

    Example:
      >>> opt = scale_by_adam(mu_dtype="e4m3", nu_dtype="fp16", nu_scaling=TensorScaling())
      >>> state = opt.init({"w": jnp.zeros((4, 128))})
      >>> state.mu["w"].values.dtype, state.nu["w"].values.dtype
      (dtype(float8_e4m3fn), dtype('float16'))
    """
    b1 = _check_decay(b1, "b1")
    b2 = _check_decay(b2, "b2")
    eps, eps_root = _hyper(eps, "eps"), _hyper(eps_root, "eps_root")
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}.")
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jnp.integer):
        # optax.inject_hyperparams passes the seed as an int array (traced in update_fn,
        # which reads the seed from the state instead)
        if _concrete(seed) is not None:
            check_seed(int(seed))
    else:
        seed = check_seed(seed)
    mu_st = _storage(mu_dtype, mu_scaling, "mu")
    nu_st = _storage(nu_dtype, nu_scaling, "nu")

    def init_fn(params):
        check_float_leaves(params, "params")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        mu, nu = [], []
        for path, p in leaves:
            z = jnp.zeros(p.shape, F32)
            where = jax.tree_util.keystr(path)
            mu.append(_store(z, p, mu_st, None, where))
            nu.append(_store(z, p, nu_st, None, where))
        return ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=treedef.unflatten(mu), nu=treedef.unflatten(nu),
            seed=jnp.asarray(seed, jnp.int32) if rounding == "stochastic" else None)

    def update_fn(updates, state, params=None):
        g_leaves, treedef = jax.tree.flatten(updates)
        check_float_leaves(updates, "updates (gradients)")
        mu_l = treedef.flatten_up_to(state.mu)
        nu_l = treedef.flatten_up_to(state.nu)
        count = increment(state.count)
        bc1 = 1.0 - jnp.asarray(b1, F32) ** count.astype(F32)
        bc2 = 1.0 - jnp.asarray(b2, F32) ** count.astype(F32)
        if state.seed is None:
            keys: list[Any] = [None] * (2 * len(g_leaves))
        else:
            keys = leaf_keys(step_key(state.seed, count), 2 * len(g_leaves))
        out_u, out_mu, out_nu = [], [], []
        for i, (g, m, v) in enumerate(zip(g_leaves, mu_l, nu_l)):
            g32 = g.astype(F32)
            m32 = (1.0 - b1) * g32 + b1 * _load(m)
            v32 = (1.0 - b2) * (g32 * g32) + b2 * _load(v)
            u = (m32 / bc1) / (jnp.sqrt(v32 / bc2 + eps_root) + eps)
            out_u.append(u.astype(g.dtype))
            like = m.values if isinstance(m, ScaledArray) else m
            out_mu.append(_store(m32, like, mu_st, keys[2 * i], f"leaf {i}"))
            like = v.values if isinstance(v, ScaledArray) else v
            out_nu.append(_store(v32, like, nu_st, keys[2 * i + 1], f"leaf {i}"))
        return treedef.unflatten(out_u), ScaleByAdamState(
            count, treedef.unflatten(out_mu), treedef.unflatten(out_nu), state.seed)

    return optax.GradientTransformation(init_fn, update_fn)


def adam(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, eps_root: float = 0.0,
         mu_dtype: jax.typing.DTypeLike | str | None = None,
         nu_dtype: jax.typing.DTypeLike | str | None = None, mu_scaling: Any = None,
         nu_scaling: Any = None, rounding: Literal["nearest", "stochastic"] = "nearest",
         seed: int = 0) -> optax.GradientTransformation:
    """``optax.adam`` with moment storage options (``scale_by_adam``'s keyword arguments).

    ``learning_rate`` stays positional, as in ``optax.adam``; every other argument is
    keyword-only. Every parameter is explicit, so ``optax.inject_hyperparams(adam)``
    works (numeric ones become scalar arrays; ``learning_rate`` may be a schedule).

    Example:
      >>> opt = adam(1e-3, mu_dtype="bf16", nu_dtype="bf16", rounding="stochastic")
      >>> _ = opt.init(jnp.zeros(3))
    """
    return optax.chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                     mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                                     mu_scaling=mu_scaling, nu_scaling=nu_scaling,
                                     rounding=rounding, seed=seed),
                       optax.scale_by_learning_rate(learning_rate))


def adamw(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 1e-4,
          mask: Any = None, mu_dtype: jax.typing.DTypeLike | str | None = None,
          nu_dtype: jax.typing.DTypeLike | str | None = None, mu_scaling: Any = None,
          nu_scaling: Any = None, rounding: Literal["nearest", "stochastic"] = "nearest",
          seed: int = 0) -> optax.GradientTransformation:
    """``optax.adamw`` (decoupled weight decay, Loshchilov & Hutter 2019; optax's default
    ``weight_decay=1e-4``) with moment storage options (``scale_by_adam``'s keywords).
    ``learning_rate`` stays positional, as in ``optax.adamw``; the rest is keyword-only.
    Every parameter is explicit, so ``optax.inject_hyperparams(adamw)(learning_rate=1e-3)``
    works.

    Example:
      >>> opt = adamw(1e-3, mu_dtype="e4m3", nu_dtype="fp16", nu_scaling=TensorScaling())
      >>> _ = opt.init({"w": jnp.zeros((2, 2))})
    """
    return optax.chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                     mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                                     mu_scaling=mu_scaling, nu_scaling=nu_scaling,
                                     rounding=rounding, seed=seed),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
