"""Per-GEMM numerics statistics from inside the compiled step, and run-time overrides.

For a model under ``fmtkit.with_policy`` (linen, NNX, a plain JAX function, Equinox), a
``DebugConfig`` chooses, by module-path patterns like the policy's rules, which GEMMs log
which statistics of which of their six tensors, at which steps, and how a GEMM runs
(``override``: without quantization, per-tensor current or blockwise scaling, or
fake-quantized to any fmtkit format). Nothing in the model changes, and without a
configuration the compiled step is the same program as before.

Usage: ``state = init(config, loss, params, batch)`` once; in the step, differentiate with
respect to ``(params, state)`` a loss that calls the model inside ``capture(config, state,
step)``; the gradient of ``state`` is the statistics of the step, and
``config.logs_at(step)`` says whether it holds any (other steps are NaN; so are the statistics
of a GEMM that did not run this step, in the branch of ``lax.cond`` not taken: no data, not
zeros). ``step`` is an
array, so logging every ``freq`` steps never recompiles; on other steps ``lax.cond`` skips
the work.

The statistics pytree: ``{module_path: {gemm_name: {tensor: {stat: f32[]}}}}``. The module
path is the policy's (``""`` for the root or a plain function); the GEMM name is
``"<primitive>_<i>"`` (``"dot_general_0"``), numbered per module in the order the GEMMs
run; tensors are ``TENSORS``: the GEMM ``output = activation · weight`` (its operands as
the GEMM receives them, in the compute dtype, before quantization; the weight is the
operand that is a view of a parameter, whichever side it is written on: the left one in
Equinox's ``weight @ x``; else the right one), ``output_grad``,
``dgrad`` (cotangent of the activation) and ``wgrad`` (cotangent of the weight). A log tag is
``f"{module_path}/{gemm_name}/{tensor}/{stat}"``.

GEMMs in loop bodies (layer stacks under ``nn.scan``, ``nnx.scan``, ``lax.scan``, a
``fori_loop`` with static bounds) have one value per iteration: their leaves are
``f32[L]`` for a scan of length ``L`` (``f32[L1, L2]`` for nested scans, outermost first),
entry ``i`` the statistic of iteration ``i`` (in the order of the scanned inputs, also for a
reverse scan), still keyed by module path and GEMM name; with the state as ``layers``,
``fmtkit.debug.log.StatsLogger`` logs each iteration under its own tag,
``f"{module_path}[{i}]/{gemm_name}/{tensor}/{stat}"``. The grouped GEMM of an MoE layer
(``lax.ragged_dot``, FP8 under the FP8 presets) has one value per expert in the same way:
``f32[G]`` leaves (``f32[L, G]`` in a scan), expert ``g``'s row tensors the rows of its
tokens (NaN for an expert without tokens), its weight and wgrad its slice of the stack, its
quantization statistics replaying the grouped GEMM's (one scale per expert for the weights).
Statistics of a GEMM inside a
``while_loop`` (no static trip count) raise ``ValueError``.

The statistics (f32, computed in f32; names and definitions in ``fmtkit.stats``):
``BASE_STATS`` of every tensor (``min``, ``max``, ``mean``, ``std``, ``l1_norm``,
``l2_norm``, ``amax``, ``dynamic_range``, ``max_blockwise_dynamic_range``) and
``QUANT_STATS`` (``underflow_share``, ``saturation_share``, ``nonfinite_count``,
``scale_min``, ``scale_max``, ``sqnr_db``, ``mse``) of an operand the GEMM quantizes
(activation, weight, output_grad under an FP8 recipe, delayed ones with their scales from
the amax history, or under a ``fake_quant`` override; not FP4 recipes, whose two-level
scales have no ``fmtkit.scaling`` equivalent), replaying its quantization on the operand
laid out ``[free, contraction]`` (the output gradient as the data-gradient GEMM reads it).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fmtkit import with_policy
  >>> model = with_policy(lambda w, x: x @ w, "bf16-mixed")
  >>> cfg = DebugConfig([Rule("", tensors=("activation", "dgrad"), stats=("amax",),
  ...                         freq=2)])
  >>> w, x = jnp.ones((3, 2)), jnp.full((4, 3), 0.5)
  >>> loss = lambda w, x: jnp.sum(model(w, x))
  >>> state = init(cfg, loss, w, x)
  >>> def step(w, state, i):
  ...     def f(w, state):
  ...         with capture(cfg, state, i):
  ...             return loss(w, x)
  ...     return jax.grad(f, argnums=(0, 1))(w, state)[1]
  >>> jax.jit(step)(w, state, 0)[""]["dot_general_0"]["activation"]["amax"].item()
  0.5
  >>> bool(jnp.isnan(jax.jit(step)(w, state, 1)[""]["dot_general_0"]["dgrad"]["amax"]))
  True
"""

from fmtkit.debug._autopilot import TRIGGERS, Autopilot, AutopilotState, Decision
from fmtkit.debug._capture import capture, init
from fmtkit.debug._config import (
    BASE_STATS,
    OVERRIDES,
    QUANT_STATS,
    STATS,
    TENSORS,
    DebugConfig,
    Rule,
)

__all__ = ["BASE_STATS", "OVERRIDES", "QUANT_STATS", "STATS", "TENSORS", "TRIGGERS", "Autopilot",
           "AutopilotState", "DebugConfig", "Decision", "Rule", "capture", "init"]
