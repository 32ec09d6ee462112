"""The step-time target: the scheduler's prompt chunks against a fake cost model (no timing anywhere), the online
cost model's fit, what the scheduler feeds it, and the configuration's checks."""

from __future__ import annotations

import pytest

from mini_infer.config import EngineConfig
from mini_infer.engine.scheduler import MIN_PROMPT_CHUNK
from mini_infer.engine.step_cost import MIN_STEPS, WINDOW, OnlineStepCost, StepCost, StepShape, attended
from test_scheduler import complete, make_request, make_scheduler, schedule, step


class LinearCost(StepCost):
    """A fake machine: fixed + per_token x tokens + per_position x positions seconds a step, known exactly; it
    records what it is shown."""

    def __init__(self, fixed=0.010, per_token=0.001, per_position=0.0, cold=False):
        self.fixed, self.per_token, self.per_position, self.cold = fixed, per_token, per_position, cold
        self.observed: list[tuple[StepShape, float]] = []

    def predict(self, shape):
        if self.cold:
            return None
        return self.fixed + self.per_token * shape.tokens + self.per_position * shape.positions

    def observe(self, shape, seconds):
        self.observed.append((shape, seconds))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def targeted(cost: StepCost, target_s: float, clock=None, **settings):
    return make_scheduler(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512, step_cost=cost,
                          target_step_s=target_s, **({"clock": clock} if clock else {}), **settings)


def decoding(scheduler, count: int, prompt_len: int = 16):
    """`count` requests past their prompts, decoding (their prompts ran with nothing else decoding)."""
    requests = [make_request(f"d{i}", prompt_len, max_tokens=100) for i in range(count)]
    for request in requests:
        scheduler.add(request)
    step(scheduler)
    assert all(r.num_output_tokens == 1 for r in requests)
    return requests


def chunk_of(output, request) -> int:
    return dict(zip(output.plan.request_ids, output.plan.num_new_tokens)).get(request.request_id, 0)


def test_a_prompt_takes_what_keeps_the_decoding_step_within_the_target():
    scheduler = targeted(LinearCost(), target_s=0.0505)
    decoding(scheduler, 8)
    prompt = make_request("p", 500)
    scheduler.add(prompt)
    output = step(scheduler)
    # 0.010 + 0.001 * (8 decodes + x) <= 0.0505: x = 32
    assert chunk_of(output, prompt) == 32 and output.plan.num_tokens == 40
    output = step(scheduler)
    assert chunk_of(output, prompt) == 32 and prompt.num_computed_tokens == 64


def test_attention_counts_in_the_prediction():
    # 8 decodes at positions 16 + 1: 8 * 17 positions; a chunk of x after 0 cached: x (x + 1) / 2
    cost = LinearCost(fixed=0.0, per_token=0.0, per_position=1e-4)
    scheduler = targeted(cost, target_s=0.050)
    decoding(scheduler, 8)
    prompt = make_request("p", 500)
    scheduler.add(prompt)
    output = step(scheduler)
    x = chunk_of(output, prompt)
    shape = StepShape(tokens=8, positions=8 * 17, decodes=8)
    assert cost.predict(shape.with_chunk(x, 0)) <= 0.050 < cost.predict(shape.with_chunk(x + 1, 0))
    assert attended(x, 0) == x * (x + 1) // 2 and x > MIN_PROMPT_CHUNK


def test_with_nothing_decoding_prompts_take_the_whole_budget():
    scheduler = targeted(LinearCost(), target_s=0.050)
    prompts = [make_request(f"p{i}", 300) for i in range(2)]
    for prompt in prompts:
        scheduler.add(prompt)
    output = step(scheduler)
    assert [chunk_of(output, p) for p in prompts] == [300, 212]  # the token budget, 512, as without a target


def test_a_step_whose_decodes_alone_overrun_takes_the_smallest_chunk_of_one_prompt_only():
    scheduler = targeted(LinearCost(), target_s=0.012)  # 8 decodes alone: 0.018 s
    decoding(scheduler, 8)
    first, second = make_request("p", 500), make_request("q", 500)
    scheduler.add(first)
    scheduler.add(second)
    output = step(scheduler)
    assert chunk_of(output, first) == MIN_PROMPT_CHUNK and chunk_of(output, second) == 0
    assert second in scheduler.waiting  # not admitted: the step has its prompt chunk
    output = step(scheduler)
    assert chunk_of(output, first) == MIN_PROMPT_CHUNK and first.num_computed_tokens == 2 * MIN_PROMPT_CHUNK


def test_a_later_chunk_takes_what_is_left_of_the_target():
    scheduler = targeted(LinearCost(), target_s=0.0505)
    decoding(scheduler, 8)
    first, second = make_request("p", 20), make_request("q", 500)
    scheduler.add(first)
    scheduler.add(second)
    output = step(scheduler)
    assert chunk_of(output, first) == 20 and chunk_of(output, second) == 12  # 8 + 20 + 12 = 40 tokens


def test_a_cold_model_takes_the_smallest_chunk_of_one_prompt_while_requests_decode():
    alone = targeted(LinearCost(cold=True), target_s=10.0)
    prompt = make_request("alone", 600)
    alone.add(prompt)
    assert chunk_of(step(alone), prompt) == 512  # nothing decodes: the budget
    scheduler = targeted(LinearCost(cold=True), target_s=10.0)
    decoding(scheduler, 8)
    prompts = [make_request(f"p{i}", 600) for i in range(2)]
    for prompt in prompts:
        scheduler.add(prompt)
    output = step(scheduler)
    assert [chunk_of(output, p) for p in prompts] == [MIN_PROMPT_CHUNK, 0]


def test_without_a_target_chunks_are_the_budget_only():
    scheduler = make_scheduler(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    decoding(scheduler, 8)
    prompt = make_request("p", 500)
    scheduler.add(prompt)
    assert chunk_of(step(scheduler), prompt) == 500


def test_the_scheduler_shows_the_model_each_step_and_the_time_to_the_next():
    cost, clock = LinearCost(), FakeClock()
    scheduler = targeted(cost, target_s=1.0, clock=clock)
    request = make_request("a", 40, max_tokens=2)
    scheduler.add(request)
    output = schedule(scheduler)  # the prompt
    clock.now = 0.25
    complete(scheduler, output)
    step(scheduler)  # its second token: it finishes, and nothing is left
    clock.now = 5.0  # an idle engine, then a new request: its wait is no step's time
    scheduler.add(make_request("b", 8, max_tokens=1))
    schedule(scheduler)
    assert len(cost.observed) == 1  # the decode step ended the engine's work: it has no next step to time it by
    shape, seconds = cost.observed[0]
    assert (shape.tokens, shape.prompt_tokens, shape.decodes, shape.positions) == (40, 40, 0, attended(40, 0))
    assert seconds == 0.25


def fitted(steps: list[tuple[StepShape, float]]) -> tuple[float, float, float] | None:
    """The coefficients a new model holds after these steps."""
    model = OnlineStepCost()
    for shape, seconds in steps:
        model.observe(shape, seconds)
    return model.coefficients


def test_the_online_model_fits_a_machine_and_follows_it_when_it_changes():
    def shapes():
        for i in range(WINDOW):
            shape = StepShape()
            for j in range(1 + i % 16):
                shape.add(1, 100 + 37 * j + i, 10)
            yield shape.with_chunk(16 * (i % 7), 64 * (i % 5)) if i % 2 else shape

    def machine(fixed, per_token, per_position):
        return [(shape, fixed + per_token * shape.tokens + per_position * shape.positions) for shape in shapes()]

    model = OnlineStepCost()
    steps = machine(0.02, 0.001, 2e-7)
    for shape, seconds in steps[:2 * MIN_STEPS - 1]:  # MIN_STEPS - 1 steps with prompt tokens
        model.observe(shape, seconds)
    assert model.predict(steps[0][0]) is None
    for shape, seconds in steps:
        model.observe(shape, seconds)
    assert model.coefficients == pytest.approx((0.02, 0.001, 2e-7), rel=1e-6)
    for _ in range(3):  # slower now: windows later, the model has followed
        for shape, seconds in machine(0.03, 0.002, 0.0):
            model.observe(shape, seconds)
    assert model.coefficients == pytest.approx((0.03, 0.002, 0.0), rel=1e-6, abs=1e-12)
    assert fitted(machine(0.03, 0.002, 0.0)) == pytest.approx((0.03, 0.002, 0.0), rel=1e-6, abs=1e-12)  # afresh


def test_a_coefficient_that_fits_below_zero_is_dropped():
    # times that fall with the token count: the fit keeps the fixed cost alone, never a negative rate; the fixed cost
    # that minimises the squared relative errors sum((c - t) / t)^2 is sum(1 / t) / sum(1 / t^2)
    times = [0.1 - 0.0001 * n for n in (10, 20, 30, 40)]
    steps = [(StepShape(tokens=n, prompt_tokens=n), t) for n, t in zip((10, 20, 30, 40), times)]
    fixed, per_token, per_position = fitted(steps)
    assert per_token == 0.0 and per_position == 0.0
    assert fixed == pytest.approx(sum(1 / t for t in times) / sum(1 / t ** 2 for t in times))


@pytest.mark.parametrize("settings, message", [
    ({"target_itl_ms": 0}, "target_itl_ms must be > 0"),
    ({"target_itl_ms": 50, "enable_chunked_prefill": False, "max_num_batched_tokens": 1 << 16},
     "target_itl_ms needs enable_chunked_prefill"),
])
def test_config_refuses_a_target_it_cannot_keep(tiny_model_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_model_dir, **settings)
