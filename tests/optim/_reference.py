"""Independent plain-Python references for the optim tests (no fmtkit code in here)."""

from __future__ import annotations

import numpy as np


def grad_scaler_trace(found_inf, *, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=2000, min_scale=None, max_scale=None, hysteresis=1):
    """PyTorch ``torch.amp.GradScaler.update`` step by step, plus Megatron's hysteresis.

    Written from the documented rule (PyTorch ``_amp_update_scale_``: on inf, scale *= backoff
    and tracker = 0; otherwise tracker += 1 and, when it reaches growth_interval, scale *=
    growth if the product is finite, tracker = 0) and Megatron-LM ``DynamicGradScaler.update``
    (hysteresis tracker decremented on inf, backoff when it is <= 0, refilled on growth;
    ``max(scale * backoff, min_scale)``). The products are taken in float64 and rounded to
    float32, as PyTorch's kernel does with its double factors.

    Returns:
      A list of (skipped, scale after the step, growth tracker, hysteresis tracker).
    """
    scale = np.float32(init_scale)
    tracker, hyst = 0, hysteresis
    out = []
    for inf in found_inf:
        if inf:
            tracker = 0
            hyst -= 1
            if hyst <= 0:
                scale = np.float32(np.float64(scale) * backoff_factor)
                if min_scale is not None:
                    scale = max(scale, np.float32(min_scale))
        else:
            tracker += 1
            if tracker == growth_interval:
                new = np.float32(np.float64(scale) * growth_factor)
                if np.isfinite(new):
                    scale = new
                if max_scale is not None:
                    scale = min(scale, np.float32(max_scale))
                tracker = 0
                hyst = hysteresis
        out.append((bool(inf), float(scale), tracker, max(hyst, 0)))
    return out


def quantize_reference(x, dtype, fmt_max, block=None):
    """Per-tensor (block None) or per-block scaled quantization, from the documented formula:
    amax per block (f32); scale = 1 if amax == 0 else max(amax / fmt_max, 2^-126);
    values = clip(x / scale, -max, max) cast to ``dtype``. Returns the dequantized f32 array.
    """
    x = np.asarray(x, np.float32)
    if block is None:
        block = x.shape
    shape = []
    for n, b in zip(x.shape, block):
        shape += [n // b, b]
    xb = x.reshape(shape)
    axes = tuple(range(1, len(shape), 2))
    amax = np.max(np.abs(xb), axis=axes, keepdims=True)
    scale = np.where(amax == 0, np.float32(1.0),
                     np.maximum(amax / np.float32(fmt_max), np.float32(2.0**-126)))
    scale = scale.astype(np.float32)
    values = np.clip(xb / scale, -fmt_max, fmt_max).astype(dtype)
    return (values.astype(np.float32) * scale).reshape(x.shape)


def adam_reference(grads, *, b1=0.9, b2=0.999, eps=1e-8, store_mu=None, store_nu=None):
    """Adam in f32 NumPy (Kingma & Ba 2015, optax's bias correction) with the moments stored
    through ``store_*`` (a function f32 -> f32 that rounds to the storage format) after each
    step; the update uses the unrounded f32 moments. Returns (updates, stored mu, stored nu)
    per step."""
    store_mu = store_mu or (lambda x: x)
    store_nu = store_nu or (lambda x: x)
    m = np.zeros_like(grads[0], np.float32)
    v = np.zeros_like(grads[0], np.float32)
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float32)
        m = np.float32(1 - b1) * g + np.float32(b1) * m
        v = np.float32(1 - b2) * (g * g) + np.float32(b2) * v
        m_hat = m / np.float32(1 - np.float32(b1) ** np.float32(t))
        v_hat = v / np.float32(1 - np.float32(b2) ** np.float32(t))
        u = m_hat / (np.sqrt(v_hat) + np.float32(eps))
        m, v = store_mu(m).astype(np.float32), store_nu(v).astype(np.float32)
        out.append((u, m, v))
    return out
