"""One dtype-keyed tolerance table. Values are relative tolerances.

Each entry is the unit roundoff of the dtype (half its eps), times a small factor for the
few roundings a test's arithmetic adds; tests that need another tolerance say why at the call.
"""

import ml_dtypes
import numpy as np

RTOL = {
    np.dtype(np.float32): 2.0**-24 * 4,
    np.dtype(np.float16): 2.0**-11 * 4,
    np.dtype(ml_dtypes.bfloat16): 2.0**-8 * 4,
    np.dtype(ml_dtypes.float8_e4m3fn): 2.0**-4 * 2,
    np.dtype(ml_dtypes.float8_e5m2): 2.0**-3 * 2,
}


def rtol(dtype) -> float:
    return RTOL[np.dtype(dtype)]
