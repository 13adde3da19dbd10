"""The qwix 0.1.8 internals fmtkit.qwix relies on: a qwix upgrade that changes one fails
here, by name, before the provider misbehaves."""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
import pytest

qwix = pytest.importorskip("qwix")


def test_pinned_version():
    assert qwix.__version__ == "0.1.8"


def test_private_parameter_lookup_and_module_path():
    # fmtkit.qwix tells weights from activations with qwix's own lookup, and names a dot
    # by the current module path (both private: qwix._src.utils.flax_util).
    from qwix._src.utils import flax_util

    assert list(inspect.signature(flax_util.find_param).parameters)[:1] == ["x"]
    assert inspect.signature(flax_util.get_current_module_path).parameters == {}


def test_private_rule_lookup():
    # QuantizationProvider._get_current_rule_and_op_id(op_name, only_rule=True) -> (rule, _)
    params = inspect.signature(qwix.QtProvider._get_current_rule_and_op_id).parameters
    assert list(params)[:2] == ["self", "op_name"] and "only_rule" in params


def test_public_rule_and_provider_shapes():
    fields = {f.name for f in dataclasses.fields(qwix.QtRule)}
    assert {"module_path", "op_names", "weight_qtype", "act_qtype", "bwd_qtype",
            "tile_size", "bwd_weight_grad_tile_size", "bwd_stochastic_rounding",
            "additional_qt_config", "act_static_scale"} <= fields
    assert qwix.QtRule.__dataclass_params__.frozen
    keys = qwix.QtProvider([]).get_intercept_map()
    assert {"jax.lax.dot_general", "jax.numpy.einsum", "jax.lax.ragged_dot"} <= set(keys)
    # The provider's overrides call the parent's with these signatures.
    for name, first in (("dot_general", ["self", "lhs", "rhs", "dimension_numbers"]),
                        ("einsum", ["self", "einsum_str", "operands"]),
                        ("ragged_dot", ["self", "lhs", "rhs", "group_sizes"])):
        assert list(inspect.signature(getattr(qwix.QtProvider, name)).parameters)[:len(first)] \
            == first


def test_qarray_layout_and_dequantize_convention():
    fields = [f.name for f in dataclasses.fields(qwix.QArray)]
    assert fields == ["qvalue", "scale", "zero_point", "qtype"]
    qa = qwix.QArray(jnp.array([[1.0, 2.0, 3.0, 4.0]], jnp.float8_e4m3fn),
                     jnp.array([[2.0, 0.5]], jnp.float32), None, jnp.float8_e4m3fn)
    assert qa.scale_tile_shape == (1, 2)
    # qvalue * scale per tile, in the scale's dtype (hand-computed)
    assert qwix.dequantize(qa).tolist() == [[2.0, 4.0, 1.5, 2.0]]
    assert qwix.dequantize(qa).dtype == jnp.float32


@pytest.mark.slow  # compiles qwix's quantizer (2 s)
def test_mx_qtype_names():
    qa = qwix.quantize(jnp.ones((2, 64)), "mxfp8", channelwise_axes=(0,), tiled_axes={1: 32})
    assert qa.qtype == "mxfp8" and qa.qvalue.dtype == jnp.float8_e4m3fn
    assert qa.scale.shape == (2, 2)
    # 2^ceil(log2(1 / 448)) = 2^-8
    assert float(qa.scale[0, 0]) == 2.0**-8
