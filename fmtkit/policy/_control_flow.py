"""Primitives with a body under the interpreter: nested ``jit`` (kept as a ``jit`` with its
shardings), ``cond``/``switch`` (outputs in the widest dtype the branches give), ``while``
(the carry in its traced dtypes), ``shard_map`` (same mesh and specs), ``remat`` and
``scan`` (each body interpreted and rebuilt), and bodies the policy cannot interpret
(``pallas_call``, unknown primitives: run as traced, with a warning).

Under ``intercept_gemms`` a GEMM in a loop body learns the loops around it
(``GemmSite.loop_lengths``, ``GemmSite.loop_index``): a rebuilt scan then also scans an
``arange`` of its length, each iteration's index (unused, JAX drops it from the scan).

``ControlFlow`` is mixed into ``_interpreter.Interpreter`` and uses its ``_walk``, ``path``,
``_warn``, ``record`` and ``analysis``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fmtkit.policy._analysis import open_jaxpr, scan_counts
from fmtkit.policy._binding import bind, cast, floating_dtype, wider
from fmtkit.policy._gemm_hook import active_hook


class ControlFlow:
    """The interpreter's rebuilding of control flow and other bodies."""

    def _opaque(self, eqn, invals, chain):
        """A primitive whose body the policy cannot interpret (``pallas_call``, an unknown
        primitive): it runs as traced, inputs cast back, with one warning per module and
        primitive; ``inspect_policy`` lists its matmuls as not policied."""
        name = eqn.primitive.name
        path = self.path(chain[-1] if chain else None)
        self._warn(f"opaque:{path}:{name}",
                   f"Primitive {name!r} in module {path or '<root>'!r} holds a body the policy "
                   "does not interpret: it runs as traced (its matmuls in their traced dtypes, "
                   "no FP8). inspect_policy lists its matmuls as not policied.")
        if self.record is not None:
            self.record.opaque.append((path, name))
        return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])

    def _jit(self, eqn, invals, chain, idp, fp8_local):
        """A nested ``jit`` is kept as a ``jit`` of its interpreted body, with the same
        ``in_shardings``/``out_shardings`` (inlining it changed XLA's fusion of the
        gradient: ~1e-7 differences under "fp32"); other call primitives are inlined."""
        inner = eqn.params["jaxpr"]

        def body(*xs):
            return tuple(self._walk(inner.jaxpr, inner.consts, list(xs), [chain] * len(xs),
                                    chain, idp, fp8_local))

        if eqn.primitive.name not in ("pjit", "jit"):
            return list(body(*invals))
        p = eqn.params
        jitted = jax.jit(body, in_shardings=tuple(p["in_shardings"]),
                         out_shardings=tuple(p["out_shardings"]),
                         keep_unused=p["keep_unused"])
        jitted.__name__ = p.get("name", "jit")  # for the jaxpr's readers
        return list(jitted(*invals))

    def _cond(self, eqn, invals, chain, idp, fp8_local):
        """``cond``/``switch``: each branch interpreted; an output gets the widest of the
        dtypes the branches give it (``lax.switch`` needs one type)."""
        ops = invals[1:]
        n = len(ops)

        def branch(b, br):
            def fn(*xs):
                return self._walk(br.jaxpr, br.consts, list(xs), [chain] * n, chain,
                                  (*idp, b), fp8_local)
            return fn

        fns = [branch(b, br) for b, br in enumerate(eqn.params["branches"])]
        record, self.record = self.record, None  # dtypes only: nothing recorded
        try:
            shapes = [jax.eval_shape(fn, *ops) for fn in fns]
        finally:
            self.record = record
        targets = [functools.reduce(wider, [s[j].dtype for s in shapes])
                   if all(floating_dtype(s[j].dtype) for s in shapes) else None
                   for j in range(len(eqn.outvars))]

        def cast_outputs(fn):
            return lambda *xs: [o if t is None else cast(o, t) for o, t in zip(fn(*xs),
                                                                             targets)]

        return list(lax.switch(invals[0], [cast_outputs(fn) for fn in fns], *ops))

    def _while(self, eqn, invals, chain, idp, fp8_local):
        """``while`` (``fori_loop`` with a traced bound): body and condition interpreted, the
        carry kept in its traced dtypes (as ``scan``'s; a loop needs one carry type)."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        (cj, cc), (bj, bc) = open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"])
        cconsts, bconsts = invals[:cn], invals[cn:cn + bn]
        dtypes = [v.aval.dtype for v in eqn.invars[cn + bn:]]
        init = [cast(x, d) for x, d in zip(invals[cn + bn:], dtypes)]

        def cond_fn(carry):
            args = [*cconsts, *carry]
            return self._walk(cj, cc, args, [chain] * len(args), chain, (*idp, 0),
                              fp8_local)[0]

        def body_fn(carry):
            args = [*bconsts, *carry]
            outs = self._walk(bj, bc, args, [chain] * len(args), chain, (*idp, 1), fp8_local)
            return [cast(o, d) for o, d in zip(outs, dtypes)]

        self._loop_depth += 1
        self._loops.append((None, None))
        try:
            return list(lax.while_loop(cond_fn, body_fn, init))
        finally:
            self._loop_depth -= 1
            self._loops.pop()

    def _shard_map(self, eqn, invals, chain, idp, fp8_local):
        """``shard_map``: the body interpreted, rebuilt with the same mesh, specs and manual
        axes."""
        p = eqn.params
        body, consts = open_jaxpr(p["jaxpr"])

        def fn(*xs):
            return tuple(self._walk(body, consts, list(xs), [chain] * len(xs), chain, idp,
                                    fp8_local))

        mapped = jax.shard_map(fn, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                               out_specs=tuple(p["out_specs"]), check_vma=p["check_vma"],
                               axis_names=set(p["newly_manual_axes"]))
        return list(mapped(*invals))

    def _checkpoint(self, eqn, invals, chain, idp, fp8_local):
        body = eqn.params["jaxpr"]

        def fn(*xs):
            return self._walk(body, (), list(xs), [chain] * len(xs), chain, idp, fp8_local)

        return jax.checkpoint(fn, prevent_cse=eqn.params["prevent_cse"],
                              policy=self.remat_policy(eqn.params["policy"]))(*invals)

    def _scan(self, eqn, invals, chain, idp, fp8_local):
        n0, n1, _ = scan_counts(eqn)
        body = eqn.params["jaxpr"]
        consts, init, xs = invals[:n0], invals[n0:n0 + n1], invals[n0 + n1:]
        carry_dtypes = [getattr(x, "dtype", None) for x in init]
        keys = [k for k in self.analysis.scan_sites.get(idp, []) if k in fp8_local]
        n_in = len(invals)
        length = int(eqn.params["length"])
        # Under intercept_gemms the body also gets its iteration's index (GemmSite.loop_index)
        # as one more scanned input, so a reverse scan's index is the original position; the
        # index is not added otherwise, so the program without a hook is the same.
        index = [jnp.arange(length, dtype=jnp.int32)] if active_hook() is not None else []

        def step(carry, inp):
            x, hist, i = inp
            local = {**fp8_local, **dict(zip(keys, hist))}
            self._loops.append((i[0] if i else None, length))
            try:
                outs = self._walk(body.jaxpr, body.consts, [*consts, *carry, *x],
                                  [chain] * n_in, chain, idp, local)
            finally:
                self._loops.pop()
            new = [cast(o, d) if d is not None else o for o, d in zip(outs[:n1], carry_dtypes)]
            return new, outs[n1:]

        self._loop_depth += 1
        try:
            carry, ys = lax.scan(step, list(init),
                                 (list(xs), [fp8_local[k] for k in keys], index),
                                 length=length,
                                 reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
        finally:
            self._loop_depth -= 1
        return [*carry, *ys]
