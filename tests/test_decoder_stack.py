"""The decoder layers of a decode step in one native call (kernels/decoder.py): the same bits as the layers run op
by op, on every matmul path the CPU runs, and the same refusals."""

from __future__ import annotations

import pytest
import torch

from conftest import build_hf_model, save_hf_model
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.kernels import cpu
from mini_infer.kernels.decoder import DecoderStack
from mini_infer.model.attention import AttentionMetadata
from mini_infer.model.qwen2 import Qwen2ForCausalLM
from mini_infer.sampling_params import SamplingParams

needs_kernels = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                   reason="the native kernels need AVX2 + FMA")
PROMPTS = [[5, 9, 2, 77, 31, 8, 1], [100, 3], [42], [7, 7, 300, 12, 5]]


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory):
    """3 layers, 6 query heads over 2 KV heads of 16, an intermediate size (200) and QKV width (160) that leave
    partial 16-column panels; every tensor perturbed."""
    model = build_hf_model(seed=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                           intermediate_size=200, num_hidden_layers=3)
    return save_hf_model(model, tmp_path_factory.mktemp("odd") / "model")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def family_model_dir(request, tmp_path_factory):
    """The odd shapes again as Qwen3 (q/k norms in the stack, head_dim 24 apart from hidden / heads) and Llama (a
    zero QKV bias)."""
    extra = dict(head_dim=24) if request.param == "qwen3" else {}
    model = build_hf_model(seed=4, architecture=request.param, hidden_size=96, num_attention_heads=6,
                           num_key_value_heads=2, intermediate_size=200, num_hidden_layers=3, **extra)
    return save_hf_model(model, tmp_path_factory.mktemp(request.param) / "model")


def _paths(dtype: torch.dtype) -> list[str]:
    return [path for path, why in cpu.matmul_paths(dtype).items() if why is None]


def _run(model_dir, dtype: str, path: str, monkeypatch, stacked: bool) -> tuple[list, list, int]:
    """Greedy tokens and top-5 logprobs of PROMPTS decoding together (prefill steps mix with decode steps), with
    every matmul on `path`; and how many steps the stack ran."""
    monkeypatch.setattr(cpu, "matmul_paths", lambda _: {path: None})  # `on` takes the last runnable path
    calls = []
    original = DecoderStack.__call__
    monkeypatch.setattr(DecoderStack, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or original(self, *a))
    if not stacked:
        monkeypatch.setattr(Qwen2ForCausalLM, "_decoder_stack", lambda *_: None)
    engine = LLMEngine.from_args(str(model_dir), dtype=dtype, cpu_kernels="on", block_size=4,
                                 max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    outputs = [finished[str(i)] for i in range(len(PROMPTS))]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    monkeypatch.undo()
    return ([o.token_ids for o in outputs], [[dict(step) for step in o.logprobs] for o in outputs], len(calls))


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_layers_op_by_op_on_every_matmul_path(odd_model_dir, dtype, monkeypatch):
    paths = _paths(getattr(torch, dtype))
    assert "avx2" in paths
    for path in paths:
        tokens, logprobs, stacked_steps = _run(odd_model_dir, dtype, path, monkeypatch, stacked=True)
        ref_tokens, ref_logprobs, op_steps = _run(odd_model_dir, dtype, path, monkeypatch, stacked=False)
        assert stacked_steps >= 4 and op_steps == 0, path  # the decode steps took the stack, and only then
        assert tokens == ref_tokens and logprobs == ref_logprobs, path


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_layers_op_by_op_for_qwen3_and_llama(family_model_dir, dtype, monkeypatch):
    path = _paths(getattr(torch, dtype))[-1]  # the fastest path this CPU runs (the other paths: the test above)
    tokens, logprobs, stacked_steps = _run(family_model_dir, dtype, path, monkeypatch, stacked=True)
    ref_tokens, ref_logprobs, op_steps = _run(family_model_dir, dtype, path, monkeypatch, stacked=False)
    assert stacked_steps >= 4 and op_steps == 0
    assert tokens == ref_tokens and logprobs == ref_logprobs


@needs_kernels
def test_prefill_and_mixed_steps_run_op_by_op(odd_model_dir, monkeypatch):
    """A step with a prompt chunk in it has no stack (its attention is torch's); a decode-only one has."""
    engine = LLMEngine.from_args(str(odd_model_dir), dtype="float32", cpu_kernels="on", block_size=4)
    model, caches = engine.runner.model, engine.runner.kv_caches
    mixed = AttentionMetadata(torch.tensor([0, 4, 5]), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1, 2]),
                              [0, 1, 3], [1, 2], num_decodes=1)
    decode = AttentionMetadata(torch.tensor([0, 4]), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1, 1]),
                               [0, 1, 2], [1, 1], num_decodes=2)
    assert model._decoder_stack(3, caches, mixed) is None
    assert isinstance(model._decoder_stack(2, caches, decode), DecoderStack)
    off = LLMEngine.from_args(str(odd_model_dir), dtype="float32", cpu_kernels="off", block_size=4)
    assert off.runner.model._decoder_stack(2, off.runner.kv_caches, decode) is None


@needs_kernels
@pytest.mark.parametrize("spoil, message", [
    (dict(slot_mapping=torch.tensor([10**6])), r"rope_kv_write: slots in \[1000000, 1000000\] \(must be in \[0, "),
    (dict(positions=torch.tensor([-1])), r"positions in \[-1, -1\] \(must be in \[0, "),
    (dict(context_lens=torch.tensor([0])), r"cpu attention: context lengths in \[0, 0\] \(must be in \[1, 8\]\)"),
    (dict(block_tables=torch.tensor([[0, 10**6]])), r"block ids in \[0, 1000000\] \(must be in \[0, "),
])
def test_stack_refuses_indices_outside_the_caches(odd_model_dir, spoil, message):
    engine = LLMEngine.from_args(str(odd_model_dir), dtype="float32", cpu_kernels="on", block_size=4,
                                 num_kv_blocks=16)
    model, caches = engine.runner.model, engine.runner.kv_caches
    args = dict(positions=torch.tensor([3]), slot_mapping=torch.tensor([3]),
                block_tables=torch.tensor([[0, 1]]), context_lens=torch.tensor([4]))
    meta = AttentionMetadata(args["slot_mapping"], args["block_tables"], args["context_lens"], [0, 1], [4], 1)
    stack = model._decoder_stack(1, caches, meta)
    caches[0][0].zero_()
    args.update(spoil)
    with pytest.raises(ValueError, match=message):
        stack(torch.randn(1, 96), args["positions"], args["slot_mapping"], args["block_tables"], args["context_lens"])
    if "slot_mapping" in spoil or "positions" in spoil:  # refused before the first write
        assert not caches[0][0].any()
    with pytest.raises(ValueError, match=r"decoder stack: x \(2, 96\)"):
        stack(torch.randn(2, 96), *(args[k] for k in ("positions", "slot_mapping", "block_tables", "context_lens")))
