"""The matmul interpretation: one matmul bound again under its module's policy.

``Matmuls.interpret`` takes a matmul equation (``dot_general``, ``conv_general_dilated``,
``ragged_dot_general``) the interpreter meets in its walk and computes it as the policy says:
the output head by ``Rules.head``; operands on the compute dtype (an f32 value the analysis
found upcast on purpose kept f32); the author's requests honoured (a precision asked for, a
result wider than the operands, complex matmuls as traced); an FP8/FP4 recipe on projections
(``fmtkit.fp8``'s GEMMs, a parameter on either side taking the weight slot; the grouped GEMM
for ``lax.ragged_dot``); a wider result with narrow backward GEMMs (``_mixed_matmul``); and
the GEMM handed to ``intercept_gemms``'s hook when one is active. A ``Matmuls`` belongs to one
``Interpreter`` (one interpreted call) and keeps what its matmuls need across the walk: the
GEMM names for the hook, the FP8 GEMMs' named outputs for remat policies, and what it warns
about once at the end (convolutions an FP8 recipe does not cover, recipes that found no
projection).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from fmtkit import fp4, fp8
from fmtkit._switches import SWITCHES
from fmtkit.policy._engine.binding import F32, bind, cast, floating_dtype, is_float_value, wider
from fmtkit.policy._gemm_hook import CALLS as GEMM_CALLS
from fmtkit.policy._gemm_hook import GemmSite, active_hook
from fmtkit.policy._policy import ancestor_types
from fmtkit.scaling import DelayedScalingState

# The prefix of the names ``checkpoint_name`` gives FP8 GEMM outputs (``_gemm_output``).
GEMM_OUTPUT = "fmtkit_fp8_gemm_output:"


def _swapped(lhs, rhs, dims, sharding):
    """``dot_general(lhs, rhs, dims)`` as ``dot_general(rhs, lhs, dims')``: the swapped
    operands and dimension numbers, the permutation that takes the swapped result (batch,
    rhs free, lhs free) back to the traced layout (batch, lhs free, rhs free), and the
    traced ``out_sharding`` laid out for the swapped result (None where it was None, or is
    a sharding without a spec to permute: the caller reshards the transposed result)."""
    (lc, rc), (lb, rb) = dims
    nb = len(lb)
    nlf = lhs.ndim - len(lc) - nb
    nrf = rhs.ndim - len(rc) - len(rb)
    back = (*range(nb), *range(nb + nrf, nb + nrf + nlf), *range(nb, nb + nrf))
    spec = (sharding if isinstance(sharding, jax.sharding.PartitionSpec)
            else getattr(sharding, "spec", None)
            if isinstance(sharding, jax.sharding.NamedSharding) else None)
    new = None
    if spec is not None:
        full = (*spec, *(None,) * (len(back) - len(spec)))
        permuted = [None] * len(back)
        for i, k in enumerate(back):  # traced axis i is the swapped result's axis k
            permuted[k] = full[i]
        extra = {a: getattr(spec, a) for a in ("unreduced", "reduced")
                 if getattr(spec, a, None)}
        new = jax.sharding.PartitionSpec(*permuted, **extra)
        if isinstance(sharding, jax.sharding.NamedSharding):
            new = jax.sharding.NamedSharding(sharding.mesh, new)
    return rhs, lhs, ((rc, lc), (rb, lb)), back, new


def _mixed_matmul(eqn, lhs, rhs, out_dtype, forward: dict | None = None, rest=()):
    """A matmul on narrow operands with a wider result (the head's f32 logits), whose two
    backward GEMMs also run on the narrow dtype (the cotangent is cast down first), as a
    bf16 head matmul does in frameworks that keep f32 logits.

    A ``custom_jvp`` (not a ``custom_vjp``), so forward-mode AD (``jax.jvp``, ``jacfwd``,
    Hessian-vector products) goes through it: the tangent is the sum of the two narrow
    matmuls, cast to the result dtype, and JAX's transpose of it is the backward above (the
    cast becomes the cotangent's cast down, each narrow matmul its dgrad or wgrad).
    ``forward``: parameters of the forward matmul only (``jax.nn.dot_product_attention``'s
    dot algorithm); ``rest``: the primitive's other operands (a ragged dot's group
    sizes), not differentiated."""
    narrow = lhs.dtype
    if not SWITCHES.narrow_mixed_backward:
        return bind(eqn, [lhs, rhs, *rest], preferred_element_type=out_dtype,
                    **(forward or {}))[0]

    def low(a, b, rest):
        return bind(eqn, [a, b, *rest], preferred_element_type=narrow)[0]

    if not SWITCHES.mixed_matmul_jvp:
        return _mixed_matmul_vjp(eqn, lhs, rhs, out_dtype, forward, rest, low)

    @jax.custom_jvp
    def matmul(a, b, *rest):
        return bind(eqn, [a, b, *rest], preferred_element_type=out_dtype,
                    **(forward or {}))[0]

    def matmul_jvp(primals, tangents):
        (a, b, *rest), (da, db, *_) = primals, tangents
        terms = [low(t, b, rest) if j == 0 else low(a, t, rest)
                 for j, t in enumerate((da, db)) if not isinstance(t, SymbolicZero)]
        out = matmul(a, b, *rest)
        if not terms:  # JAX calls the rule only when a tangent is nonzero
            return out, jnp.zeros(out.shape, out.dtype)
        return out, cast(functools.reduce(lambda x, y: x + y, terms), out_dtype)

    matmul.defjvp(matmul_jvp, symbolic_zeros=True)
    return matmul(lhs, rhs, *rest)


def _mixed_matmul_vjp(eqn, lhs, rhs, out_dtype, forward, rest, low):
    """``_mixed_matmul``'s former form (``SWITCHES.mixed_matmul_jvp`` off): a ``custom_vjp``
    with the same narrow backward GEMMs, which forward-mode AD cannot go through."""
    @jax.custom_vjp
    def matmul(a, b, *rest):
        return bind(eqn, [a, b, *rest], preferred_element_type=out_dtype,
                    **(forward or {}))[0]

    def matmul_fwd(a, b, *rest):
        return matmul(a, b, *rest), (a, b, rest)

    def matmul_bwd(res, g):
        a, b, rest = res
        _, pull = jax.vjp(lambda x, y: low(x, y, rest), a, b)
        return (*pull(cast(g, a.dtype)), *(None for _ in rest))

    matmul.defvjp(matmul_fwd, matmul_bwd)
    return matmul(lhs, rhs, *rest)


# The logits einsum of ``jax.nn.dot_product_attention(implementation="xla")`` (its name stack
# holds the einsum's spec): JAX computes it with f32 results for bf16/f16 inputs, with the
# dot algorithm below.
_DPA_LOGITS = "BTNH,BSNH->BNTS"
_DPA_ALGORITHMS = {np.dtype(jnp.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32,
                   np.dtype(np.float16): lax.DotAlgorithmPreset.F16_F16_F32}


def _asked_output(eqn, traced: list[np.dtype], target: np.dtype
                  ) -> tuple[np.dtype | None, Any]:
    """(the result dtype the author asked for, wider than the traced operands, or None; the
    dot algorithm to bind with it, or None)."""
    if eqn.primitive.name != "dot_general":
        return None, None
    pet = eqn.params.get("preferred_element_type")
    if (pet is not None and floating_dtype(pet) and all(floating_dtype(d) for d in traced)
            and np.dtype(pet).itemsize > max(d.itemsize for d in traced)):
        return np.dtype(pet), None
    if (SWITCHES.dpa_f32_logits and _DPA_LOGITS in str(eqn.source_info.name_stack)
            and target.itemsize < 4):
        algorithm = eqn.params.get("precision")
        if algorithm is None:
            algorithm = _DPA_ALGORITHMS.get(target)
        return F32, algorithm
    return None, None


def _asked_precision(eqn, cdt: np.dtype) -> str | None:
    """The precision the author asked for (``precision=HIGHEST``/``HIGH``, a dot algorithm
    whose operand types exclude the compute dtype), as words for a warning; None if none."""
    precision = eqn.params.get("precision")
    if precision is None:
        return None
    if isinstance(precision, tuple):
        asked = [p for p in precision if p in (lax.Precision.HIGHEST, lax.Precision.HIGH)]
        return f"precision={asked[0].name}" if asked else None
    types = getattr(precision, "supported_lhs_types", None)
    if types is None or any(np.dtype(t) == cdt for t in types):
        return None
    return f"the dot algorithm {getattr(precision, 'name', precision)}"


def _is_complex(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.complexfloating))


class Matmuls:
    """The matmuls of one interpreted call (see the module docstring).

    Args:
      interp: the ``Interpreter`` walking the call: its analysis, its modules' policies
        (``path``, ``head_applies``, ``rules``, ``registry``), its loop and custom-rule
        depths, its ``warn``.
      warn_no_projection: whether ``warn_no_projection`` may warn (False where the caller has
        already said why the rules' FP8 recipe finds no projection).
    """

    def __init__(self, interp: Any, warn_no_projection: bool = True):
        self.interp = interp
        # Matmuls (not convolutions, not the head) whose module has an FP8/FP4 recipe, and
        # how many of them have a parameter operand; none warns (``warn_no_projection``).
        self._fp8_covered = 0
        self._fp8_with_params = 0
        self._warn_no_projection_on = warn_no_projection
        # Convolutions under an FP8 recipe (which they never run): module path -> (compute
        # dtype, recipe name), warned about once at the end of the run (``warn_convs``).
        self._fp8_convs: dict[str, tuple[str, str]] = {}
        self._warned_convs: set[str] = set()
        self.ran = False  # the interpreter's run is over (a later conv warns at once)
        # intercept_gemms: GEMM names per (module path, equation id path) and their counts
        # per path.
        self._gemm_names: dict[tuple, str] = {}
        self._gemm_counts: dict[str, int] = {}
        self._call = next(GEMM_CALLS)
        self._gemm_outputs: dict[str, Any] = {}  # name of an FP8 GEMM's output -> its eqn

    def interpret(self, eqn, invals, chain, idp, idprefix, policy, fp8_local):
        """The matmul ``eqn`` on ``invals`` under ``policy`` (its module's), as the module
        docstring says; the interpreter's arguments for the equation (``chain``: its module
        scopes, ``idp``: its id path, ``fp8_local``: the delayed-FP8 histories in reach)."""
        info = self.interp.analysis.dots.get(idp)
        module = chain[-1] if chain else None
        head = info is not None and info.head and self.interp.head_applies(module)
        if head:
            policy = self.interp.rules.head
        elif policy.fp8 is not None and eqn.primitive.name != "conv_general_dilated":
            self._fp8_covered += 1
            self._fp8_with_params += any(not isinstance(v, jex.Literal)
                                         and self.interp.analysis.is_param(idprefix, v)
                                         for v in eqn.invars[:2])
        cdt = np.dtype(policy.compute_dtype)
        traced = [np.dtype(v.aval.dtype) for v in eqn.invars[:2]]
        if SWITCHES.complex_as_traced and any(_is_complex(d) for d in traced):
            # No complex bf16 or FP8: the matmul runs as traced, and says so when the policy
            # would narrow it.
            path = self.interp.path(module)
            if policy.fp8 is not None or cdt.itemsize < 4:
                self.interp.warn(f"complex:{path}", (
                    f"A complex matmul in module {path or '<root>'!r} runs in its traced "
                    f"dtype ({wider(*traced).name}): the policy's compute dtype "
                    f"({cdt.name}) and FP8 recipes apply to real matmuls only."))
            return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])[0]
        asked = _asked_precision(eqn, cdt) if SWITCHES.honour_asked_precision else None
        if asked is not None and (policy.fp8 is not None
                                  or any(d.itemsize > cdt.itemsize for d in traced)):
            # The author asked for this matmul's precision: honoured, on the traced dtypes.
            path = self.interp.path(module)
            self.interp.warn(f"precision:{path}", (
                f"A matmul in module {path or '<root>'!r} asks for {asked}: honoured, it runs "
                f"on its traced operand dtypes ({traced[0].name}), not the policy's "
                f"{cdt.name}{' or FP8' if policy.fp8 is not None else ''}. Drop the request "
                "to let the policy choose; to silence this for the module: "
                "warnings.filterwarnings('ignore', message=\".*module "
                f"{path or '<root>'!r}\").")
            )
            return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)])[0]
        if (policy.fp8 is not None and not head
                and eqn.primitive.name == "conv_general_dilated"):
            self._fp8_convs.setdefault(self.interp.path(module), (cdt.name, policy.fp8.name))
            if SWITCHES.fp8_conv_warning == "per_conv":
                self._warned_convs -= {w for w in self._warned_convs if w.startswith("conv:")}
                self.warn_convs()
            elif self.ran:  # met after the run (a custom_vjp backward rule): say so now
                self.warn_convs()
        lhs, rhs = invals[0], invals[1]
        targets = []
        for x, v in zip((lhs, rhs), eqn.invars[:2]):
            keep = (is_float_value(x) and x.dtype == F32
                    and self.interp.analysis.is_upcast(idprefix, v))
            targets.append(F32 if keep else cdt)
        target = wider(*targets)
        lhs, rhs = cast(lhs, target), cast(rhs, target)
        out_dt = np.dtype(policy.output_dtype) if head else target
        # A result wider than the operands that the author asked for (an einsum's
        # preferred_element_type=f32 on bf16 operands; the f32 logits of
        # jax.nn.dot_product_attention, which JAX computes so for bf16 inputs) is kept.
        wide_out, algorithm = (_asked_output(eqn, traced, target)
                               if SWITCHES.keep_asked_wide_output else (None, None))
        if wide_out is not None and wide_out.itemsize > out_dt.itemsize and not head:
            out_dt = wide_out
        else:
            wide_out = None
        recipe = policy.fp8
        weight = self._weight_operand(eqn, idprefix)
        hook = active_hook()
        # (the GEMMs of a custom_jvp's JVP rule or a custom_vjp's backward rule are derivatives
        # of the layer's own GEMMs, met only under differentiation: not handed to the hook)
        if hook is not None and "jvp" not in idp and "bwd" not in idp:
            return self._hooked(hook, eqn, lhs, rhs, invals[2:], recipe, idp, module, info,
                                head, policy, cdt, target, out_dt, wide_out, algorithm,
                                fp8_local, weight)
        return self._compute(eqn, lhs, rhs, invals[2:], recipe, idp, module, info, head,
                             cdt, target, out_dt, wide_out, algorithm, fp8_local, weight)

    def _weight_operand(self, eqn, idprefix) -> int:
        """Which operand of a matmul is its weight: 0 where only the left one is a view of a
        parameter (Equinox's ``weight @ x``, a function's ``params["w"] @ x``), else 1 (the
        right one, as in ``x @ w``; also where both or neither are parameters)."""
        lhs, rhs = (not isinstance(v, jex.Literal) and self.interp.analysis.is_param(idprefix, v)
                    for v in eqn.invars[:2])
        return 0 if lhs and not rhs and SWITCHES.weight_on_either_side else 1

    def _hooked(self, hook, eqn, lhs, rhs, rest, recipe, idp, module, info, head, policy,
                cdt, target, out_dt, wide_out, algorithm, fp8_local, weight):
        """The GEMM handed to ``intercept_gemms``'s hook (``_gemm_hook``)."""
        path = self.interp.path(module)
        key = (path, idp)
        if key not in self._gemm_names:
            n = self._gemm_counts.get(path, 0)
            self._gemm_counts[path] = n + 1
            self._gemm_names[key] = f"{eqn.primitive.name}_{n}"
        # (a grouped GEMM of lax.ragged_dot's form takes FP8 recipes too: fmtkit.fp8.ragged_dot)
        capable = (not head and target == cdt and info is not None and info.projection
                   and (eqn.primitive.name == "dot_general"
                        or (_ragged_dot_form(eqn) and not isinstance(recipe, fp4.Fp4Recipe))))
        type_names = () if module is None else self.interp.registry.modules[module].type_names
        site = GemmSite(
            path=path, type_names=type_names,
            ancestors=ancestor_types(path, self.interp.registry.visited()),
            name=self._gemm_names[key], primitive=eqn.primitive.name, policy=policy,
            fp8=recipe if capable else None, fp8_capable=capable, head=head,
            dimension_numbers=eqn.params.get("dimension_numbers")
            if eqn.primitive.name == "dot_general" else None,
            in_loop=self.interp.loop_depth > 0, call=self._call,
            loop_lengths=tuple(n for _, n in self.interp.loops),
            loop_index=tuple(i for i, _ in self.interp.loops),
            fp8_history=fp8_local.get(self.interp.analysis.sites.get(idp))
            if capable and recipe is not None and recipe.delayed
            and eqn.primitive.name == "dot_general" else None,
            weight_operand=weight,
            in_custom_rule=self.interp.fwd_rule > 0 or self.interp.jvp_body > 0,
            group_sizes=rest[0] if _ragged_dot_form(eqn) else None)

        def run(a, b, new_recipe=None):
            return self._compute(eqn, a, b, rest, new_recipe, idp, module, info, head, cdt,
                                 target, out_dt, wide_out, algorithm, fp8_local, weight)

        return hook(site, run, lhs, rhs)

    def _compute(self, eqn, lhs, rhs, rest, recipe, idp, module, info, head, cdt, target,
                 out_dt, wide_out, algorithm, fp8_local, weight=1):
        """The GEMM on operands already in their dtype: FP8 by ``recipe`` where it applies,
        else in the operands' dtype (the head's and asked-for wider results kept)."""
        if (recipe is not None and not head and info is not None and info.projection
                and eqn.primitive.name == "ragged_dot_general"):
            out = self._fp8_ragged(eqn, lhs, rhs, rest, recipe, module, target, cdt,
                                   cdt if wide_out is None else wide_out)
            if out is not None:
                return self._gemm_output(out, eqn)
        if (recipe is not None and not head and target == cdt and info is not None
                and info.projection and eqn.primitive.name == "dot_general"):
            out = self._fp8_matmul(eqn, lhs, rhs, recipe, idp, module, info, fp8_local,
                                   cdt if wide_out is None else wide_out, weight)
            if out is not None:
                return self._gemm_output(out, eqn)
        if not (is_float_value(lhs) and is_float_value(rhs)):
            return bind(eqn, [lhs, rhs, *rest])[0]
        if wide_out is not None:  # the backward as the head's: on the operands' dtype
            return _mixed_matmul(eqn, lhs, rhs, out_dt,
                                 {} if algorithm is None else {"precision": algorithm}, rest)
        if out_dt.itemsize > target.itemsize:
            return _mixed_matmul(eqn, lhs, rhs, out_dt, rest=rest)
        return bind(eqn, [lhs, rhs, *rest], preferred_element_type=out_dt)[0]

    def _gemm_output(self, y, eqn):
        """An FP8 GEMM's output, named (``jax.ad_checkpoint.checkpoint_name``) so that a
        remat policy in the model saves it where it saves the traced matmul's output: the
        GEMM runs inside ``custom_jvp`` rules, which the policy never sees as a
        ``dot_general`` (``remat_policy``)."""
        # (numbered in trace order, not by the call: a trace's text does not depend on how
        # many policied calls came before it)
        name = f"{GEMM_OUTPUT}{len(self._gemm_outputs)}"
        self._gemm_outputs[name] = eqn
        return checkpoint_name(y, name)

    def remat_policy(self, policy):
        """The user's remat policy (``jax.checkpoint(policy=...)``, ``nn.remat(policy=...)``)
        with each FP8 GEMM's named output (``_gemm_output``) asked about as the traced
        matmul it replaces: ``checkpoint_dots`` saves it, ``save_only_these_names`` does
        not, as on the unwrapped model. None (save nothing) stays None."""
        if policy is None:
            return None
        outputs = self._gemm_outputs

        def translated(prim, *avals, **params):
            eqn = outputs.get(params.get("name")) if prim.name == "name" else None
            if eqn is None:
                return policy(prim, *avals, **params)
            return policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)

        return translated

    def _fp8_ragged(self, eqn, lhs, rhs, rest, recipe, module, target, cdt, out_dt):
        """A ``lax.ragged_dot`` projection as the grouped FP8 GEMM (``fmtkit.fp8.ragged_dot``),
        or None (it then runs on the compute dtype) with a warning saying why: an FP4 recipe,
        or a ragged dot of another form than ``lax.ragged_dot``'s [M, K] x [G, K, N]."""
        path = self.interp.path(module)
        plain = _ragged_dot_form(eqn) and target == cdt
        why = None
        if isinstance(recipe, fp4.Fp4Recipe):
            why = "the FP4 recipes have no grouped GEMM"
        elif not plain:
            why = ("fmtkit.fp8.ragged_dot takes lax.ragged_dot's form (lhs [M, K] sorted by "
                   "group, rhs [G, K, N])")
        if why is not None:
            self.interp.warn(f"no-fp8:{path}:{eqn.primitive.name}", (
                f"lax.ragged_dot (a grouped GEMM) in module {path or '<root>'!r} runs on "
                f"{cdt.name}, not with the recipe {recipe.name}: {why}. inspect_policy "
                "counts it as not FP8."))
            return None
        if recipe.delayed:  # (fmtkit.fp8.ragged_dot would warn on every trace)
            self.interp.warn(f"delayed:{path}:{eqn.primitive.name}", (
                f"lax.ragged_dot (a grouped GEMM) in module {path or '<root>'!r} runs with "
                f"current scaling: the grouped FP8 GEMM keeps no amax history (the delayed "
                f"recipe {recipe.name}'s formats, per-tensor scales from this step)."))
            recipe = dataclasses.replace(recipe, delayed=False)
        try:
            return fp8.ragged_dot(lhs, rhs, rest[0], recipe, preferred_element_type=out_dt)
        except ValueError as err:
            raise ValueError(f"FP8 grouped GEMM in module {path or '<root>'!r} (recipe "
                             f"{recipe}): {err}") from None

    def _fp8_matmul(self, eqn, lhs, rhs, recipe, idp, module, info, fp8_local, cdt,
                    weight=1):
        """The FP8 GEMM, its weight (``weight``: the operand index) in the recipe's weight
        slot: ``fmtkit.fp8`` takes (x, w) as (lhs, rhs), so a parameter on the left runs with
        the operands swapped and the result transposed back to the traced layout (the
        weight's format, tiling and amax history row, and the gradients' dgrad/wgrad roles
        follow the parameter, not its position)."""
        path = self.interp.path(module)
        kwargs = {}
        if recipe.delayed:
            key = self.interp.analysis.sites.get(idp)
            if key is None or key not in fp8_local:
                reason = ("no amax history was passed for it (initialize the policied model "
                          "and pass its 'fp8_state')")
                self.interp.warn(path, f"FP8 recipe {recipe} skipped for a matmul in module "
                                 f"{path or '<root>'!r}: {reason}; it runs in {cdt.name}.")
                return None
            kwargs["fp8_state"] = DelayedScalingState(fp8_local[key])
        dims, sharding = eqn.params["dimension_numbers"], eqn.params.get("out_sharding")
        back = None
        if weight == 0:
            lhs, rhs, dims, back, sharding = _swapped(lhs, rhs, dims, sharding)
        try:
            # (the traced out_sharding: the FP8 GEMMs give y, and their gradients give x and
            # w, the shardings the traced dot and its transposes would)
            y = fp8.dot_general_fn(recipe)(lhs, rhs, dims, None, preferred_element_type=cdt,
                                           out_sharding=sharding, **kwargs)
        except ValueError as err:
            raise ValueError(f"FP8 matmul in module {path or '<root>'!r} (recipe "
                             f"{recipe}): {err}") from None
        if back is None:
            return y
        y = jnp.transpose(y, back)
        out_sharding = eqn.params.get("out_sharding")
        if out_sharding is not None and sharding is None:  # a sharding _swapped cannot permute
            y = jax.sharding.reshard(y, out_sharding)
        return y

    def warn_convs(self) -> None:
        """One warning naming every module whose convolutions an FP8 recipe would have
        covered were they matmuls: they run on the compute dtype instead (fmtkit's FP8 GEMMs
        are ``dot_general`` only). Once per interpreted call (one per trace under ``jit``),
        not per convolution."""
        convs = {p: v for p, v in self._fp8_convs.items() if f"conv:{p}" not in self._warned_convs}
        if not convs or SWITCHES.fp8_conv_warning == "never":
            return
        self._warned_convs.update(f"conv:{p}" for p in convs)
        dtypes = sorted({d for d, _ in convs.values()})
        recipes = sorted({r for _, r in convs.values()})
        names = ", ".join(repr(p or "<root>") for p in convs)
        warnings.warn(
            f"Convolutions in module(s) {names} run on {' / '.join(dtypes)} (the compute "
            f"dtype), not with the FP8 recipe {' / '.join(recipes)}: fmtkit's FP8 GEMMs are "
            "dot_general only. inspect_policy lists their FLOPs; fp8_fraction does not count "
            "them. To state this in the rules (and silence it), give these modules a policy "
            "without an FP8 recipe, e.g. dataclasses.replace(preset, rules=[(\"type:Conv\", "
            "\"p=f32,c=bf16,o=bf16\"), *preset.rules]); or filter it: "
            "warnings.filterwarnings('ignore', message='Convolutions in module').",
            UserWarning, stacklevel=3)

    def warn_no_projection(self) -> None:
        """Warns when the rules' FP8/FP4 recipes cover matmuls but none of them has a
        parameter operand (a view of the parameters): the recipe then quantizes nothing,
        and ``inspect_policy``'s ``fp8_fraction`` is NaN. Usually the parameters were not
        where the frontend looks for them (a function's ``params_argnums``, a Hugging Face
        model's ``params=`` keyword), so it warns only when no matmul of the whole program
        has one (a rule that puts a recipe on attention's ``q @ k`` alone does not warn).
        (A one-hot embedding lookup has a parameter operand and stays out of FP8 by design:
        it does not warn.)"""
        if not self._warn_no_projection_on or self._fp8_with_params or not self._fp8_covered:
            return
        if any(d.projection for d in self.interp.analysis.dots.values()):
            return  # the parameters were found: the recipe's modules just have no projection
        recipes = sorted({p.fp8.name for p in (self.interp.rules.default,
                                                *(p for _, p in self.interp.rules.rules))
                          if p is not None and p.fp8 is not None})
        self.interp.warn("no-projection", (
            f"with_policy: the FP8/FP4 recipe {' / '.join(recipes)} found no projection to "
            f"quantize: none of the {self._fp8_covered} matmul(s) it covers has a parameter "
            "operand, so all ran on the compute dtype (inspect_policy's fp8_fraction is "
            "NaN). A matmul is a projection when one operand is a view of the parameters: a "
            "linen model's variables['params'], an NNX model's nnx.Param, a plain "
            "function's parameter argument(s) (params_argnums; 'auto' takes the first "
            "positional argument when there are two or more). A Hugging Face Flax model "
            "takes its parameters by keyword: wrap hf_model.module and apply it with "
            "{'params': hf_model.params}."))


def _ragged_dot_form(eqn) -> bool:
    """Whether a ``ragged_dot_general`` is ``lax.ragged_dot``'s [M, K] x [G, K, N] GEMM (what
    ``fmtkit.fp8.ragged_dot`` computes)."""
    return (SWITCHES.ragged_dot_form and eqn.primitive.name == "ragged_dot_general"
            and _is_ragged_dot(eqn.params["ragged_dot_dimension_numbers"])
            and eqn.params.get("group_offset") is None
            and eqn.invars[0].aval.ndim == 2 and eqn.invars[1].aval.ndim == 3)


def _is_ragged_dot(rd) -> bool:
    """Whether ragged dot dimension numbers are ``lax.ragged_dot``'s: lhs [M, K] ragged
    along M, rhs [G, K, N] grouped along G, contracting K."""
    return (tuple(map(tuple, rd.dot_dimension_numbers[0])) == ((1,), (1,))
            and tuple(map(tuple, rd.dot_dimension_numbers[1])) == ((), ())
            and tuple(rd.lhs_ragged_dimensions) == (0,)
            and tuple(rd.rhs_group_dimensions) == (0,))
