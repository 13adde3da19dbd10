"""Study allreduce: reduction precision across 8 simulated devices (runs in a subprocess)."""

import numpy as np

from studies.numerics import allreduce


def test_allreduce_errors_order_and_magnitude():
    r = allreduce.run(allreduce.Config(size=4096, steps=3))
    red = r["reduction"]
    assert red["devices"] == [2, 4, 8]
    for i in range(3):
        # f32: a few f32 ulps (2^-24 ~ 6e-8 per rounding) on a sum of up to 8 terms.
        assert red["f32"][i] < 1e-6
        # bf16 inputs: each rounded by at most 2^-9 relative; the norm-wise error of the
        # sum sits between 2^-9 / 8 and 2^-9.
        assert 2.0**-12 < red["bf16-comm"][i] < 2.0**-8
        assert red["bf16"][i] >= red["bf16-comm"][i]  # also rounds the sum to bf16
    assert all(np.isfinite(v) for m in allreduce.MODES for v in r["losses"][m])
    assert len(r["losses"]["f32"]) == 3
