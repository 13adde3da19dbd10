"""A hook on the GEMMs a policy runs: ``intercept_gemms`` and the ``GemmSite`` it is given.

Under ``with intercept_gemms(hook):`` every matmul that a policied model, NNX model or
function runs under its rules (a ``dot_general`` or convolution in a module with a policy) is
handed to ``hook`` instead of being computed directly: ``hook(site, run, lhs, rhs)`` returns
the GEMM's result, normally by calling ``run(lhs, rhs, site.fp8)`` (what the policy would
have computed). ``lhs`` and ``rhs`` are the operands as the GEMM receives them (already in
the compute dtype, before any FP8 quantization); ``run(lhs, rhs, recipe)`` computes the GEMM
with another FP8 recipe, or with none (the compute dtype). ``fmtkit.debug`` builds its
statistics and overrides on this hook.

Without a hook nothing changes: the interpreter takes the same path as before, so the
lowered program is the same.

Each ``intercept_gemms`` block is part of ``jax.jit``'s cache key (a ``jax.make_user_context``
value, one per block): a function traced before the block (``jax.jit(f)``,
``jax.make_jaxpr(f)`` of the same function object) is traced again inside it, so the hook
sees every GEMM, and a trace made inside a block is not reused outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from fmtkit.policy._policy import Policy

__all__ = ["GemmSite", "intercept_gemms"]


@dataclasses.dataclass(frozen=True)
class GemmSite:
    """One GEMM of a policied call, as ``intercept_gemms`` hands it to its hook.

    Attributes:
      path: the module path of the module the GEMM is written in ("" for the root or a
        plain function).
      type_names: that module's class names (most derived first), for ``"type:"`` patterns.
      ancestors: the class names of the modules enclosing it (root first), for
        ``"subtree:type:"`` patterns.
      name: the GEMM's name within its module, ``"<primitive>_<i>"`` (``"dot_general_0"``,
        ``"conv_general_dilated_1"``), numbered in the order the interpreter first meets
        each GEMM of that module within one policied call.
      primitive: ``"dot_general"``, ``"conv_general_dilated"`` or ``"ragged_dot_general"``.
      policy: the policy the GEMM runs under (``Rules.head`` for the output head).
      fp8: the FP8/FP4 recipe the GEMM runs with, or None where it runs in the compute dtype
        (a policy without ``fp8``, the head, a matmul without a parameter operand).
      fp8_capable: whether ``run`` applies a recipe given to it (a ``dot_general`` with a
        parameter operand, not the head; a ``lax.ragged_dot`` with parameter experts, as
        ``fmtkit.fp8.ragged_dot``, FP8 recipes only); elsewhere it computes in the compute
        dtype.
      head: whether the GEMM is the model's output head.
      dimension_numbers: the GEMM's dimension numbers (``dot_general``'s; None for other
        primitives).
      in_loop: whether the GEMM runs inside a ``scan`` or ``while`` body (its operands are
        then one iteration's).
      loop_lengths: the trip counts of the loops around the GEMM, outermost first (``()``
        outside loops): a ``scan``'s length (``fori_loop`` with static bounds is a scan), or
        None for a ``while`` loop.
      loop_index: the current iteration of each of those loops (int32 scalars traced in the
        loop bodies, in the original order of the iterations also for a reverse scan; None
        for a ``while`` loop). A hook that keeps per-iteration results writes iteration
        ``loop_index`` of arrays shaped ``loop_lengths``.
      fp8_history: the amax history a delayed recipe quantizes this GEMM with
        (f32[*batch, 3, history], rows x, w, grad; see ``fmtkit.fp8``), or None.
      call: a number that identifies the policied call (one model or function call) that
        runs the GEMM: two calls of the same model under one hook give the same names
        with different ``call`` numbers.
      weight_operand: which operand is the GEMM's weight (the other is its activation): 0
        (``lhs``) where only the left operand is a view of a parameter (Equinox's
        ``weight @ x``, a function's ``params["w"] @ x``), else 1 (``rhs``, as in
        ``x @ w``, and for GEMMs of two activations or two parameters). An FP8 recipe gives
        this operand its weight format, tiling and amax-history row, and its gradient is
        the weight gradient (wgrad), whichever side it is written on.
      group_sizes: for a grouped GEMM of ``lax.ragged_dot``'s form (``lhs [M, K]`` sorted
        by group, ``rhs [G, K, N]``), its group sizes (int32[G], traced); else None.
      in_custom_rule: whether the GEMM runs in the primal body of a ``jax.custom_jvp`` or
        the forward rule of a ``jax.custom_vjp``: its derivative is the user's rule, so a
        hook's own VJP around it never runs. (The GEMMs of those derivative rules are not
        handed to the hook: they are met only under differentiation.)
    """

    path: str
    type_names: tuple[str, ...]
    ancestors: tuple[tuple[str, ...], ...]
    name: str
    primitive: str
    policy: Policy
    fp8: Any
    fp8_capable: bool
    head: bool
    dimension_numbers: Any
    in_loop: bool
    call: int
    fp8_history: Any = None
    loop_lengths: tuple[int | None, ...] = ()
    loop_index: tuple[Any, ...] = ()
    weight_operand: int = 1
    in_custom_rule: bool = False
    group_sizes: Any = None


Hook = Callable[[GemmSite, Callable[..., Any], Any, Any], Any]


class _Active(threading.local):
    hook: Hook | None = None


_ACTIVE = _Active()
# Numbers of policied calls (interpreters), for GemmSite.call.
CALLS = itertools.count()
# Which intercept_gemms block is active (None: none), in jax.jit's cache key: a trace of the
# same function outside the block, or in another block, is not reused (the hook would be
# skipped, or applied where it is not active). One number per block, never reused, so a
# hook that is garbage-collected cannot alias a later one.
_BLOCK = jax.make_user_context(default_value=None)
_BLOCKS = itertools.count()


@contextlib.contextmanager
def intercept_gemms(hook: Hook) -> Iterator[None]:
    """Hands every GEMM a policied call runs to ``hook`` (see the module docstring).

    Entered inside the function being traced (the loss a ``jax.grad`` differentiates, the
    step ``jax.jit`` compiles): the hook acts while the policied model is interpreted, and
    what it computes is part of that trace. Hooks do not nest: an inner one replaces the
    outer one until it exits. A function that ``jax.jit`` or ``jax.make_jaxpr`` traced
    before is traced again in the block (each block is part of ``jax.jit``'s cache key), so
    the hook is never skipped by a cached trace; the price is one trace (and compilation)
    per block of each jitted function called in it.

    Args:
      hook: ``hook(site: GemmSite, run, lhs, rhs) -> result``, where ``run(lhs, rhs,
        recipe)`` computes the GEMM as the policy would, with ``recipe`` (an
        ``fmtkit.fp8.Fp8Recipe`` or None) in place of ``site.fp8``.

    Raises:
      TypeError: ``hook`` is not callable.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fmtkit.policy import with_policy
      >>> seen = []
      >>> def hook(site, run, lhs, rhs):
      ...     seen.append((site.path, site.name, str(lhs.dtype)))
      ...     return run(lhs, rhs, site.fp8)
      >>> f = with_policy(lambda w, x: x @ w, "bf16-mixed")
      >>> with intercept_gemms(hook):
      ...     _ = jax.jit(f)(jnp.ones((3, 2)), jnp.ones((4, 3)))
      >>> seen
      [('', 'dot_general_0', 'bfloat16')]
    """
    if not callable(hook):
        raise TypeError(f"hook must be callable, got {type(hook).__name__}.")
    prev = _ACTIVE.hook
    _ACTIVE.hook = hook
    try:
        with _BLOCK(next(_BLOCKS)):
            yield
    finally:
        _ACTIVE.hook = prev


def active_hook() -> Hook | None:
    """The hook of the innermost ``intercept_gemms``, or None."""
    return _ACTIVE.hook
