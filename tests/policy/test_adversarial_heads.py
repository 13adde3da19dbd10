"""A head that multiplies two activations: CLIP's contrastive logits,
``(image_emb @ text_emb.T) * exp(logit_scale)``, are the model's output head by role (the
matmul the logits, and the loss, derive from), although neither operand is a parameter.
Under a mixed preset the head's products are summed into f32 logits, as for a projection
head, not rounded to bf16 before a scale of up to 100. References: float64 NumPy on
ml_dtypes' bf16 roundings of the operands.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fmtkit import inspect_policy, with_policy
from fmtkit.policy import mark_head

pytestmark = pytest.mark.slow  # each test compiles training steps (seconds)

def _bf16(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _embeddings():
    k = jax.random.split(jax.random.key(0), 2)
    img = jax.random.normal(k[0], (8, 64))
    txt = jax.random.normal(k[1], (8, 64))
    img = img / jnp.linalg.norm(img, axis=-1, keepdims=True)
    txt = txt / jnp.linalg.norm(txt, axis=-1, keepdims=True)
    return img, txt


def _logits(p, img, txt):  # CLIP's logits_per_image
    return (img @ txt.T) * jnp.exp(p["logit_scale"])


def test_contrastive_logits_are_f32_under_bf16_mixed():
    img, txt = _embeddings()
    p = {"logit_scale": jnp.log(jnp.float32(100.0))}
    got = jax.jit(with_policy(_logits, "bf16-mixed"))(p, img, txt)
    assert got.dtype == jnp.float32
    scale = np.float64(np.exp(np.float32(np.log(np.float32(100.0)))))
    want = (_bf16(img) @ _bf16(txt).T) * scale
    # 64 exact bf16 products summed in f32, one f32 exp and one f32 multiply: a few f32 ulps
    # of the largest logit (|logits| <= 100).
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-5)
    # Negative control: the similarity rounded to bf16 before the scale is off by far more.
    rounded = _bf16(_bf16(img) @ _bf16(txt).T) * scale
    assert np.abs(rounded - want).max() > 1e-2


def test_inspect_policy_reports_the_contrastive_head():
    img, txt = _embeddings()
    p = {"logit_scale": jnp.log(jnp.float32(100.0))}
    report = inspect_policy(with_policy(_logits, "bf16-mixed"), p, img, txt)
    assert report.matmuls(head=True) == [("", "bfloat16 x bfloat16 -> float32")]


def _clip_loss(p, images, texts):
    """Projections, L2-normalized embeddings, the similarity matmul as the head (marked), and
    the symmetric cross-entropy loss written inside the policied function."""
    img = images @ p["w_img"]
    txt = texts @ p["w_txt"]
    img = img / jnp.linalg.norm(img, axis=-1, keepdims=True)
    txt = txt / jnp.linalg.norm(txt, axis=-1, keepdims=True)
    logits = mark_head((img @ txt.T) * jnp.exp(p["logit_scale"]))
    labels = jnp.arange(logits.shape[0])
    li = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=1), labels[:, None], 1)
    lt = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=0), labels[None, :], 0)
    return (jnp.mean(li) + jnp.mean(lt)) / 2


def test_mark_head_on_the_contrastive_logits():
    k = jax.random.split(jax.random.key(1), 4)
    p = {"w_img": jax.random.normal(k[0], (32, 16)), "w_txt": jax.random.normal(k[1], (24, 16)),
         "logit_scale": jnp.log(jnp.float32(100.0))}
    images, texts = jax.random.normal(k[2], (8, 32)), jax.random.normal(k[3], (8, 24))
    f = with_policy(_clip_loss, "bf16-mixed")
    report = inspect_policy(f, p, images, texts)
    # The head is the similarity matmul (two activations: [8, 16] x [8, 16]ᵀ, 2 * 8 * 8 * 16
    # FLOPs), the two projections are not.
    fwd = [m for m in report.matmul_ops if m.kind == "forward"]
    assert sorted((m.head, m.projection, m.dtypes, m.flops) for m in fwd) == [
        (False, True, "bfloat16 x bfloat16 -> bfloat16", 2 * 8 * 16 * 24),
        (False, True, "bfloat16 x bfloat16 -> bfloat16", 2 * 8 * 16 * 32),
        (True, False, "bfloat16 x bfloat16 -> float32", 2 * 8 * 8 * 16)]
    grads = jax.grad(f)(p, images, texts)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
