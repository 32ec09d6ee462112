"""The native CPU kernels against float64 references: each matmul path over every tile and tail shape, decode
attention over paged caches. A path this CPU lacks is skipped with the reason."""

from __future__ import annotations

import pytest
import torch

from mini_infer.kernels import cpu

# Only a CPU without AVX2 skips: anywhere else a kernel that fails to build must fail these tests.
pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the native kernels need AVX2 + FMA")


PATHS = tuple(cpu.MATMUL_PATHS)
BF16_ONLY = {path for path, spec in cpu.MATMUL_PATHS.items() if set(spec.kernels) == {torch.bfloat16}}


def skip_unless_runs(path: str, dtype: torch.dtype) -> None:
    why = cpu.matmul_paths(dtype)[path]
    if why is not None:
        pytest.skip(f"the {path} matmul does not run here: {why}")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


# M covers 1-5 rows (several panels per tile), 6-row tiles and every remainder; N covers whole and partial
# 16-column panels and panel groups with a remainder; K any length (odd: a bf16 pair's zero half).
SHAPES = [(1, 1, 1), (1, 7, 9), (1, 80, 64), (1, 200, 33), (2, 50, 16), (2, 120, 7), (3, 33, 8), (3, 110, 65),
          (4, 2, 31), (4, 90, 12), (5, 10, 64), (5, 70, 3), (6, 16, 5), (7, 11, 100), (9, 4, 7), (12, 64, 256),
          (16, 896, 896), (20, 100, 600), (23, 130, 513), (70, 13, 896), (130, 151, 40),
          # AMX tiles: 16 or 32 rows against 2-3 panels, 32 k per tile (K = 64: whole tiles; 600: 12 pairs past them)
          (8, 48, 64), (17, 80, 64), (32, 64, 600), (48, 40, 96), (33, 112, 32)]


@pytest.mark.parametrize("path,weight_dtype", [(path, dtype) for path in PATHS for dtype in cpu.DTYPES
                                               if dtype in cpu.MATMUL_PATHS[path].kernels])
@pytest.mark.parametrize("rows,cols,inner", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_matmul(path, weight_dtype, rows, cols, inner, with_bias):
    """float32 activations; on the avx512_bf16 paths (bf16 only) the activations are bf16 and the error is the
    output's rounding to bf16."""
    skip_unless_runs(path, weight_dtype)
    gen = torch.Generator().manual_seed(rows * 1000 + cols * 10 + inner)
    x = torch.randn(rows, inner, generator=gen)
    if path in BF16_ONLY:
        x = x.to(torch.bfloat16)
    weight = torch.randn(cols, inner, generator=gen).to(weight_dtype)
    bias = torch.randn(cols, generator=gen).to(weight_dtype) if with_bias else None
    out = cpu.linear(x, cpu.pack_weight(weight, cpu.weight_layout(path, weight.dtype)), bias, path)
    assert out.dtype == x.dtype and out.shape == (rows, cols)
    expected = reference(x, weight, bias)
    scale = (x.double().abs() @ weight.double().abs().T).max().item() + 1.0
    error = (out.double() - expected).abs()
    if x.dtype == torch.bfloat16:
        # bf16 products are exact in float32; the sum's float32 error is far below the output's bf16 rounding
        # (half an ulp: 2**-8 of the value), which bounds the difference.
        assert (error <= expected.abs() * 2**-8 + 1e-6 * inner**0.5 * scale).all()
    else:
        # float32 accumulation over `inner` products: error grows like sqrt(inner) * eps * |terms|.
        assert error.max().item() <= 4e-7 * inner**0.5 * scale


@pytest.mark.parametrize("path", PATHS)
def test_bfloat16_activations_come_back_in_bfloat16(path):
    skip_unless_runs(path, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    out = cpu.linear(x, cpu.pack_weight(weight, cpu.weight_layout(path, weight.dtype)), None, path)
    assert out.dtype == torch.bfloat16
    expected = reference(x, weight, None)
    torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", [path for path in PATHS if path.endswith("/far")])
@pytest.mark.parametrize("rows", [1, 4, 8, 33])
def test_far_prefetch_computes_what_near_does(path, rows):
    """The /far paths differ from their kernel's near path only in what they prefetch: the same sums, bit for bit."""
    near = path.removesuffix("/far")
    for dtype in cpu.MATMUL_PATHS[path].kernels:
        skip_unless_runs(path, dtype)
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 1100, generator=gen).to(torch.bfloat16 if path in BF16_ONLY else torch.float32)
        weight = torch.randn(300, 1100, generator=gen).to(dtype)
        packed = cpu.pack_weight(weight, cpu.weight_layout(path, dtype))
        assert torch.equal(cpu.linear(x, packed, weight[0], path), cpu.linear(x, packed, weight[0], near))


def test_nan_and_ties_round_like_torch():
    """The AVX-512 kernels round their float32 sums to bf16 as torch does (nearest even, NaN stays NaN)."""
    skip_unless_runs("avx512", torch.bfloat16)
    # One input column and a weight of one: the output is x itself, after the kernel's float32 -> bf16 rounding.
    x = torch.tensor([[1.0 + 2**-8], [1.0 + 3 * 2**-8], [float("nan")], [-3.0 - 2**-7 - 2**-9]]).to(torch.float32)
    weight = torch.ones(1, 1)
    out = cpu.linear(x.to(torch.bfloat16), cpu.pack_weight(weight.to(torch.bfloat16), "pairs"), None, "avx512")
    exact = cpu.linear(x, cpu.pack_weight(weight), None, "avx512").to(torch.bfloat16)
    assert torch.equal(out.isnan(), exact.isnan()) and torch.equal(out[:2], exact[:2])


def test_a_path_refuses_a_weight_of_another_layout():
    weight = torch.randn(20, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="on path 'avx512_bf16' does not match a panels torch.bfloat16 weight"):
        cpu.linear(torch.randn(2, 64).to(torch.bfloat16), cpu.pack_weight(weight), None, "avx512_bf16")
    with pytest.raises(ValueError, match="on path 'avx512' does not match a panels torch.bfloat16 weight"):
        cpu.linear(torch.randn(2, 64), cpu.pack_weight(weight), None, "avx512")
    with pytest.raises(ValueError, match="'pairs' for a bfloat16 weight"):
        cpu.pack_weight(weight.float(), "pairs")


def test_non_contiguous_input_is_read_correctly():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 6, generator=gen).T  # [6, 64], transposed view
    weight = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(cpu.linear(x, cpu.pack_weight(weight)).double(), reference(x, weight, None),
                               rtol=1e-5, atol=1e-5)


def test_rejects_weights_it_cannot_read():
    with pytest.raises(ValueError, match="packs 2-d CPU bfloat16/float32 weights"):
        cpu.pack_weight(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not match a panels torch.float32 weight of 3 x 4"):
        cpu.linear(torch.randn(2, 5), cpu.pack_weight(torch.randn(3, 4)))


@pytest.mark.parametrize("path", PATHS)
def test_linear_writes_into_a_given_buffer_what_it_returns_fresh(path):
    """`out` (the runner's reused logits buffer): the same bits as a fresh result, in the buffer's storage; a buffer
    of another shape, dtype or layout is refused by name before the kernel writes through its pointer."""
    dtype = torch.bfloat16 if path in BF16_ONLY else torch.float32
    skip_unless_runs(path, dtype)
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(70, 33, generator=gen).to(dtype)
    weight = cpu.pack_weight(dense, cpu.weight_layout(path, dtype))
    x = torch.randn(9, 33, generator=gen).to(dtype)
    buffer = torch.full((12, 70), float("nan"), dtype=dtype)
    out = cpu.linear(x, weight, None, path, out=buffer[:9])
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(out, cpu.linear(x, weight, None, path))
    assert buffer[9:].isnan().all()
    for bad in (buffer[:8], buffer[:9, :69], buffer[:9].to(torch.float64), buffer[:, :9].t()):
        with pytest.raises(ValueError, match=r"cpu linear: out .* is not a contiguous CPU \[9, 70\]"):
            cpu.linear(x, weight, None, path, out=bad)


def test_the_lm_head_writes_each_step_into_the_runners_one_buffer(tiny_model_dir):
    """On the CPU the logits of every step go into one buffer the runner keeps, grown (doubling) as the batch grows:
    a fresh [rows, vocab] tensor past glibc's mmap threshold is mapped, faulted in and unmapped every step. The
    tokens are those of fresh logits."""
    from mini_infer.engine.llm_engine import LLMEngine
    from mini_infer.sampling_params import SamplingParams

    def run(reuse: bool) -> tuple[dict[str, list[int]], list[bool], set[int]]:
        engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", max_num_seqs=8)
        runner, in_buffer, capacities = engine.runner, [], set()
        compute_logits = runner.model.compute_logits

        def recorded(x, residual, rows, out=None):
            logits = compute_logits(x, residual, rows, out if reuse else None)
            capacities.add(runner._logits.shape[0])
            in_buffer.append(runner._logits is not None
                             and logits.data_ptr() == runner._logits.data_ptr())
            return logits

        runner.model.compute_logits = recorded
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        tokens = {}
        for i in range(6):  # the batch grows by a request a step (1, 2, ... 6 rows), then drains
            engine.add_request(str(i), [7 + i, 300 + 11 * i, 42], params)
            tokens.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
        while engine.has_unfinished_requests():
            tokens.update((out.request_id, out.outputs[0].token_ids) for out in engine.step())
        return tokens, in_buffer, capacities

    reused, in_buffer, capacities = run(True)
    fresh, not_in_buffer, _ = run(False)
    assert reused == fresh and len(reused) == 6 and all(len(t) == 6 for t in reused.values())
    assert all(in_buffer) and len(in_buffer) > 6 and not any(not_in_buffer)
    assert capacities == {1, 2, 4, 8}


def test_an_unavailable_kernel_keeps_nothing_of_its_callers_alive(monkeypatch):
    """Why a kernel cannot run is kept as a message: a kept exception's traceback held the frames that asked for the
    kernel and everything they referenced (an engine's weights and KV cache stayed in memory after its shutdown, one
    whole engine more with each engine a process made: the 7B speculative bench ran out of memory on an AVX2 CPU)."""
    import gc
    import weakref

    from mini_infer.kernels.build import KernelUnavailable

    monkeypatch.setitem(cpu._KERNELS, "absent", cpu._Kernel("cpu_gemm.cpp", "gemm", [], None, [], ("no_such_flag",)))

    class Held:  # stands for what a caller's frame holds
        pass

    def ask(held: Held) -> None:
        with pytest.raises(KernelUnavailable, match="the CPU lacks no_such_flag"):
            cpu.native_function("absent")

    try:
        for _ in range(2):  # the first lookup tries to load it, the second reads the kept outcome
            held = Held()
            alive = weakref.ref(held)
            ask(held)
            del held
            gc.collect()
            assert alive() is None
    finally:
        cpu._outcomes.pop("absent", None)


def test_an_engine_shut_down_leaves_its_model_to_the_collector(tiny_model_dir):
    """(The engine freezes the heap it starts with, gc.freeze: a reference cycle from those objects to its own would
    keep it forever, and this would fail.)"""
    import gc
    import weakref

    from mini_infer.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32")
    model = weakref.ref(engine.runner.model)
    engine.shutdown()
    del engine
    gc.collect()
    assert model() is None


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


def test_a_kernel_the_os_refuses_is_unavailable(tmp_path, monkeypatch):
    """AMX needs the OS's permission (cpu_gemm_amx.cpp's amx_enable): a refusal makes the kernel unavailable, with
    the errno, rather than a crash on its first tile instruction."""
    from mini_infer.kernels.build import KernelUnavailable

    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path))
    source = tmp_path / "refused.cpp"
    source.write_text('extern "C" int refuse() { return 1; }\nextern "C" void work() {}\n')
    kernel = cpu._Kernel(str(source), "work", [], None, ["-O1"], (), enable="refuse")
    monkeypatch.setitem(cpu._KERNELS, "refused_work", kernel)
    with pytest.raises(KernelUnavailable, match=r"the OS refused work its registers \(refuse: EPERM\)"):
        cpu.native_function("refused_work")


def reference_decode_attention(q, k_cache, v_cache, block_tables, context_lens):
    """float64, request by request: gather the context through the block table, softmax(q k^T / sqrt(d)) v."""
    num_reqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(num_reqs):
        n = int(context_lens[r])
        slots = block_tables[r, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[r].double(), keys) / head_dim**0.5
        out[r] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 1, 16, 4), (14, 2, 64, 16), (6, 6, 12, 3),
                                                             (8, 2, 128, 16), (2, 1, 72, 4)])
def test_decode_attention_matches_float64(dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    context_lens = torch.tensor([1, 5, block_size, 37, 2 * block_size + 1])
    max_blocks = 40 // block_size + 1
    num_blocks = len(context_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # Each request's blocks scattered over the pool; slots past a context hold NaN and must never be read.
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks].view(-1, max_blocks)
    for r, n in enumerate(context_lens.tolist()):
        for t in range(n, max_blocks * block_size):
            k_cache[block_tables[r, t // block_size], t % block_size] = float("nan")
            v_cache[block_tables[r, t // block_size], t % block_size] = float("nan")
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen).to(dtype)
    out = cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output is rounded to 8 mantissa bits
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def _attention_inputs():
    k_cache = torch.randn(6, 4, 1, 8)
    return torch.randn(2, 2, 8), k_cache, k_cache.clone(), torch.tensor([[0, 1], [2, 3]]), torch.tensor([3, 8])


@pytest.mark.parametrize("spoil, message", [
    (lambda a: a.update(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
    (lambda a: a.update(v=a["v"][:, :, :, :4].contiguous()), "caches"),
    (lambda a: a.update(lens=torch.tensor([0, 8])), "context lengths in \\[0, 8\\]"),
    (lambda a: a.update(lens=torch.tensor([3, 9])), "context lengths in \\[3, 9\\]"),
    (lambda a: a.update(tables=torch.tensor([[0, 1], [2, 6]])), "block ids in \\[0, 6\\]"),
    (lambda a: a.update(tables=torch.tensor([[-1, 1], [2, 3]])), "block ids in \\[-1, 3\\]"),
    (lambda a: a.update(lens=torch.tensor([3, 8, 1])), "context lens"),
])
def test_decode_attention_refuses_inputs_that_would_read_outside_the_caches(spoil, message):
    q, k, v, tables, lens = _attention_inputs()
    args = dict(q=q, k=k, v=v, tables=tables, lens=lens)
    cpu.paged_decode_attention(*args.values())  # the unspoilt inputs run
    spoil(args)
    with pytest.raises(ValueError, match=message):
        cpu.paged_decode_attention(*args.values())


def reference_prefill_attention(q, k_cache, v_cache, blocks, context_len):
    """float64: query i at position context_len - Lq + i over the keys at positions up to its own."""
    query_len, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    slots = blocks[torch.arange(context_len) // block_size] * block_size + torch.arange(context_len) % block_size
    keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    values = v_cache.reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), keys) / head_dim**0.5
    positions = torch.arange(context_len - query_len, context_len)
    scores.masked_fill_(torch.arange(context_len)[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), values)


# Whole prompts and chunks after a cached prefix (Lq < context); query tiles of 8 tokens and score blocks of 16 keys
# with their tails; head dims that are and are not multiples of 8 and 32; GQA groups of 7, 2 and 1.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(14, 2, 64, 16), (4, 2, 12, 4), (3, 3, 40, 3)])
@pytest.mark.parametrize("query_len,context_len", [(1, 1), (5, 5), (8, 8), (17, 17), (9, 40), (1, 33), (70, 70)])
def test_prefill_attention_matches_float64(dtype, heads, kv_heads, head_dim, block_size, query_len, context_len):
    gen = torch.Generator().manual_seed(query_len * 100 + context_len + head_dim)
    needed = -(-context_len // block_size)
    num_blocks = needed + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[: needed + 2]  # scattered, two more ids than it needs
    for t in range(context_len, (needed + 2) * block_size):  # slots past the context: never read
        k_cache[blocks[t // block_size], t % block_size] = float("nan")
        v_cache[blocks[t // block_size], t % block_size] = float("nan")
    q = torch.randn(query_len, heads, head_dim, generator=gen).to(dtype)
    out = cpu.paged_prefill_attention(q, k_cache, v_cache, blocks, context_len)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output is rounded to 8 mantissa bits
    torch.testing.assert_close(out.double(), reference_prefill_attention(q, k_cache, v_cache, blocks, context_len),
                               rtol=tol, atol=tol)


# bfloat16 q and caches with heads a multiple of 32 wide run the AVX512_BF16 build where the CPU has it
# (cpu.attention_kernel), the float32-arithmetic kernels elsewhere: both against float64 here, whichever the CPU picks
# for the model. Query groups of 7, of 10 (two passes of at most 8 heads) and of 1; a block size of 5 (gathers that
# cross blocks); contexts with odd tails; NaN in every slot past a context.
ATTENTION_KERNELS = {"float32 arithmetic": "", "avx512_bf16": "_bf16"}


@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(14, 2, 64, 16), (20, 2, 128, 5), (8, 8, 32, 16)])
def test_both_bf16_attention_kernels_match_float64(monkeypatch, kernel, heads, kv_heads, head_dim, block_size):
    suffix = ATTENTION_KERNELS[kernel]
    if suffix and (why := cpu.kernel_reason("paged_decode_attention_bf16")) is not None:
        pytest.skip(f"the AVX512_BF16 attention does not run here: {why}")
    monkeypatch.setattr(cpu, "attention_kernel", lambda kind, *_: kind + suffix)
    gen = torch.Generator().manual_seed(heads + head_dim + block_size)
    context_lens = torch.tensor([1, 2, 31, 33, 70, 97])
    max_blocks = -(-97 // block_size) + 1
    num_blocks = len(context_lens) * max_blocks + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks].view(-1, max_blocks)
    for r, n in enumerate(context_lens.tolist()):
        for t in range(n, max_blocks * block_size):
            k_cache[tables[r, t // block_size], t % block_size] = float("nan")
            v_cache[tables[r, t // block_size], t % block_size] = float("nan")
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen).bfloat16()
    out = cpu.paged_decode_attention(q, k_cache, v_cache, tables, context_lens)
    torch.testing.assert_close(out.double(), reference_decode_attention(q, k_cache, v_cache, tables, context_lens),
                               rtol=1e-2, atol=1e-2)
    for r, query_len in [(2, 31), (3, 9), (4, 70), (5, 1)]:  # whole prompts and chunks after cached tokens
        n = int(context_lens[r])
        q = torch.randn(query_len, heads, head_dim, generator=gen).bfloat16()
        out = cpu.paged_prefill_attention(q, k_cache, v_cache, tables[r], n)
        torch.testing.assert_close(out.double(), reference_prefill_attention(q, k_cache, v_cache, tables[r], n),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("spoil, message", [
    (lambda a: a.update(context_len=1), "2 query tokens \\(must be in \\[1, 1\\]\\)"),
    (lambda a: a.update(blocks=torch.tensor([0, 6])), "block ids in \\[0, 6\\] \\(must be in \\[0, 5\\]\\)"),
    (lambda a: a.update(blocks=torch.tensor([-1, 1])), "block ids in \\[-1, 1\\]"),
    (lambda a: a.update(blocks=torch.tensor([0])), "1 blocks of 4 for a context of 7"),
    (lambda a: a.update(k=a["k"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
])
def test_prefill_attention_refuses_inputs_that_would_read_outside_the_caches(spoil, message):
    k_cache = torch.randn(6, 4, 1, 8)
    args = dict(q=torch.randn(2, 2, 8), k=k_cache, v=k_cache.clone(), blocks=torch.tensor([0, 1]), context_len=7)
    cpu.paged_prefill_attention(*args.values())  # the unspoilt inputs run
    spoil(args)
    with pytest.raises(ValueError, match=message):
        cpu.paged_prefill_attention(*args.values())
