"""Triton device functions shared by several kernel families."""

import triton
import triton.language as tl


@triton.jit
def softplus(z):
    """torch.nn.functional.softplus (beta=1, threshold=20). log1p is written out
    (Goldberg's trick) because log(1 + u) drops the digits of small u, the common case for
    dt (softplus(dt_bias) ~ 1e-3 .. 1e-1)."""
    u = tl.exp(tl.minimum(z, 20.0))
    w = 1.0 + u
    den = tl.where(w == 1.0, 1.0, w - 1.0)
    lp = tl.where(w == 1.0, u, tl.log(w) * (u / den))
    return tl.where(z > 20.0, z, lp)
