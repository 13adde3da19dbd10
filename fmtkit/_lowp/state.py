"""Delayed-scaling state: one amax history per operand role (x, w, grad) of one dot.

The state of one scaled dot is a ``fmtkit.DelayedScalingState`` (the one state type of every
delayed recipe) with ``amax_history`` f32[3, history] and ``count`` None (``fp8.Fp8DotState``
was its earlier, deprecated name here).

Rows are x, w, grad; column 0 is the newest entry. While a row is all zeros (before the first
step) the current amax is used instead (``fmtkit.scaling.delayed_amax``, the bootstrap that
Flax's recipe lacks). ``count`` stays None so that ``jax.grad`` can take the whole state.

The gradient amax is only known in the backward pass, so the dot reports all three observed
amaxes as the *cotangent* of ``amax_history`` (column 0; zeros elsewhere): differentiate the
loss with respect to the state too and pass that "gradient" to ``update_state``. Never hand
it to an optimizer. A stack of L scanned layers keeps ``[L, 3, history]`` (one history per
layer); each layer's dot sees its own ``[3, history]`` slice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fmtkit._lowp.recipes import Fp8Recipe, get_recipe
from fmtkit.scaling import DelayedScalingState, record_amax


def init_state(recipe: str | Fp8Recipe = "delayed") -> DelayedScalingState:
    """A fresh (empty-history) state for one dot: ``amax_history`` f32[3, recipe.history].

    ``recipe`` is any name of ``get_recipe`` (FP8 or FP4) or a recipe; only delayed recipes
    read the state.

    Example:
      >>> init_state("delayed").amax_history.shape    # x, w, grad rows; history 1024
      (3, 1024)
    """
    recipe = get_recipe(recipe)
    return DelayedScalingState(jnp.zeros((3, recipe.history), jnp.float32))


def combine_observations(a: Any, b: Any) -> Any:
    """Combines two micro-batches' observed-amax trees with ``max`` (gradient accumulation).

    Example:
      >>> a, b = {"Dense_0": jnp.array([1.0, 3.0])}, {"Dense_0": jnp.array([2.0, 0.0])}
      >>> combine_observations(a, b)["Dense_0"].tolist()
      [2.0, 3.0]
    """
    return jax.tree.map(jnp.maximum, a, b)


def _describe(tree: Any) -> str:
    """A short description of a pytree: its structure with each leaf as dtype[shape]."""
    def leaf(x):
        return f"{jnp.result_type(x).name}{list(jnp.shape(x))}" if hasattr(x, "shape") else (
            type(x).__name__)
    text = str(jax.tree.unflatten(jax.tree.structure(tree),
                                  [leaf(x) for x in jax.tree.leaves(tree)]))
    return text if len(text) <= 300 else text[:300] + "..."


# Why observed can be empty for existing histories: the states did not exist yet when the loss
# was differentiated (an NNX model creates them at its first call).
_CREATED_INSIDE = (
    " observed holds no observation: the states were created inside the differentiated "
    "function, so nothing differentiated them. An NNX model creates its delayed-FP8 states "
    "(fmtkit.policy.DelayedScalingVariable) at its first call: call the model once outside "
    "the training step (e.g. model(x) before the loop), then the step differentiates them.")


def update_state(state: Any, observed: Any) -> Any:
    """Records observed amaxes into every amax history of a tree (one step).

    Args:
      state: a pytree of amax histories: ``DelayedScalingState`` nodes, or a Flax
        ``"fp8_state"`` collection; every leaf f32[..., 3, history] (``[3, H]`` for one
        dot, ``[L, 3, H]`` for a scanned stack of L layers).
      observed: the gradient of the loss with respect to ``state`` (same structure): each
        dot's observed x / w / grad amaxes sit in column 0 of its history. Combine
        micro-batches with ``combine_observations`` (max) before calling this once per step.

    Returns:
      The state with each history rolled by one along its last axis and the observations
      recorded (``fmtkit.scaling.record_amax``, the rule ``DelayedScaling.update`` uses); a
      dot (per layer, for a stack) whose three observations are not all finite keeps its
      history unchanged.

    Raises:
      ValueError: a leaf that is not [..., 3, history], shapes of state and observed differ,
        or ``observed`` is not a tree of the same structure as ``state`` (an empty one: the
        states were created inside the differentiated step, as an NNX model's first call
        there does; the message says to call the model once outside the step).

    Example:
      >>> from fmtkit.scaling import DelayedScalingState
      >>> state = init_state("delayed")                   # one dot, empty histories
      >>> seen = jnp.zeros((3, 1024)).at[:, 0].set(jnp.array([2.0, 0.5, 0.25]))
      >>> state = update_state(state, DelayedScalingState(seen))   # observed: a gradient
      >>> state.amax_history[:, 0].tolist()               # newest first: x, w, grad
      [2.0, 0.5, 0.25]
    """
    s_def, o_def = jax.tree.structure(state), jax.tree.structure(observed)
    if s_def != o_def:
        raise ValueError(
            "update_state(state, observed): observed must be a tree of the same structure as "
            "state, the gradient of the loss with respect to the state (e.g. "
            "jax.grad(loss, argnums=(0, 1))(params, state)[1], or the 'fp8_state' entry of "
            "linen's gradients), not a raw array or another tree. state is "
            f"{_describe(state)}; observed is {_describe(observed)}."
            + (_CREATED_INSIDE if jax.tree.leaves(state) and not jax.tree.leaves(observed)
               else ""))

    def upd(hist, obs):
        if hist is None:
            return None
        if hist.ndim < 2 or hist.shape[-2] != 3 or obs.shape != hist.shape:
            raise ValueError(
                f"update_state: every leaf must be an amax history f32[..., 3, history] with "
                f"its observation of the same shape; got {hist.shape} and {obs.shape}.")
        return record_amax(hist, obs[..., 0], group_ndim=1)

    return jax.tree.map(upd, state, observed, is_leaf=lambda t: t is None)

