"""The step plan is plain data and small: a request's data travels once, then each decode step carries O(1)
per request, whatever its context length; the runner's persistent batch reproduces every request's tokens."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from mini_infer import LLMEngine, SamplingParams
from mini_infer.runner.input_batch import InputBatch, StepInputs
from mini_infer.runner.plan import StepPlan

PENALISED = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, repetition_penalty=1.1)


def classes_in(payload: bytes) -> set[str]:
    """The module-qualified classes (and other globals) a pickle refers to."""
    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(payload)).load()
    return found


def decode_plans(engine: LLMEngine, num_requests: int, prompt_len: int, steps: int) -> list[StepPlan]:
    for i in range(num_requests):
        engine.add_request(str(i), [(17 * i + j) % 1000 + 1 for j in range(prompt_len)], PENALISED)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    plans = []
    for _ in range(steps):
        plan = engine.scheduler.schedule()
        engine._outputs(engine.scheduler.update(plan, engine.executor.execute(plan)))
        plans.append(plan)
    return plans


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine.from_args(str(tiny_model_dir), dtype="float32", max_num_seqs=64, max_model_len=4096,
                               max_num_batched_tokens=8192, enable_prefix_caching=False)


@pytest.mark.parametrize("prompt_len", [64, 2000])
def test_a_decode_plan_is_small_and_does_not_grow_with_context(engine, prompt_len):
    plans = decode_plans(engine, 64, prompt_len, steps=20)
    engine.abort_request(list(engine.requests))
    list(engine.run_until_done())
    for plan in plans:
        assert not plan.is_prefill and len(plan.request_ids) == 64 and not plan.new_requests
        assert all(len(tokens) == 1 for tokens in plan.new_token_ids.values())
        payload = pickle.dumps(plan)
        assert len(payload) < 1024 * 64
        assert classes_in(payload) == {"mini_infer.runner.plan.StepPlan"}
    # Only block ids vary: one new block per request every block_size steps.
    sizes = [len(pickle.dumps(p)) for p in plans]
    assert max(sizes) - min(sizes) <= 64 * 16


def test_a_new_request_travels_once_as_plain_data(engine):
    engine.add_request("a", [5, 6, 7], PENALISED)
    first = engine.scheduler.schedule()
    assert [n.request_id for n in first.new_requests] == ["a"]
    assert classes_in(pickle.dumps(first)) <= {"mini_infer.runner.plan.StepPlan", "mini_infer.runner.plan.NewRequest",
                                               "mini_infer.sampling_params.SamplingParams",
                                               "mini_infer.sampling_params.RequestOutputKind"}
    engine._outputs(engine.scheduler.update(first, engine.executor.execute(first)))
    second = engine.scheduler.schedule()
    assert not second.new_requests and second.new_token_ids == {"a": [engine.requests["a"].output_token_ids[-1]]}
    engine._outputs(engine.scheduler.update(second, engine.executor.execute(second)))
    engine.abort_request("a")
    third = engine.scheduler.schedule()
    assert third.finished_ids == ["a"] and not third.request_ids
    engine.step()


def test_the_persistent_batch_holds_every_request_s_tokens(engine):
    """After many decode steps, each slot's row equals its request's prompt and outputs, and its block-table row
    equals the KV manager's blocks."""
    decode_plans(engine, 8, 37, steps=30)
    batch = engine.runner.input_batch
    for request_id, request in engine.requests.items():
        slot = batch.slots[request_id]
        # The runner learns of the last sampled token with the next plan.
        known = request.all_token_ids[:-1]
        assert batch.token_ids[slot, : len(known)].tolist() == known
        blocks = engine.kv_cache.block_ids(request_id)
        assert batch.block_table[slot, : len(blocks)].tolist() == blocks
    engine.abort_request(list(engine.requests))
    list(engine.run_until_done())
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_the_decode_path_builds_the_same_inputs_as_the_general_one(tiny_model_dir, monkeypatch):
    """Every step of one new token per request (no prompt logprobs) takes InputBatch's decode path: its inputs
    equal, field by field and dtype by dtype, what the general path builds from a copy of the same batch, across
    block boundaries (4-token blocks), finished requests and preemption (a KV pool too small for all of them)."""
    original = InputBatch._prepare_any
    compared = []

    def checked(self, plan):
        slot_list = [self.slots[rid] for rid in plan.request_ids]
        if not self.decode_only(plan, slot_list):
            return original(self, plan, slot_list)
        twin = copy.deepcopy(self)
        fast, general = self._prepare_decode(slot_list), original(twin, plan, slot_list)
        for name in StepInputs.__slots__:
            a, b = getattr(fast, name), getattr(general, name)
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), name
            else:
                assert a == b, name
        assert self.num_computed == twin.num_computed
        compared.append(len(slot_list))
        return fast

    monkeypatch.setattr(InputBatch, "prepare", checked)
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=6,
                                 max_model_len=256, max_num_batched_tokens=64, enable_prefix_caching=False)
    for i in range(6):
        engine.add_request(str(i), [(13 * i + j) % 900 + 1 for j in range(5 + 7 * i)],
                           SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True))
    list(engine.run_until_done())
    assert engine.scheduler.num_preemptions > 0 and max(compared) > 1 and len(compared) > 20
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
