"""The fused native kernels (kernels/fused.py) against the torch ops they replace, and the model with them against
the model without."""

from __future__ import annotations

import pytest
import torch

from mini_infer import LLM, SamplingParams
from mini_infer.kernels import fused
from mini_infer.model.attention import write_kv
from mini_infer.model.layers import RMSNorm, RotaryEmbedding, experts_sum, route_experts, silu_and_mul

# Only a CPU without AVX2 skips: anywhere else a kernel that fails to build must fail these tests.
pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the native kernels need AVX2 + FMA")
DTYPES = [torch.float32, torch.bfloat16]


def random(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# Rows of 1+, hidden sizes with vector tails (15, 97), torch's cascaded sum (4096, 20000: 16-vector chunks summed
# in levels) and enough rows for several threads (40 x 1536).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 896), (1, 15), (3, 64), (5, 97), (2, 4096), (40, 1536), (7, 20000)])
def test_rms_norm_and_residual_add_equal_torch_bit_for_bit(dtype, rows, hidden):
    norm = RMSNorm(hidden, 1e-6, dtype=dtype, device="cpu")
    norm.weight.data = 1.0 + random(hidden, seed=hidden, dtype=dtype, scale=0.2)
    x = random(rows, hidden, seed=rows, dtype=dtype, scale=3.0)
    residual = random(rows, hidden, seed=rows + 1, dtype=dtype)
    assert torch.equal(fused.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, stream = fused.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(stream, residual + x) and torch.equal(out, norm(residual + x))
    assert out.dtype == stream.dtype == dtype


def test_silu_and_mul_in_bfloat16_equals_torch_for_every_gate_value():
    """silu rounds to bfloat16 before the multiply, so each output is a function of one of the 65,536 bfloat16
    gates and the up value: over all gates (NaN and inf included) the kernel's exp, though not torch's (SLEEF),
    rounds the same everywhere."""
    gates = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate_up = torch.stack([gates, random(gates.numel(), seed=0, dtype=torch.bfloat16)]).view(1, -1)
    out, expected = fused.silu_mul(gate_up), silu_and_mul(gate_up)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
# Rows of 4,096+ elements split into 1,024-column pieces over the threads: 2,053 ends on a 5-column piece.
@pytest.mark.parametrize("rows,intermediate", [(1, 1), (1, 7), (3, 13), (2, 160), (17, 4864), (1, 8960), (3, 2053)])
def test_silu_and_mul_matches_torch(dtype, rows, intermediate):
    gate_up = random(rows, 2 * intermediate, seed=intermediate, dtype=dtype, scale=4.0)
    out, expected = fused.silu_mul(gate_up), silu_and_mul(gate_up)
    assert out.shape == (rows, intermediate) and out.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        # Two float32 exp implementations of about 1 ulp each (torch: SLEEF, or libm on a vector's tail): the
        # results may differ by a few ulps (2.2 at most measured over 200,000 gates), never more.
        torch.testing.assert_close(out, expected, rtol=4 * 2**-23, atol=0.0)


def torch_rope_kv_write(qkv, positions, rotary, k_cache, v_cache, slot_mapping, heads):
    """Today's torch path: split, rotate q and k, index_copy_ k and v into the caches."""
    _, _, kv_heads, head_dim = k_cache.shape
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k = rotary(positions, q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim))
    write_kv(k_cache, v_cache, k, v.reshape(-1, kv_heads, head_dim), slot_mapping)
    return q


# GQA and MHA, T = 1 up to several threads' worth of tokens, head dims whose halves are odd (10) or tiny (2).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 14, 2, 64), (5, 4, 1, 16), (33, 6, 6, 10),
                                                            (2, 2, 1, 2), (70, 14, 2, 64)])
def test_rope_and_kv_write_equal_torch_bit_for_bit(dtype, tokens, heads, kv_heads, head_dim):
    rotary = RotaryEmbedding(head_dim, 1e6, 4096, dtype=dtype, device="cpu")
    qkv = random(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens, dtype=dtype)
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    num_blocks, block_size = 30, 4
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    # The slots not written keep what they held: a marker value in both pairs of caches.
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype)
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = torch_rope_kv_write(qkv, positions, rotary, expected_k, expected_v, slot_mapping, heads)
    q = fused.rope_kv_write(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slot_mapping, heads)
    assert q.shape == (tokens, heads, head_dim) and q.dtype == dtype
    assert torch.equal(q, expected_q) and torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def _rope_inputs():
    rotary = RotaryEmbedding(8, 1e4, 16, dtype=torch.float32, device="cpu")
    k_cache = torch.zeros(3, 4, 1, 8)
    return dict(qkv=torch.randn(2, 32), positions=torch.tensor([0, 15]), cos=rotary.cos, sin=rotary.sin,
                k_cache=k_cache, v_cache=k_cache.clone(), slot_mapping=torch.tensor([0, 11]), num_heads=2)


@pytest.mark.parametrize("spoil, message", [
    (lambda a: a.update(slot_mapping=torch.tensor([0, 12])), "slots in \\[0, 12\\] \\(must be in \\[0, 11\\]\\)"),
    (lambda a: a.update(slot_mapping=torch.tensor([-1, 3])), "slots in \\[-1, 3\\]"),
    (lambda a: a.update(positions=torch.tensor([0, 16])), "positions in \\[0, 16\\] \\(must be in \\[0, 15\\]\\)"),
    (lambda a: a.update(positions=torch.tensor([-2, 1])), "positions in \\[-2, 1\\]"),
    (lambda a: a.update(slot_mapping=torch.tensor([0, 1, 2])), "slot mapping \\(3,\\)"),
    (lambda a: a.update(num_heads=3), "qkv \\(2, 32\\).*for 3 heads"),
    (lambda a: a.update(v_cache=a["v_cache"].to(torch.bfloat16)), "caches"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
])
def test_rope_kv_write_refuses_inputs_that_would_write_outside_the_caches(spoil, message):
    args = _rope_inputs()
    fused.rope_kv_write(**args)  # the unspoilt inputs run
    spoil(args)
    with pytest.raises(ValueError, match=message):
        fused.rope_kv_write(**args)


def test_norm_and_activation_refuse_mismatched_tensors():
    with pytest.raises(ValueError, match="add_rms_norm: .*all \\[T, H\\] and of one dtype"):
        fused.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: .*weight \\(7,\\)"):
        fused.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="silu_mul: gate_up \\(2, 7\\)"):
        fused.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2048), (3, 2, 97), (8, 8, 64), (40, 4, 1536)])
def test_experts_sum_equals_torchs_index_add_bit_for_bit(dtype, tokens, top_k, hidden):
    """A mixture's weighted sum of its experts' rows (model/moe.py): the native pass rounds each product where
    torch's mul does and sums a token's rows in y's order as its index_add_ does (in float32 for bfloat16, rounded
    once), here over a random grouping; a row of -0.0 products starts from torch's +0.0 sum."""
    gen = torch.Generator().manual_seed(tokens * top_k)
    experts = torch.stack([torch.randperm(16, generator=gen)[:top_k] for _ in range(tokens)])
    order = experts.flatten().argsort(stable=True)
    y = random(tokens * top_k, hidden, seed=hidden, dtype=dtype, scale=5.0)
    y[0] = -0.0
    weights = torch.rand(tokens * top_k, generator=gen).to(dtype)
    out = fused.moe_combine(y, weights, order, top_k, tokens)
    expected = experts_sum(y, weights, order, top_k, tokens)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert out.dtype == dtype and torch.equal(out.view(bits), expected.view(bits))  # the zeros' signs too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 32, 4, 128), (3, 4, 2, 16), (40, 6, 6, 64)])
def test_rms_norm_heads_in_place_equals_the_norm_of_each_head_as_a_row(dtype, tokens, heads, kv_heads, head_dim):
    """Qwen3's q/k norms in one native call, in place over qkv: each query head as q_norm and each key head as
    k_norm computes it on that head as a row, the values untouched."""
    q_norm, k_norm = (RMSNorm(head_dim, 1e-6, dtype=dtype, device="cpu") for _ in range(2))
    q_norm.weight.data = 1.0 + random(head_dim, seed=1, dtype=dtype, scale=0.2)
    k_norm.weight.data = 1.0 + random(head_dim, seed=2, dtype=dtype, scale=0.2)
    qkv = random(tokens, (heads + 2 * kv_heads) * head_dim, seed=tokens, dtype=dtype, scale=3.0)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    expected = qkv.clone()
    expected[:, :q_size] = q_norm(qkv[:, :q_size].reshape(-1, head_dim)).view(tokens, -1)
    keys = slice(q_size, q_size + kv_size)
    expected[:, keys] = k_norm(qkv[:, keys].reshape(-1, head_dim)).view(tokens, -1)
    fused.rms_norm_heads(qkv, q_norm.weight, k_norm.weight, heads, kv_heads, 1e-6)
    assert torch.equal(qkv, expected)
    with pytest.raises(ValueError, match="rms_norm_heads: qkv"):
        fused.rms_norm_heads(qkv[:, 1:], q_norm.weight, k_norm.weight, heads, kv_heads, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,norm", [(1, 128, 8, True), (3, 16, 2, False), (40, 64, 4, True),
                                                       (600, 8, 8, True)])
def test_routing_equals_softmax_top_k_and_a_stable_sort(dtype, tokens, experts, top_k, norm):
    """A mixture's routing in one native pass (model/moe.py): the same experts, grouped in the same order, as the
    float32 softmax, top-k and stable sort of layers.route_experts; the weights as close as the two exp
    implementations allow (1e-6 relative in float32, the same bfloat16 or its neighbour). Each row's scores are
    distinct multiples of 1/16 (exact in bfloat16): torch's top-k orders equal values arbitrarily. 600 tokens x 8
    experts runs on both threads."""
    gen = torch.Generator().manual_seed(experts + tokens)
    scores = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).sub(experts / 2).div(16)
    scores = scores.to(dtype)
    weights, order, rows, counts = fused.moe_route(scores, top_k, norm)
    want_weights, want_order, want_rows, want_counts = route_experts(scores, top_k, norm)
    assert (order.tolist(), rows.tolist(), counts) == (want_order.tolist(), want_rows.tolist(), want_counts)
    assert weights.dtype == dtype and weights.shape == want_weights.shape
    if dtype == torch.float32:
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    else:
        steps = (weights.view(torch.int16).int() - want_weights.view(torch.int16).int()).abs()
        assert int(steps.max()) <= 1
    with pytest.raises(ValueError, match="moe_route: the router's scores hold NaN"):
        fused.moe_route(torch.where(scores == scores.max(), float("nan"), scores), top_k, norm)
    with pytest.raises(ValueError, match=f"top_k {experts + 1}"):
        fused.moe_route(scores, experts + 1, norm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_takes_the_lower_expert_of_equal_scores(dtype):
    """Equal router scores (common in bfloat16) at the top-k boundary: the lower expert index is chosen, and comes
    first among equals."""
    scores = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    weights, order, rows, counts = fused.moe_route(scores, 3, True)
    assert counts == [1, 2, 2, 1, 0, 0]  # token 0: experts 1, 3, 2 (pairs 0-2); token 1: experts 0, 1, 2 (pairs 3-5)
    assert order.tolist() == [3, 0, 4, 2, 5, 1] and rows.tolist() == [1, 0, 1, 0, 1, 0]
    assert weights[0] == weights[1] > weights[2] and torch.all(weights[3:] == weights[3])


def test_experts_sum_refuses_an_order_outside_the_routing():
    y, weights = torch.randn(4, 16), torch.rand(4)
    with pytest.raises(ValueError, match=r"order entries in \[0, 4\] \(must be in \[0, 3\]\)"):
        fused.moe_combine(y, weights, torch.tensor([0, 1, 4, 2]), 2, 2)
    with pytest.raises(ValueError, match="for 2 tokens of 2 experts"):
        fused.moe_combine(y, torch.rand(3), torch.tensor([0, 1, 2, 3]), 2, 2)


# Ties (the first wins), NaN (the first NaN wins, over +inf), all -inf, rows sliced from wider ones (a padded
# vocabulary), lengths around the kernel's 32-value steps and a real vocabulary's 151,936.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,columns", [(1, 1), (3, 7), (4, 31), (4, 32), (4, 33), (5, 100), (32, 151936)])
def test_argmax_equals_torch(dtype, rows, columns):
    x = random(rows, columns + 5, seed=columns, dtype=dtype)[:, :columns]
    x[0, columns // 2] = x[0].max()
    if rows > 1:
        x[1, 0], x[1, -1] = float("inf"), float("nan")
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3 and columns > 2:
        x[3, 1], x[3, 2] = float("nan"), float("nan")
    out = fused.argmax(x)
    assert out.dtype == torch.int64 and torch.equal(out, x.argmax(dim=-1))


def test_argmax_refuses_what_it_cannot_read():
    for x, message in ((torch.randn(2, 8).t(), "each row contiguous"), (torch.randn(8), "\\(8,\\)"),
                       (torch.randn(2, 0), "C > 0"), (torch.randn(2, 8).double(), "float64")):
        with pytest.raises(ValueError, match=message):
            fused.argmax(x)


def reference_top_k(x, ks, edit_ids, edit_values):
    """The edits written into a float32 copy (an id past the row dropped; of two at one id the lower), then a stable
    descending sort (NaN first, equal values in index order), each row's first ks[r] kept and padded."""
    rows, columns = x.shape
    edited = x.float().clone()
    for r in range(rows):
        lowest: dict[int, float] = {}
        for i, v in zip(edit_ids[r].tolist(), edit_values[r].tolist()):
            lowest[i] = min(v, lowest.get(i, v))
        for i, v in lowest.items():
            if i < columns:
                edited[r, i] = v
    order = edited.sort(dim=-1, descending=True, stable=True).indices
    k_max = int(ks.max())
    values, ids = torch.full((rows, k_max), float("-inf")), torch.empty(rows, k_max, dtype=torch.int64)
    for r in range(rows):
        k = int(ks[r])
        ids[r, :k] = order[r, :k]
        ids[r, k:] = order[r, 0]
        values[r, :k] = edited[r, order[r, :k]]
    return values, ids


# Ties (the lower index first), NaN (above +inf), -inf, rows sliced from wider ones, k from 1 to the whole row, edits
# at duplicate ids (the lower value), past the row (padding), of -inf; lengths around the kernel's 8-value steps and a
# real vocabulary with the model's top_k 20.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,columns,k_max", [(1, 1, 1), (3, 7, 7), (4, 9, 3), (5, 33, 20), (6, 100, 64),
                                                (32, 151936, 20)])
@pytest.mark.parametrize("num_edits", [0, 5])
def test_top_k_equals_a_stable_sort_of_the_edited_rows(dtype, rows, columns, k_max, num_edits):
    gen = torch.Generator().manual_seed(rows * columns + num_edits)
    x = random(rows, columns + 3, seed=columns, dtype=dtype)[:, :columns]
    if rows > 1:
        x[1, 0], x[1, -1] = float("inf"), float("nan")
    if rows > 2:
        x[2] = 0.5  # all equal: ids in order
    if rows > 3:
        x[3, : columns // 2] = float("-inf")
    ks = torch.randint(1, k_max + 1, (rows,), generator=gen)
    ks[0] = k_max
    edit_ids = torch.randint(0, columns + 2, (rows, num_edits), generator=gen)
    edit_values = torch.randn(rows, num_edits, generator=gen) * 3
    if num_edits and columns > 1:
        edit_ids[0, :2] = 1  # the same id twice: the lower value counts
        edit_values[0, 0], edit_values[0, 1] = 2.0, -4.0
        edit_values[-1, -1] = float("-inf")
    values, ids = fused.top_k(x, ks, edit_ids, edit_values)
    expected_values, expected_ids = reference_top_k(x, ks, edit_ids, edit_values)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ids, expected_ids)


def test_top_k_refuses_what_it_cannot_read_and_writes_nothing():
    x, none = torch.randn(2, 8), torch.zeros(2, 0, dtype=torch.int64)
    for args, message in (((x.t(), torch.ones(8, dtype=torch.int64), none, none.float()), "each row contiguous"),
                          ((x.double(), torch.ones(2, dtype=torch.int64), none, none.float()), "float64"),
                          ((x, torch.ones(3, dtype=torch.int64), none, none.float()), "ks \\(3,\\) must be \\[R\\]"),
                          ((x, torch.tensor([1, 0]), none, none.float()), "ks in \\[0, 1\\] must be in \\[1, 8\\]"),
                          ((x, torch.tensor([9, 1]), none, none.float()), "ks in \\[1, 9\\] must be in \\[1, 8\\]"),
                          ((x, torch.tensor([2, 2]), torch.tensor([[0], [-1]]), torch.zeros(2, 1)),
                           "edit ids from -1 must be >= 0")):
        with pytest.raises(ValueError, match=message):
            fused.top_k(*args)


def torch_rms_norm(x, weight, eps):
    norm = RMSNorm(weight.shape[0], eps, dtype=weight.dtype, device="cpu")
    norm.weight.data = weight
    return norm(x)


def prefill_logits(model_dir, dtype: str) -> torch.Tensor:
    llm = LLM(str(model_dir), dtype=dtype, cpu_kernels="on", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    outputs = llm.generate([[5, 9, 2, 77, 31], [100, 3]], params, use_tqdm=False)
    return torch.tensor([[lp.logprob for lp in o.outputs[0].logprobs[0].values()] for o in outputs])


def test_model_with_fused_kernels_equals_the_torch_ops_bit_for_bit_in_bfloat16(tiny_model_dir, monkeypatch):
    """The same native matmuls either way; only the fused norm, activation and RoPE/KV write are swapped for
    their torch ops, which they reproduce exactly in bfloat16 (the residual stream included)."""
    fused_logprobs = prefill_logits(tiny_model_dir, "bfloat16")
    monkeypatch.setattr(fused, "add_rms_norm", lambda x, residual, w, eps: (torch_rms_norm(x + residual, w, eps),
                                                                            x + residual))
    monkeypatch.setattr(fused, "rms_norm", torch_rms_norm)
    monkeypatch.setattr(fused, "silu_mul", silu_and_mul)
    monkeypatch.setattr(fused, "rope_kv_write", lambda qkv, positions, cos, sin, *rest: torch_rope_kv_write(
        qkv, positions, _Rotary(cos, sin), *rest))
    assert torch.equal(prefill_logits(tiny_model_dir, "bfloat16"), fused_logprobs)


class _Rotary:
    """A RotaryEmbedding's forward over given tables."""

    def __init__(self, cos, sin):
        self.cos, self.sin = cos, sin

    def __call__(self, positions, q, k):
        return RotaryEmbedding.forward(self, positions, q, k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_with_native_kernels_equal_torch_ops(tiny_model_dir, dtype):
    prompts = [[5, 9, 2, 77, 31, 8, 1], [100, 3], [42]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for mode in ("on", "off"):
        llm = LLM(str(tiny_model_dir), dtype=dtype, cpu_kernels=mode, block_size=4)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["on"] == tokens["off"]


def test_native_prefill_attention_over_chunks_and_cached_prefixes_equals_torch_ops(tiny_model_dir):
    """float32: prompts prefilled in chunks of a 16-token budget and a second wave that starts from the first's
    cached prefixes, so the native prefill attention runs with queries after earlier context (Lq < context) as well
    as whole prompts; tokens and top-5 logprobs match torch's SDPA path (cpu_kernels off)."""
    shared = [(7 * i + 3) % 500 for i in range(29)]
    first = [shared + [11, 12], [5, 9, 2, 77, 31, 8, 1, 4, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
    second = [shared + [13], shared[:20] + [60, 61, 62]]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    results, counts = {}, {}
    for mode in ("on", "off"):
        llm = LLM(str(tiny_model_dir), dtype="float32", cpu_kernels=mode, block_size=4, max_num_batched_tokens=16)
        runs = [llm.generate(prompts, params, use_tqdm=False) for prompts in (first, second)]
        results[mode] = [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs])
                         for run in runs for o in run]
        counts[mode] = llm.engine.kv_cache.prefix_hits
    assert counts["on"] > 0 and counts["on"] == counts["off"]  # the second wave did start from cached prefixes
    for (tokens_on, logprobs_on), (tokens_off, logprobs_off) in zip(results["on"], results["off"]):
        assert tokens_on == tokens_off
        for step_on, step_off in zip(logprobs_on, logprobs_off):
            assert [token for token, _ in step_on] == [token for token, _ in step_off]
            assert [lp.logprob for _, lp in step_on] == pytest.approx([lp.logprob for _, lp in step_off], abs=1e-4)


def test_sampling_with_top_k_reads_the_logits_through_the_native_top_k(tiny_model_dir, monkeypatch):
    """With the native kernels the runner hands the sampler fused.top_k: seeded requests with top_k (penalties and
    min_tokens too) are drawn from its candidates, reproducibly; with cpu_kernels off it is never called."""
    calls = []
    native = fused.top_k
    monkeypatch.setattr(fused, "top_k", lambda *args: calls.append(1) or native(*args))
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1, min_tokens=3, seed=5,
                            max_tokens=8, ignore_eos=True)
    runs = {}
    for mode in ("on", "on", "off"):
        calls.clear()
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", cpu_kernels=mode, block_size=4)
        runs.setdefault(mode, []).append([o.outputs[0].token_ids for o in llm.generate([[5, 9, 2], [100, 3]], params,
                                                                                        use_tqdm=False)])
        assert (len(calls) == 8) if mode == "on" else not calls  # one call per decode step of the batch
    assert runs["on"][0] == runs["on"][1]
