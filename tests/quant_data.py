"""Test inputs shared by the quantizer tests (reference and Pallas)."""

import jax
import jax.numpy as jnp
import numpy as np


def random_groups(seed: int, shape: tuple[int, ...], dtype, zero_frac: float = 0.1) -> jax.Array:
    """Gaussian groups of 64 whose magnitudes span 2**-30..2**12 (float16-subnormal scales
    included), some all-zero, and a few exact ties (x = (k + 1/2) * s)."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((*shape[:-1], shape[-1] // 64, 64))
    g *= np.exp2(rng.uniform(-30, 12, g.shape[:-1] + (1,)))
    g[rng.random(g.shape[:-1]) < zero_frac] = 0.0
    if dtype == jnp.float32 and g.size >= 128:  # exact ties: max 127 s, one element at 2.5 s
        s = np.float64(np.float16(0.03125))
        g.reshape(-1, 64)[0, :2] = [127 * s, -2.5 * s]
    return jnp.asarray(g.reshape(shape), dtype)


def extreme_groups(bits: int, dtype) -> jax.Array:
    """Rows of 64 at the edges of the contract: zeros and -0.0, float16-subnormal and zero scales,
    a subnormal tie (a / qmax = 6.5 * 2**-24), scale ties, exact code ties, a negative max, the
    largest group that does not overflow, and bfloat16/float32 subnormal elements. [R, 64]"""
    qmax = {8: 127, 4: 7}[bits]
    limit = np.nextafter(np.float32(65520.0 * qmax), np.float32(0))
    if dtype == jnp.bfloat16:  # truncate to the largest bfloat16 below the overflow point
        limit = (limit.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    rows = [np.zeros(64), -np.zeros(64)]
    for a in (qmax * 2.0**-25 * np.array([0.99, 1.0, 1.01, 1.5, 3.0])).tolist() + [
            qmax * 6.5 * 2.0**-24, qmax * (1 + 2.0**-11), float(limit), 1e-39]:
        r = np.linspace(-1.0, 1.0, 64) * a
        r[7] = a
        rows.append(r)
    s = np.float64(np.float16(0.3))
    ties = np.zeros(64)
    ties[0] = -qmax * s
    m = min(qmax, 63)
    ties[1:m + 1] = (np.arange(m) + 0.5) * s
    rows.append(ties)
    return jnp.asarray(np.stack(rows), dtype)
