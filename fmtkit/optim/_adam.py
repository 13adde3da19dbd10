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

With round-to-nearest, a bf16 ``nu`` stops decaying: ``b2 = 0.999`` changes it by 0.1%, less
than half a bf16 ulp (2^-9 ≈ 0.2%), so ``store(0.999 v) == v``. ``rounding="stochastic"``
keeps the decay in expectation.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
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


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``.

    Attributes:
      count: int32 step count.
      mu, nu: the moments, in the parameters' tree structure; each leaf an array of the
        storage dtype, or a ``ScaledArray`` (values + f32 scales) with a scaling recipe.
      seed: int32 seed of stochastic rounding, or ``None`` for round-to-nearest.
    """

    count: jax.Array
    mu: Any
    nu: Any
    seed: jax.Array | None


class _Storage(NamedTuple):
    fmt: Format | None  # None: the parameter's dtype
    recipe: Any


def _storage(dtype: Any, recipe: Any, name: str) -> _Storage:
    fmt = None if dtype is None else get_format(dtype)
    if recipe is not None and not isinstance(recipe, _RECIPES):
        raise TypeError(f"{name}_scaling must be None, TensorScaling, AxisScaling or "
                        f"BlockScaling, got {recipe!r}.")
    if fmt is not None and fmt.bits <= 8 and recipe is None:
        recipe = TensorScaling()  # FP8 storage without a scale would underflow (MS-AMP)
    if recipe is not None and fmt is None:
        raise ValueError(f"{name}_scaling needs an explicit {name}_dtype.")
    if fmt is not None and not fmt.signed:
        raise ValueError(f"{name}_dtype={fmt.name} cannot store signed values.")
    return _Storage(fmt, recipe)


def _load(x: Any) -> jax.Array:
    if isinstance(x, ScaledArray):
        return dequantize(x, F32)
    return x.astype(F32)


def _store(x: jax.Array, like: jax.Array, st: _Storage, key: jax.Array | None,
           path: str) -> Any:
    fmt = st.fmt or get_format(like.dtype)
    rounding = "nearest" if key is None else "stochastic"
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


def _check_decay(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}.")
    return v


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
      b1, b2: moment decay rates, in [0, 1) (Kingma & Ba 2015 defaults 0.9, 0.999).
      eps, eps_root: as in ``optax.scale_by_adam``.
      mu_dtype, nu_dtype: storage formats of the first and second moments (any
        ``fmtkit.get_format`` name or dtype: "f32", "bf16", "fp16", "e4m3", "e5m2", ...);
        ``None`` stores each moment in its parameter's dtype (optax's default).
      mu_scaling, nu_scaling: ``TensorScaling()``, ``AxisScaling(...)`` or
        ``BlockScaling(...)`` to store ``values`` + f32 scales (``fmtkit.quantize``);
        formats of 8 bits or fewer default to ``TensorScaling()``.
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
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}.")
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
        bc1 = 1.0 - jnp.float32(b1) ** count.astype(F32)
        bc2 = 1.0 - jnp.float32(b2) ** count.astype(F32)
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
         eps: float = 1e-8, eps_root: float = 0.0, **storage: Any
         ) -> optax.GradientTransformation:
    """``optax.adam`` with moment storage options (``scale_by_adam``'s keyword arguments).

    ``learning_rate`` stays positional, as in ``optax.adam``; every other argument is
    keyword-only.

    Example:
      >>> opt = adam(1e-3, mu_dtype="bf16", nu_dtype="bf16", rounding="stochastic")
      >>> _ = opt.init(jnp.zeros(3))
    """
    return optax.chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, **storage),
                       optax.scale_by_learning_rate(learning_rate))


def adamw(learning_rate: optax.ScalarOrSchedule, *, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 1e-4,
          mask: Any = None, **storage: Any) -> optax.GradientTransformation:
    """``optax.adamw`` (decoupled weight decay, Loshchilov & Hutter 2019; optax's default
    ``weight_decay=1e-4``) with moment storage options (``scale_by_adam``'s keywords).
    ``learning_rate`` stays positional, as in ``optax.adamw``; the rest is keyword-only.

    Example:
      >>> opt = adamw(1e-3, mu_dtype="e4m3", nu_dtype="fp16", nu_scaling=TensorScaling())
      >>> _ = opt.init({"w": jnp.zeros((2, 2))})
    """
    return optax.chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, **storage),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
