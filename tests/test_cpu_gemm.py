"""The cpu_gemm kernel against a float64 matmul of the same weights, over every tile and tail shape."""

from __future__ import annotations

import pytest
import torch

from mini_infer.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(cpu_gemm.unavailable_reason() is not None,
                                reason=f"cpu_gemm unavailable: {cpu_gemm.unavailable_reason()}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


# M covers full 4-row tiles and 1-3 row tails and several L2 passes (m_chunk is 64 rows at K=896); N covers
# 3-column tiles and 1-2 column tails; K covers the 8-wide body and scalar tails.
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,cols,inner", [(1, 1, 1), (1, 7, 9), (2, 5, 16), (3, 3, 8), (4, 2, 31), (5, 10, 64),
                                             (7, 11, 100), (9, 4, 7), (16, 896, 896), (70, 13, 896),
                                             (130, 151, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_matmul(weight_dtype, rows, cols, inner, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + cols * 10 + inner)
    x = torch.randn(rows, inner, generator=gen)
    weight = torch.randn(cols, inner, generator=gen).to(weight_dtype)
    bias = torch.randn(cols, generator=gen).to(weight_dtype) if with_bias else None
    out = cpu_gemm.linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, cols)
    expected = reference(x, weight, bias)
    # float32 accumulation over `inner` products: error grows like sqrt(inner) * eps * |terms|.
    scale = (x.double().abs() @ weight.double().abs().T).max().item() + 1.0
    assert (out.double() - expected).abs().max().item() <= 4e-7 * inner**0.5 * scale


def test_bfloat16_activations_come_back_in_bfloat16():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    out = cpu_gemm.linear(x, weight)
    assert out.dtype == torch.bfloat16
    expected = reference(x, weight, None)
    torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)


def test_non_contiguous_input_is_read_correctly():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 6, generator=gen).T  # [6, 64], transposed view
    weight = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(cpu_gemm.linear(x, weight).double(), reference(x, weight, None), rtol=1e-5, atol=1e-5)


def test_rejects_weights_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous CPU bfloat16/float32 weight"):
        cpu_gemm.linear(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous CPU bfloat16/float32 weight"):
        cpu_gemm.linear(torch.randn(2, 4), torch.randn(4, 3).T)
    with pytest.raises(ValueError, match="does not match weight"):
        cpu_gemm.linear(torch.randn(2, 5), torch.randn(3, 4))


def test_build_failure_names_the_compiler_error(tmp_path, monkeypatch):
    from mini_infer.kernels.build import KernelUnavailable, build_library

    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with pytest.raises(KernelUnavailable, match="failed to build broken.cpp"):
        build_library(source, ["-O1"])
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler 'no-such-compiler'"):
        build_library(source, ["-O1"])
