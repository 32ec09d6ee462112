"""The GPU's Triton kernels against float64 references: float32 in Triton's interpreter on the CPU, bfloat16 (and
float32) on a CUDA device (MINI_INFER_TEST_DEVICE=cuda). Outputs are poisoned first and unwritten cache slots hold
NaN, so an unwritten output or a read past a context shows."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEVICE
from mini_infer.kernels.triton import attention, fused

DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]
# Relative error ||out - ref|| / ||ref|| allowed: float32 arithmetic, and bf16 operands (METHOD.md's ranges).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def nan_caches(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype):
    """K and V caches of NaN: fill_context writes the slots a context reaches."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]


def fill_context(caches, block_table: list[int], length: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V for the first `length` tokens of a request whose blocks are `block_table`: float64 [length, kv_heads,
    head_dim] each, written (rounded) into the caches."""
    k_cache, v_cache = caches
    _, block_size, kv_heads, head_dim = k_cache.shape
    keys, values = (torch.randn(length, kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    for i in range(length):
        block, offset = block_table[i // block_size], i % block_size
        k_cache[block, offset] = keys[i].to(k_cache.dtype)
        v_cache[block, offset] = values[i].to(v_cache.dtype)
    rounded = [t.to(k_cache.dtype).double() for t in (keys, values)]
    return rounded[0], rounded[1]


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> torch.Tensor:
    """float64 causal attention of queries [Lq, heads, D] at positions first_position.. over keys/values [L, kv, D]."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    v = values.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(q.shape[2])
    positions = first_position + torch.arange(q.shape[0])
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > positions[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, block_size, splits", [
    (4, 2, 4, 1), (7, 1, 16, 2), (6, 6, 4, 4), (8, 2, 16, 16)])
def test_decode_matches_reference(dtype, heads, kv_heads, block_size, splits):
    """GQA groups of 1, 2, 4 and 7 (padded to 16 rows), contexts of 0 (a padded row: zeros), one token, a block's
    edge and past one context tile (64), random block tables, split or not."""
    gen = torch.Generator().manual_seed(heads * 100 + splits)
    head_dim, contexts = 16, [1, block_size, 0, 70 if DEVICE == "cpu" else 1500, 9]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 3
    caches = nan_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-c // block_size) for c in contexts)
    tables, refs, q = [], [], torch.randn(len(contexts), heads, head_dim, generator=gen, dtype=torch.float64)
    for length in contexts:
        blocks = [order.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))
        keys, values = fill_context(caches, blocks, length, gen)
        refs.append(reference_attention(q[len(refs):len(refs) + 1], keys, values, length - 1)[0] if length
                    else torch.zeros(heads, head_dim, dtype=torch.float64))
    out = torch.full((len(contexts), heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    attention.paged_decode(q.to(dtype).to(DEVICE), *caches, torch.tensor(tables, device=DEVICE),
                           torch.tensor(contexts, device=DEVICE), splits, out=out)
    assert not out.isnan().any()
    assert torch.equal(out[2].cpu(), torch.zeros(heads, head_dim, dtype=dtype))
    assert relative_error(out, torch.stack(refs)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (7, 1)])
def test_prefill_over_a_cached_prefix_matches_reference(dtype, heads, kv_heads):
    """A packed batch: a decode row first (left to the decode kernel, its output row untouched), then prompt chunks
    over cached prefixes (context longer than the chunk), a whole prompt, and a chunk longer than one 64-row tile."""
    gen = torch.Generator().manual_seed(heads)
    head_dim, block_size = 32, 4
    query_lens, contexts = [1, 3, 9, 70, 5], [6, 20, 9, 75, 5]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 2
    caches = nan_caches(num_blocks, block_size, kv_heads, head_dim, dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-c // block_size) for c in contexts)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen, dtype=torch.float64)
    tables, refs = [], []
    for r, (n, length) in enumerate(zip(query_lens, contexts)):
        blocks = [order.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [0] * (width - len(blocks)))
        keys, values = fill_context(caches, blocks, length, gen)
        refs.append(reference_attention(q[starts[r]:starts[r + 1]], keys, values, length - n))
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    query_start = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    attention.paged_prefill(q.to(dtype).to(DEVICE), *caches, torch.tensor(tables, device=DEVICE),
                            torch.tensor(contexts, device=DEVICE), query_start, 1, len(contexts) - 1,
                            max(query_lens[1:]), out)
    assert out[0].isnan().all()
    assert not out[1:].isnan().any()
    assert relative_error(out[1:], torch.cat(refs[1:])) < TOLERANCE[dtype]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_kv_write_matches_reference(dtype, qk_norm):
    """q rotated, k rotated and v stored at their slots (Qwen3's per-head norms first where given); a row of slot -1
    stores nothing, and no other slot is touched."""
    gen = torch.Generator().manual_seed(int(qk_norm))
    tokens, heads, kv_heads, head_dim, eps = 5, 6, 2, 32, 1e-6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen, dtype=torch.float64).to(dtype)
    positions = torch.tensor([0, 3, 17, 4, 30])
    slots = torch.tensor([0, 7, -1, 13, 2])
    table = torch.arange(40)[:, None] * 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)[None, :]
    cos, sin = (torch.cat((f(table), f(table)), -1).to(dtype) for f in (torch.cos, torch.sin))
    weights = [torch.randn(head_dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2)]
    k_cache, v_cache = (torch.full((4, 4, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
                        for _ in range(2))
    q = fused.rope_kv_write(qkv.to(DEVICE), positions.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), k_cache, v_cache,
                            slots.to(DEVICE), heads, *((w.to(DEVICE) for w in weights) if qk_norm else (None, None)),
                            eps=eps)
    q_ref, k_ref, v_ref = qkv.double().split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), -1)
    q_ref, k_ref = q_ref.view(tokens, heads, head_dim), k_ref.view(tokens, kv_heads, head_dim)
    if qk_norm:
        q_ref, k_ref = (w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                        for x, w in zip((q_ref, k_ref), weights))
    cos_rows, sin_rows = (t[positions].double()[:, None] for t in (cos, sin))
    assert relative_error(q, rotate(q_ref, cos_rows, sin_rows)) < TOLERANCE[dtype]
    stored = slots >= 0
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim).cpu(), v_cache.view(-1, kv_heads, head_dim).cpu()
    assert relative_error(flat_k[slots[stored]], rotate(k_ref, cos_rows, sin_rows)[stored]) < TOLERANCE[dtype]
    assert torch.equal(flat_v[slots[stored]], v_ref.view(tokens, kv_heads, head_dim)[stored].to(dtype))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots[stored]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(dtype, with_residual):
    gen = torch.Generator().manual_seed(2)
    x, residual, weight = (torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
                           for shape in ((3, 200), (3, 200), (200,)))
    out, summed = fused.add_rms_norm(x.to(DEVICE), residual.to(DEVICE) if with_residual else None,
                                     weight.to(DEVICE), 1e-6)
    total = x.double() + residual.double() if with_residual else x.double()
    ref = weight.double() * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert relative_error(out, ref) < TOLERANCE[dtype]
    assert torch.equal(summed.cpu(), (x + residual) if with_residual else x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    """A width past one program's block (1024), ending mid-block."""
    gate_up = torch.randn(2, 2 * 1100, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert relative_error(fused.silu_mul(gate_up.to(DEVICE)), torch.nn.functional.silu(gate) * up) < TOLERANCE[dtype]


def test_decode_splits_fill_the_device():
    """Parts per context double while the grid stays under two waves, up to 16."""
    assert attention.decode_splits(1, 2, 132) == 16
    assert attention.decode_splits(32, 2, 132) == 4
    assert attention.decode_splits(256, 2, 132) == 1
    assert attention.decode_splits(8, 4, 132) == 8


def test_kernels_refuse_shapes_they_do_not_compute():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    cache = torch.zeros(3, 4, 2, 16, device=DEVICE)
    tables, lens = torch.zeros(2, 1, dtype=torch.int64, device=DEVICE), torch.ones(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        attention.paged_decode(q, cache, cache, tables, lens, 3)
    with pytest.raises(ValueError, match="head_dim 24 must be a power of two"):
        attention.paged_decode(torch.zeros(2, 4, 24), *[torch.zeros(3, 4, 2, 24)] * 2, tables, lens)
    with pytest.raises(ValueError, match=r"heads a multiple of kv_heads"):
        attention.paged_decode(torch.zeros(2, 3, 16, device=DEVICE), cache, cache, tables, lens)
    with pytest.raises(ValueError, match="rope_kv_write: qkv"):
        fused.rope_kv_write(torch.zeros(2, 100, device=DEVICE), lens, cache[0, 0], cache[0, 0], cache, cache, lens, 4)
    with pytest.raises(ValueError, match="silu_mul: gate_up"):
        fused.silu_mul(torch.zeros(2, 7, device=DEVICE))
