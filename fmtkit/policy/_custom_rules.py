"""Custom differentiation rules under the interpreter: ``jax.custom_jvp`` and
``jax.custom_vjp``.

A ``custom_jvp``'s primal body is interpreted; its rule, where the body holds a matmul, is
traced once with ``jax.jvp`` on the traced types and interpreted too (its matmuls on the
compute dtype); rules without a matmul (``jax.nn.relu``, ``softplus``) run as JAX wrote them
on the primals cast back to their traced dtypes. A ``custom_vjp``'s forward rule is
interpreted (a ``custom_vjp`` it calls runs its primal body, which ends the recursion of a
forward rule written as JAX's documentation writes it) and its backward rule is traced on
residuals and cotangents in their traced dtypes and interpreted. A rule that cannot be traced
on its own runs as written, with one warning per module.

``CustomRules`` is mixed into ``_interpreter.Interpreter`` and uses its ``_walk``, ``path``,
``_warn`` and caches.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fmtkit.policy import _analysis
from fmtkit.policy._analysis import VjpParts, holds_matmul, open_jaxpr
from fmtkit.policy._binding import bind, cast, floating_dtype, is_float_value


def _float0(x):
    """The tangent of a non-differentiable (integer, boolean) value."""
    return np.zeros(np.shape(x), jax.dtypes.float0)


class CustomRules:
    """The interpreter's handling of ``custom_jvp_call`` and ``custom_vjp_call``."""

    def _warn_untraced(self, kind: str, chain, rule: str) -> None:
        """One warning per module: ``rule`` could not be traced on its own (it only runs on
        concrete values, or on JAX's internals), so it runs as written."""
        path = self.path(chain[-1] if chain else None)
        self._warn(f"{kind}:{path}", f"{rule} in module {path or '<root>'!r} could not be "
                   "traced on its own: it runs as written (its matmuls in their traced "
                   "dtypes).")

    def _custom_jvp(self, eqn, invals, chain, idp, fp8_local):
        """A ``jax.custom_jvp``: the primal body interpreted. Its JVP rule: where the body
        holds a matmul, the rule too (traced once by ``jax.jvp`` on the traced types, then
        interpreted: its matmuls on the compute dtype; a rule that cannot be traced on its
        own runs as written, with a warning); otherwise (``jax.nn.relu``, ``softplus``)
        the original rule on the primals cast back to their traced dtypes."""
        traced = [v.aval.dtype for v in eqn.invars]
        with_matmul = holds_matmul(eqn.params["call_jaxpr"].jaxpr)
        if (all(not is_float_value(x) or x.dtype == d for x, d in zip(invals, traced))
                and not with_matmul):
            return bind(eqn, invals)  # dtypes as traced: the original, custom rule and all
        body = eqn.params["call_jaxpr"]
        rule = self._jvp_rule(eqn, chain) if with_matmul else None

        def original(*xs):
            return bind(eqn, list(xs))

        @jax.custom_jvp
        def policied(*xs):
            self._jvp_body += 1  # (GemmSite.in_custom_rule)
            try:
                return self._walk(body.jaxpr, body.consts, list(xs), [chain] * len(xs),
                                  chain, idp, fp8_local)
            finally:
                self._jvp_body -= 1

        @policied.defjvp
        def policied_jvp(primals, tangents):
            out = policied(*primals)
            if rule is not None:
                closed, floats = rule
                args = [*primals, *(t for t, f in zip(tangents, floats) if f)]
                t_iter = iter(self._walk(closed.jaxpr, closed.consts, args,
                                         [chain] * len(args), chain, (*idp, "jvp"), fp8_local))
                t_out = [next(t_iter) if is_float_value(o) else _float0(o) for o in out]
            else:
                p0 = [cast(p, d) for p, d in zip(primals, traced)]
                t0 = [cast(t, d) for t, d in zip(tangents, traced)]
                _, t_out = jax.jvp(original, p0, t0)
            return out, [cast(t, o.dtype) for t, o in zip(t_out, out)]

        return policied(*invals)

    def _jvp_rule(self, eqn, chain):
        """(jaxpr of (primals, floating tangents) -> floating output tangents, which inputs
        are floating) of a ``custom_jvp_call``'s own rule, or None (with a warning) where it
        cannot be traced."""
        key = ("jvp", id(eqn))
        if key not in self._rules_traced:
            floats = [floating_dtype(v.aval.dtype) for v in eqn.invars]
            out_floats = [floating_dtype(v.aval.dtype) for v in eqn.outvars]

            def tangent(*xs):
                primals, it = xs[:len(floats)], iter(xs[len(floats):])
                tans = [next(it) if f else np.zeros(np.shape(p), jax.dtypes.float0)
                        for p, f in zip(primals, floats)]
                _, t_out = jax.jvp(lambda *a: bind(eqn, list(a)), list(primals), tans)
                return [t for t, f in zip(t_out, out_floats) if f]

            avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
            try:
                closed = jax.make_jaxpr(tangent)(*avals, *(a for a, f in zip(avals, floats) if f))
                self._rules_traced[key] = (eqn, (closed, floats))
            except Exception:  # a rule that only runs on concrete values, or JAX's internals
                self._rules_traced[key] = (eqn, None)
        rule = self._rules_traced[key][1]
        if rule is None:
            self._warn_untraced("jvp", chain, "The JVP rule of a jax.custom_jvp around a matmul")
        return rule

    def vjp_parts(self, eqn) -> VjpParts | None:
        """``vjp_parts`` once per equation (the Analysis and the evaluation share it)."""
        key = id(eqn)
        if key not in self._vjp:
            # the eqn is kept so its id stays unique
            self._vjp[key] = (eqn, _analysis.vjp_parts(eqn))
        return self._vjp[key][1]

    def _custom_vjp(self, eqn, invals, chain, idp, fp8_local):
        """A user's ``jax.custom_vjp``: the forward rule interpreted under the policy (it also
        gives the primal outputs); the user's backward rule traced on the residuals and
        cotangents in their traced dtypes and interpreted under the policy too (its matmuls on
        the compute dtype; ``None`` gradients as JAX's zeros), its results cast to the inputs'
        dtypes.

        A forward rule written as JAX's documentation writes it calls the function itself
        (``f_fwd(x) = f(x), res``): inside a forward rule a ``custom_vjp`` runs its primal
        body (the rule is not differentiated there), which ends the recursion."""
        if self._fwd_rule:
            body, consts = open_jaxpr(eqn.params["call_jaxpr"])
            return self._walk(body, consts, list(invals), [chain] * len(invals), chain, idp,
                              fp8_local)
        traced_in = [v.aval.dtype for v in eqn.invars]
        if (all(not is_float_value(x) or x.dtype == d for x, d in zip(invals, traced_in))
                and not holds_matmul(open_jaxpr(eqn.params["call_jaxpr"])[0])):
            return bind(eqn, invals)  # nothing to change: JAX's own primal and rules
        parts = self.vjp_parts(eqn)
        if parts is None:
            return None
        traced_out = [v.aval.dtype for v in eqn.outvars]
        res_avals = [v.aval for v in parts.fwd.outvars[:parts.num_res]]
        res_dtypes = [a.dtype for a in res_avals]
        consts = invals[:parts.num_consts]
        n = len(invals) - parts.num_consts

        def forward(xs):
            self._fwd_rule += 1
            try:
                outs = self._walk(parts.fwd, parts.fwd_consts, list(xs), [chain] * n, chain,
                                  idp, fp8_local)
            finally:
                self._fwd_rule -= 1
            computed = iter(cast(r, d) for r, d in zip(outs[:parts.num_res], res_dtypes))
            full = [*consts, *xs]
            res = [next(computed) if f is None else cast(full[f], traced_in[f])
                   for f in parts.forwarded]
            return outs[parts.num_res:], res

        @jax.custom_vjp
        def policied(*xs):
            return forward(xs)[0]

        in_dtypes = [getattr(x, "dtype", None) for x in invals[parts.num_consts:]]

        def fwd(*xs):
            outs, res = forward(xs)
            return outs, res

        def bwd(res, cts):
            cts = [cast(g, d) for g, d in zip(cts, traced_out)]
            grads = self._vjp_backward(eqn, parts, res, cts, chain, idp, fp8_local)
            out = []
            for g, d in zip(grads, in_dtypes):
                if d is None or not floating_dtype(d):
                    out.append(None)
                elif not hasattr(g, "dtype"):  # JAX's symbolic zero
                    out.append(jnp.zeros(g.aval.shape, d))
                else:
                    out.append(cast(g, d))
            return tuple(out)

        policied.defvjp(fwd, bwd)
        return list(policied(*invals[parts.num_consts:]))

    def _vjp_backward(self, eqn, parts, res, cts, chain, idp, fp8_local) -> list[Any]:
        """The user's backward rule on (residuals, cotangents), interpreted: traced once on
        their traced types, its matmuls then on the compute dtype. A rule that cannot be
        traced on its own runs as written, with a warning."""
        key = ("bwd", id(eqn))
        if key not in self._rules_traced:
            zeros: dict[int, Any] = {}  # gradient index -> JAX's symbolic zero (or None)

            def flat(*a):
                grads, _logs = parts.bwd.call_wrapped(*a)
                zeros.update((j, g) for j, g in enumerate(grads) if not hasattr(g, "dtype"))
                return [g for g in grads if hasattr(g, "dtype")]

            avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*res, *cts)]
            try:
                closed = jax.make_jaxpr(flat)(*avals)
                traced = (closed, zeros, len(zeros) + len(closed.jaxpr.outvars))
            except Exception:  # a rule that only runs on concrete values, or JAX's internals
                traced = None
            self._rules_traced[key] = (eqn, traced)
        traced = self._rules_traced[key][1]
        if traced is None:
            self._warn_untraced("vjp", chain, "The backward rule of a jax.custom_vjp")
            return list(parts.bwd.call_wrapped(*res, *cts)[0])
        closed, zeros, n_grads = traced
        args = [*res, *cts]
        computed = iter(self._walk(closed.jaxpr, closed.consts, args, [chain] * len(args),
                                   chain, (*idp, "bwd"), fp8_local))
        return [zeros[j] if j in zeros else next(computed) for j in range(n_grads)]
