"""The one-pass RMSNorm and rotary embedding against the torch expressions they stand in for: the
rotation bit for bit, the norm up to its sum of squares' order; where they must not apply (autograd,
other dtypes, reproducible numerics) the torch path runs instead."""
import pytest
import torch

from splash_rollout.models.norm import RMSNorm
from splash_rollout.models.numerics import numerics
from splash_rollout.models.rope import apply_rope
from splash_rollout.native import native_available
from splash_rollout.native.fused_rows import rms_norm, rope

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler for the native kernels")


def _torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xa = x.float()
    return weight * (xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(5, 3, 64), (300, 8, 64), (7, 64), (4, 2, 20)])
def test_rope_equals_the_torch_expression_bit_for_bit(dtype, interleaved, shape):
    g = torch.Generator().manual_seed(sum(shape))
    full = (torch.randn(*shape[:-1], shape[-1] + 16, generator=g) * 3).to(dtype)
    x = full[..., 16:]  # a strided view, as q_pe is of q
    n, half = shape[0], shape[-1] // 2
    cos, sin = (torch.randn(n, half, generator=g).to(dtype) for _ in range(2))
    y = rope(x, cos, sin, interleaved)
    assert y is not None and y.shape == x.shape and y.is_contiguous()
    assert torch.equal(y, _torch_rope(x, cos, sin, interleaved))
    assert torch.equal(apply_rope(x, cos, sin, interleaved), y)


@pytest.mark.parametrize("dtype,max_ulp", [(torch.float32, 4), (torch.bfloat16, 1)])
@pytest.mark.parametrize("rows,dim", [(4, 512), (300, 512), (3, 37)])
def test_rms_norm_matches_torch_to_a_few_ulp(dtype, max_ulp, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=g) * 4).to(dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    y, ref = rms_norm(x, weight, 1e-6), _torch_norm(x, weight, 1e-6)
    assert y is not None and y.dtype == dtype and y.shape == x.shape
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((y.float() - ref.float()).abs() <= max_ulp * ulp).all()
    assert (y == ref).float().mean() > 0.5  # most elements bit-identical: only the statistic's order differs


def test_rms_norm_keeps_leading_dims_and_strided_rows():
    x = torch.randn(6, 2, 40)[:, :, :32]  # rows evenly spaced, 40 apart
    weight = torch.rand(32) + 0.5
    y = rms_norm(x, weight, 1e-5)
    assert y.shape == (6, 2, 32)
    torch.testing.assert_close(y, _torch_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6)


def test_the_kernels_decline_what_they_do_not_do():
    x, w = torch.randn(4, 16), torch.rand(16)
    assert rms_norm(x.double(), w.double(), 1e-6) is None  # no float64 kernel
    assert rms_norm(x.bfloat16(), w, 1e-6) is None  # mixed dtypes: torch promotes, the kernel would not
    assert rms_norm(x.requires_grad_(), w, 1e-6) is None  # autograd needs the torch graph
    cos = sin = torch.randn(4, 8)
    assert rope(torch.randn(4, 16).requires_grad_(), cos, sin, True) is None
    assert rope(torch.randn(4, 16), cos.bfloat16(), sin.bfloat16(), True) is None
    assert rope(torch.randn(4, 2, 2, 16), cos, sin, True) is None  # only [N, d] and [N, H, d]


def test_rmsnorm_module_keeps_the_float64_statistic_under_reproducible_numerics(monkeypatch):
    norm = RMSNorm(32)
    x = torch.randn(3, 32)
    calls = []
    import splash_rollout.models.norm as norm_module
    monkeypatch.setattr(norm_module, "rms_norm", lambda *a: calls.append(a) or rms_norm(*a))
    with torch.no_grad():
        fast = norm(x)
        with numerics("reproducible"):
            exact = norm(x)
    assert len(calls) == 1  # only the fast call took the kernel
    xd = x.double()
    ref = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps)).float()
    assert torch.equal(exact, ref)
    torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)
