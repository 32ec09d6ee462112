"""Sampler on hand-made logits: greedy, top-k/top-p/min-p, temperature, seeds, penalties, min_tokens,
logprobs (the same knobs end to end are in test_sampling_e2e.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from mini_infer import SamplingParams
from mini_infer.runner.plan import NewRequest
from mini_infer.runner.graphs import HostSyncRefused, _RefuseHostSyncs
from mini_infer.runner.sampler import CANDIDATES, Sampler

CPU = torch.device("cpu")


@dataclass(eq=False)
class Row:
    """One request as the sampler sees it: its parameters and tokens."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]
    eos: tuple[int, ...]
    request_id: str


def make_request(params: SamplingParams, prompt=(0,), output=(), eos=(), seed: int | None = None,
                 request_id: str = "r") -> Row:
    if seed is not None:
        params = replace(params, seed=seed)
    return Row(params, list(prompt), list(output), tuple(eos), request_id)


class BatchSampler:
    """A Sampler used as the runner uses it: each request takes a slot of its own the first time it is seen. Its
    top-k is the `backend` fixture's (None: the torch path)."""

    top_k = None

    def __init__(self, vocab_size: int, device: torch.device, seed: int, argmax=None) -> None:
        self.sampler = Sampler(vocab_size, device, seed, argmax, type(self).top_k)
        self.rows: list[Row] = []
        self.slots: dict[int, int] = {}  # id(row) -> slot

    def _slots(self, requests: list[Row]) -> list[int]:
        for row in requests:
            if id(row) not in self.slots:
                slot = self.slots[id(row)] = len(self.rows)
                self.rows.append(row)
                self.sampler.add(NewRequest(
                    request_id=f"{slot}:{row.request_id}", slot=slot, token_ids=row.prompt + row.output,
                    num_prompt_tokens=len(row.prompt), num_computed_tokens=0, block_ids=[], params=row.params,
                    min_tokens_stop_ids=(*row.eos, *row.params.stop_token_ids)))
        return [self.slots[id(row)] for row in requests]

    def __call__(self, logits: torch.Tensor, requests: list[Row]):
        return self.sampler(logits, self._slots(requests))

    def apply_penalties(self, logits: torch.Tensor, requests: list[Row]) -> torch.Tensor:
        return self.sampler.apply_penalties(logits, self._slots(requests))

    def mask_stop_tokens_under_min(self, logits: torch.Tensor, requests: list[Row]) -> torch.Tensor:
        return self.sampler.mask_stop_tokens_under_min(logits, self._slots(requests))


@pytest.fixture(params=["torch", "native"])
def backend(request, monkeypatch):
    """Runs a test on the sampler's torch path and on its native top-k path (the runner's with the native kernels),
    which must then have run: float64 logits are handed to the kernel as float32, the closest it reads."""
    if request.param == "native":
        from mini_infer.kernels import cpu, fused

        if cpu.unavailable_reason() is not None:
            pytest.skip(f"native kernels unavailable: {cpu.unavailable_reason()}")
        calls = []

        def top_k(x, ks, edit_ids, edit_values):
            calls.append(x.shape)
            return fused.top_k(x.float() if x.dtype == torch.float64 else x, ks, edit_ids, edit_values)

        monkeypatch.setattr(BatchSampler, "top_k", staticmethod(top_k))
    yield request.param
    if request.param == "native":
        assert calls, "the native top-k never ran"


def draw(logits_row: torch.Tensor, params: SamplingParams, num_draws: int, sampler_seed: int = 0,
         **request_kwargs) -> torch.Tensor:
    """`num_draws` independent samples from one logits row: one batch of identical unseeded rows."""
    sampler = BatchSampler(logits_row.shape[-1], CPU, sampler_seed)
    requests = [make_request(params, **request_kwargs) for _ in range(num_draws)]
    return torch.tensor(sampler(logits_row.expand(num_draws, -1).clone(), requests).token_ids)


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / len(tokens)


def assert_frequencies_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Every token's empirical frequency within 5 standard errors (plus a hair) of its probability."""
    expected = expected.double()
    observed = frequencies(tokens, len(expected))
    tolerance = 5 * (expected * (1 - expected) / len(tokens)).sqrt() + 1e-9
    assert ((observed - expected).abs() <= tolerance).all(), (observed.tolist(), expected.tolist())


def logits_from_probs(probs: list[float], dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().to(dtype)


# ---- greedy ----

def test_greedy_is_argmax_on_random_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 37, generator=gen)
    sampler = BatchSampler(37, CPU, seed=0)
    out = sampler(logits, [make_request(SamplingParams(temperature=0.0)) for _ in range(64)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 64


def test_top_k_1_equals_greedy_on_random_rows(backend):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(200, 23, generator=gen) * 3
    sampler = BatchSampler(23, CPU, seed=5)
    for _ in range(3):  # several steps: the noise changes, the answer must not
        out = sampler(logits, [make_request(SamplingParams(temperature=1.0, top_k=1)) for _ in range(200)])
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy_even_in_a_sampled_batch(backend):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 16, generator=gen)
    params = [SamplingParams(temperature=1e-6) if i % 2 else SamplingParams(temperature=1.0) for i in range(40)]
    out = BatchSampler(16, CPU, seed=0)(logits, [make_request(p) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i % 2] == argmax[1::2]
    assert [t for i, t in enumerate(out.token_ids) if not i % 2] != argmax[0::2]  # sampled rows do sample


def test_padded_vocab_columns_are_never_sampled():
    # Model heads may be wider than the vocabulary; the extra columns are not tokens.
    logits = torch.zeros(300, 12)
    logits[:, 10:] = 50.0
    greedy = BatchSampler(10, CPU, 0)(logits[:1], [make_request(SamplingParams(temperature=0.0, logprobs=2))])
    assert greedy.token_ids == [0]  # all real tokens tie: the first
    sampled = BatchSampler(10, CPU, 0)(logits, [make_request(SamplingParams(temperature=1.0)) for _ in range(300)])
    assert max(sampled.token_ids) < 10 and len(set(sampled.token_ids)) == 10
    _, _, _, values = greedy.logprobs[0]
    assert values == pytest.approx([math.log(0.1)] * 2, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_argmax_picks_what_torch_picks(dtype):
    """The runner hands the sampler the native argmax with the native kernels: plain greedy rows read the (padded)
    logits as they are, penalised and min_tokens rows a float32 copy, sampled rows keep their draws."""
    from mini_infer.kernels import cpu, fused

    if cpu.unavailable_reason() is not None:
        pytest.skip(f"native kernels unavailable: {cpu.unavailable_reason()}")
    logits = (torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    logits[:, 32:] = 50.0  # padding columns past the 32-token vocabulary
    logits[0, 5] = logits[0, 9] = logits[0, :32].max()  # a tie: the first wins
    for params in ([SamplingParams(temperature=0.0)] * 6,
                   [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0),
                    SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=1.0),
                    SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3)]):
        native = BatchSampler(32, CPU, 0, fused.argmax)(logits, _rows(params, logits))
        reference = BatchSampler(32, CPU, 0)(logits, _rows(params, logits))
        assert native.token_ids == reference.token_ids and max(native.token_ids) < 32
        assert native.token_ids[1] == int(logits[1, :32].float().argmax())


def _rows(params, logits):
    return [make_request(p, prompt=(5, 9), eos=(int(logits[i, :32].argmax()),), request_id=str(i))
            for i, p in enumerate(params)]


# ---- top-k, top-p, min-p ----

@pytest.mark.parametrize("k", [2, 5, 9])
def test_top_k_samples_exactly_the_k_largest(k, backend):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(20, generator=gen, dtype=torch.float64) * 0.5  # flat enough that all k show up
    tokens = draw(logits, SamplingParams(temperature=1.0, top_k=k), 6000)
    assert set(tokens.tolist()) == set(logits.topk(k).indices.tolist())
    kept = torch.full_like(logits, float("-inf"))
    kept[logits.topk(k).indices] = logits[logits.topk(k).indices]
    assert_frequencies_match(tokens, kept.softmax(-1))


@pytest.mark.parametrize("top_k", [0, -1, 20, 1000])
@pytest.mark.parametrize("with_top_k_row", [False, True])
def test_top_k_off_or_beyond_vocab_samples_everything(top_k, with_top_k_row, backend):
    # The second variant shares the batch with a top_k=2 row, so the top-k code runs for this row too.
    logits = torch.linspace(-0.5, 0.5, 20, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, top_k=top_k)]
    if with_top_k_row:
        params.append(SamplingParams(temperature=1.0, top_k=2))
    requests = [make_request(p) for _ in range(6000) for p in params]
    out = BatchSampler(20, CPU, 0)(logits.expand(len(requests), -1).clone(), requests)
    tokens = torch.tensor(out.token_ids[:: len(params)])
    assert set(tokens.tolist()) == set(range(20))
    assert_frequencies_match(tokens, logits.softmax(-1))
    if with_top_k_row:
        assert set(out.token_ids[1::2]) == {18, 19}


# Probabilities 0.5, 0.3, 0.15, 0.05, spread over the vocabulary out of order.
TOP_P_PROBS = [0.15, 0.0, 0.5, 0.05, 0.0, 0.3]
BY_RANK = [2, 5, 0, 3]


@pytest.mark.parametrize("top_p,num_kept", [(0.3, 1), (0.49, 1), (0.51, 2), (0.799, 2), (0.801, 3),
                                            (0.94, 3), (0.96, 4), (1.0, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, num_kept, dtype, backend):
    logits = logits_from_probs(TOP_P_PROBS, dtype)
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=top_p), 4000)
    assert set(tokens.tolist()) == set(BY_RANK[:num_kept])
    kept = torch.zeros(6, dtype=torch.float64)
    kept[BY_RANK[:num_kept]] = torch.tensor(TOP_P_PROBS, dtype=torch.float64)[BY_RANK[:num_kept]]
    assert_frequencies_match(tokens, kept / kept.sum())


def test_top_p_applies_to_the_top_k_renormalised_distribution(backend):
    # After top_k=2 the kept mass is 0.5/0.8 = 0.625 and 0.375: top_p=0.6 keeps only the first
    # (on the raw probabilities it would keep both, as 0.5 < 0.6).
    logits = logits_from_probs(TOP_P_PROBS)
    tokens = draw(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6), 2000)
    assert set(tokens.tolist()) == {2}
    tokens = draw(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.65), 2000)
    assert set(tokens.tolist()) == {2, 5}


def test_top_k_and_top_p_rows_in_one_batch_use_their_own_values(backend):
    logits = logits_from_probs(TOP_P_PROBS)
    params = [SamplingParams(temperature=1.0, top_p=0.79), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3, top_p=0.99)]
    repeats = 600
    requests = [make_request(p) for _ in range(repeats) for p in params]  # the four kinds interleaved
    out = BatchSampler(6, CPU, seed=3)(logits.expand(len(requests), -1).clone(), requests)
    seen = [set(out.token_ids[i::len(params)]) for i in range(len(params))]
    assert seen == [{2, 5}, {2}, {0, 2, 3, 5}, {0, 2, 5}]


# probs 0.35 0.25 0.15 0.1 0.08 0.04 0.03: min_p=0.4 keeps p >= 0.14.
MIN_P_PROBS = [0.1, 0.35, 0.04, 0.15, 0.08, 0.25, 0.03]


@pytest.mark.parametrize("min_p,kept", [(0.0, {0, 1, 2, 3, 4, 5, 6}), (0.1, {0, 1, 2, 3, 4, 5}),
                                        (0.4, {1, 3, 5}), (0.5, {1, 5}), (0.9, {1}), (1.0, {1})])
def test_min_p_drops_tokens_below_min_p_times_the_max(min_p, kept, backend):
    logits = logits_from_probs(MIN_P_PROBS)
    tokens = draw(logits, SamplingParams(temperature=1.0, min_p=min_p), 5000)
    assert set(tokens.tolist()) == kept
    expected = torch.zeros(7, dtype=torch.float64)
    expected[list(kept)] = torch.tensor(MIN_P_PROBS, dtype=torch.float64)[list(kept)]
    assert_frequencies_match(tokens, expected / expected.sum())


def test_min_p_is_measured_after_temperature(backend):
    # At T=2 the probabilities are sqrt'ed and renormalised: token 0 (0.1) is then at
    # sqrt(0.1/0.35) = 0.53 of the max, above min_p=0.5; at T=1 it is at 0.29, below.
    logits = logits_from_probs(MIN_P_PROBS)
    assert set(draw(logits, SamplingParams(temperature=2.0, min_p=0.5), 4000).tolist()) == {0, 1, 3, 5}
    assert set(draw(logits, SamplingParams(temperature=1.0, min_p=0.5), 4000).tolist()) == {1, 5}


# ---- temperature ----

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature, backend):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2])
    tokens = draw(logits, SamplingParams(temperature=temperature), 20000, sampler_seed=7)
    assert_frequencies_match(tokens, (logits.double() / temperature).softmax(-1))
    if temperature != 1.0:  # the test can tell temperatures apart
        observed = frequencies(tokens, 8)
        assert (observed - logits.double().softmax(-1)).abs().max() > 0.03


def test_sampler_seed_makes_unseeded_rows_reproducible(backend):
    logits = torch.zeros(50, 30)
    requests = [make_request(SamplingParams()) for _ in range(50)]
    first = BatchSampler(30, CPU, seed=4)(logits, requests).token_ids
    assert BatchSampler(30, CPU, seed=4)(logits, requests).token_ids == first
    assert BatchSampler(30, CPU, seed=5)(logits, requests).token_ids != first


# ---- per-request seeds ----

def _seeded_run(batch: list[tuple[SamplingParams, int | None]], target: int, logits: torch.Tensor,
                sampler_seed: int, steps: int = 12) -> list[int]:
    """The tokens row `target` gets over `steps` calls, every row reading the same logits."""
    sampler = BatchSampler(logits.shape[-1], CPU, sampler_seed)
    requests = [make_request(p, seed=s, request_id=str(i)) for i, (p, s) in enumerate(batch)]
    tokens = []
    for _ in range(steps):
        out = sampler(logits.expand(len(batch), -1).clone(), requests)
        tokens.append(out.token_ids[target])
    return tokens


def test_seeded_request_ignores_batch_composition_and_position(backend):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(40, generator=gen) * 0.3
    target = (SamplingParams(temperature=0.8, top_p=0.95), 1234)
    alone = _seeded_run([target], 0, logits, sampler_seed=0)
    others = [(SamplingParams(temperature=1.0), None), (SamplingParams(temperature=1.0, top_k=5), 99),
              (SamplingParams(temperature=0.0), 7), (SamplingParams(temperature=1.3, repetition_penalty=1.2), None)]
    for batch, index, sampler_seed in [
        ([target] + others, 0, 1),
        (others[:2] + [target] + others[2:], 2, 2),
        (others + [target], 4, 3),
        (others[:1] + [target] + [target], 1, 4),  # a twin with the same seed
    ]:
        assert _seeded_run(batch, index, logits, sampler_seed) == alone
    assert len(set(alone)) > 3  # it really samples


def test_different_seeds_give_different_tokens(backend):
    logits = torch.zeros(40)
    runs = {seed: _seeded_run([(SamplingParams(), seed)], 0, logits, 0) for seed in (1, 2, 3)}
    assert len({tuple(r) for r in runs.values()}) == 3
    assert _seeded_run([(SamplingParams(), 2)], 0, logits, 0) == runs[2]


def test_seeded_rows_follow_the_distribution(backend):
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    sampler = BatchSampler(4, CPU, seed=0)
    requests = [make_request(SamplingParams(temperature=1.0), seed=s) for s in range(4000)]
    tokens = torch.tensor(sampler(logits.expand(4000, -1).clone(), requests).token_ids)
    assert_frequencies_match(tokens, logits.softmax(-1))


# ---- penalties ----

def expected_penalised(logits: list[float], prompt, output, repetition=1.0, presence=0.0, frequency=0.0):
    """Hand-written reference: repetition on prompt or output tokens, presence/frequency on output only."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value = value - frequency * count
        if count:
            value = value - presence
        result.append(value)
    return torch.tensor(result, dtype=torch.float64)


PENALTY_CASES = [
    # (prompt, output, repetition, presence, frequency)
    ([1, 2, 2], [], 1.3, 0.0, 0.0),
    ([1], [4, 4, 4, 6], 1.0, 0.0, 0.5),
    ([1], [4, 4, 4, 6], 1.0, 0.7, 0.0),
    ([0, 3], [4, 3, 4, 9], 1.5, 0.25, 0.4),
    ([9, 9, 9, 9, 9, 9], [2], 0.8, -0.5, -0.3),  # penalties below 1 / 0 encourage
    ([5], [5, 5], 2.0, 2.0, 2.0),
    ([7], [], 1.0, 0.0, 0.0),  # no penalties at all
]


def test_apply_penalties_matches_hand_computed_logits():
    gen = torch.Generator().manual_seed(3)
    # positive, negative and exactly-zero logits
    logits = torch.randn(len(PENALTY_CASES), 10, generator=gen, dtype=torch.float64) * 2
    logits[:, 8] = 0.0
    requests = [make_request(SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f),
                             prompt=prompt, output=output)
                for prompt, output, r, p, f in PENALTY_CASES]
    result = BatchSampler(10, CPU, 0).apply_penalties(logits.clone(), requests)
    expected = torch.stack([expected_penalised(row.tolist(), prompt, output, r, p, f)
                            for row, (prompt, output, r, p, f) in zip(logits, PENALTY_CASES)])
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-12)
    assert torch.equal(result[-1], logits[-1])


def test_penalties_do_not_leak_into_the_last_vocab_token():
    # Rows are padded to the longest token list: the padding must not count as a token.
    logits = torch.ones(2, 6, dtype=torch.float64)
    requests = [make_request(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0),
                             prompt=[0], output=[1]),
                make_request(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0),
                             prompt=[0, 0, 0, 0, 0], output=[1, 1, 1, 2, 2, 2, 2])]
    result = BatchSampler(6, CPU, 0).apply_penalties(logits, requests)
    assert result.tolist() == [[0.5, 0.5 - 2.0, 1, 1, 1, 1], [0.5, 0.5 - 4.0, 0.5 - 5.0, 1, 1, 1]]


@pytest.mark.parametrize("params,prompt,output,expected", [
    (SamplingParams(temperature=1.0, top_k=1), [0], [0, 0], 0),  # no penalty: the argmax stands
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), [0], [], 1),  # 2.0 / 1.2 < 1.9 (prompt)
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), [5], [0], 1),  # (output)
    (SamplingParams(temperature=0.0, repetition_penalty=1.01), [0], [], 0),  # 1.98 > 1.9
    (SamplingParams(temperature=0.0, presence_penalty=0.2), [5], [0], 1),
    (SamplingParams(temperature=0.0, presence_penalty=2.0), [0, 0, 0], [5], 0),  # prompt tokens are exempt
    (SamplingParams(temperature=0.0, frequency_penalty=0.05), [5], [0], 0),  # 2.0 - 0.05 > 1.9
    (SamplingParams(temperature=0.0, frequency_penalty=0.05), [5], [0, 0, 0], 1),  # 2.0 - 0.15 < 1.9
    (SamplingParams(temperature=0.0, frequency_penalty=2.0), [0, 0, 0], [5], 0),  # prompt tokens are exempt
    (SamplingParams(temperature=0.0, presence_penalty=-0.6), [5], [3], 3),  # 1.5 + 0.6 > 2.0
    (SamplingParams(temperature=1.0, top_k=1, repetition_penalty=1.2), [0], [], 1),  # before top_k
])
def test_penalties_flip_the_choice(params, prompt, output, expected, backend):
    logits = torch.tensor([[2.0, 1.9, 0.0, 1.5, -1.0, 1.0]])
    out = BatchSampler(6, CPU, 0)(logits, [make_request(params, prompt=prompt, output=output)])
    assert out.token_ids == [expected]


def test_repetition_penalty_makes_negative_logits_more_negative(backend):
    logits = torch.tensor([[-1.0, -1.1, -5.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert BatchSampler(3, CPU, 0)(logits, [make_request(params, prompt=[0])]).token_ids == [1]  # -1.2 < -1.1
    assert BatchSampler(3, CPU, 0)(logits, [make_request(params, prompt=[2])]).token_ids == [0]


# ---- min_tokens ----

def test_min_tokens_masks_eos_and_stop_ids_until_reached(backend):
    logits = torch.tensor([0.0, 1.0, 2.0, 9.0, 3.0, 8.0, 4.0, 5.0])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5, 100])
    sampler = BatchSampler(8, CPU, 0)
    for num_output in range(6):
        request = make_request(params, output=[1] * num_output, eos=[3, 200])
        masked = sampler.mask_stop_tokens_under_min(logits[None].clone(), [request])[0]
        expected = logits.clone()
        if num_output < 3:
            expected[[3, 5]] = float("-inf")
        assert torch.equal(masked, expected), num_output
        token = sampler(logits[None].clone(), [request]).token_ids[0]
        assert token == (7 if num_output < 3 else 3)


def test_min_tokens_mask_is_per_row(backend):
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 4)
    requests = [
        make_request(SamplingParams(temperature=0.0, min_tokens=2), eos=[1]),
        make_request(SamplingParams(temperature=0.0, min_tokens=2), output=[0, 0], eos=[1]),
        make_request(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]), eos=[1]),
        make_request(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])),  # ignore_eos: no eos
    ]
    assert BatchSampler(4, CPU, 0)(logits, requests).token_ids == [2, 1, 3, 2]


def test_min_tokens_mask_holds_when_sampling(backend):
    logits = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    tokens = draw(logits, SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[1]), 3000,
                  output=[0, 0], eos=[4, 5])
    assert set(tokens.tolist()) == {0, 2, 3}
    tokens = draw(logits, SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[1]), 3000,
                  output=[0, 0], eos=[4, 5])
    assert set(tokens.tolist()) == set(range(6))


# ---- logit_bias ----

def test_logit_bias_adds_to_each_rows_own_ids_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    biases = [{3: 2.5, 7: -1.0}, None, {0: 100.0}, {int(logits[3].argmax()): -100.0, 5: 0.25}]
    requests = [make_request(SamplingParams(temperature=0.0, logit_bias=bias)) for bias in biases]
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            expected[row, token] += value
    out = BatchSampler(12, CPU, 0)(logits.clone(), requests)
    assert out.token_ids == expected.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 0 and out.token_ids[3] != int(logits[3].argmax())
    alone = BatchSampler(12, CPU, 0)(logits[1:2].clone(), [make_request(SamplingParams(temperature=0.0))])
    assert out.token_ids[1] == alone.token_ids[0]


def test_logit_bias_comes_before_penalties_and_top_k():
    # Token 5 (logit -3, in the prompt) gets +4: 1.0, which the repetition penalty (after the bias, as vLLM orders
    # them) halves to 0.5, still above token 1's 0.3; penalised first (-6) and then biased it would be -2.
    logits = torch.tensor([[2.0, 0.3, 0.0, -1.0, -2.0, -3.0]], dtype=torch.float64)
    bias = {5: 4.0, 0: -1.8}
    greedy = SamplingParams(temperature=0.0, logit_bias=bias)
    assert BatchSampler(6, CPU, 0)(logits.clone(), [make_request(greedy)]).token_ids == [5]
    penalised = replace(greedy, repetition_penalty=2.0)
    assert BatchSampler(6, CPU, 0)(logits.clone(), [make_request(penalised, prompt=[5])]).token_ids == [5]
    # top_k 2 keeps the two largest after the bias, {5, 1}, not the unbiased top two {0, 1}.
    tokens = draw(logits[0], SamplingParams(temperature=1.0, top_k=2, logit_bias=bias), 2000)
    assert set(tokens.tolist()) == {1, 5}


def test_logprobs_with_logit_bias_are_those_of_the_raw_logits():
    logits = torch.tensor([[0.5, 1.5, -0.5]], dtype=torch.float64)
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={2: 10.0})
    out = BatchSampler(3, CPU, 0)(logits.clone(), [make_request(params)])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [2]
    sampled, rank, top_ids, top_values = out.logprobs[0]
    assert sampled == pytest.approx(raw[2].item(), abs=1e-12) and rank == 3 and top_ids == [1]


# ---- logprobs ----

def test_logprobs_are_those_of_the_raw_logits():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 30, generator=gen, dtype=torch.float64) * 2
    logits[1, 7] = logits[1].max() + 0.1  # the raw argmax, which the penalty below pushes down
    requests = [
        make_request(SamplingParams(temperature=0.0, logprobs=3)),
        make_request(SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0), prompt=[7]),
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=3.0, logprobs=0), seed=1),
        make_request(SamplingParams(temperature=0.5, top_k=4, logprobs=20, min_p=0.1), seed=2),
        make_request(SamplingParams(temperature=2.0, logprobs=1, presence_penalty=2.0), output=[3, 4], seed=3),
    ]
    out = BatchSampler(30, CPU, 0)(logits.clone(), requests)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    assert out.token_ids[1] != 7
    for row, (request, token, logprobs) in enumerate(zip(requests, out.token_ids, out.logprobs)):
        if request.params.logprobs is None:
            continue
        logprob, rank, top_ids, top_values = logprobs
        assert logprob == pytest.approx(raw[row, token].item(), abs=1e-12)
        assert rank == 1 + int((raw[row] > raw[row, token]).sum())
        top = raw[row].topk(request.params.logprobs)
        assert top_ids == top.indices.tolist()
        assert top_values == pytest.approx(top.values.tolist(), abs=1e-12)
    assert out.logprobs[1][1] == 2  # the penalised greedy pick is the raw runner-up
    assert out.logprobs[3][2:] == ([], [])


def test_logprobs_of_low_precision_logits_are_computed_in_float32():
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5]], dtype=torch.bfloat16)
    out = BatchSampler(4, CPU, 0)(logits, [make_request(SamplingParams(temperature=0.0, logprobs=2))])
    expected = torch.log_softmax(logits.float(), dim=-1)[0]
    logprob, rank, top_ids, top_values = out.logprobs[0]
    assert (out.token_ids, rank, top_ids) == ([0], 1, [0, 1])
    assert logprob == pytest.approx(expected[0].item(), abs=1e-6)
    assert top_values == pytest.approx(expected[:2].tolist(), abs=1e-6)


def test_batch_without_logprobs_gets_none():
    out = BatchSampler(5, CPU, 0)(torch.zeros(3, 5), [make_request(SamplingParams()) for _ in range(3)])
    assert out.logprobs == [None, None, None]


class _NoDeviceReads(_RefuseHostSyncs):
    """Refuses reading a device value on the host mid-sampling (what would stall a GPU step); host data going in is
    fine outside a graph."""

    REFUSED = _RefuseHostSyncs.REFUSED - {"lift_fresh"}


def test_sampling_reads_nothing_back_but_a_nucleus_past_its_candidates():
    """Greedy, plain temperature, min_p, top-k (small and past CANDIDATES) and penalised rows in one batch decide
    every branch on the host: the ids are the one read-back (the runner's .tolist()). A nucleus without top_k reads
    back whether it fits its candidates."""
    vocab = CANDIDATES + 500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    rows = [make_request(SamplingParams(temperature=0.0)),
            make_request(SamplingParams(temperature=0.7)),
            make_request(SamplingParams(temperature=0.7, min_p=0.1)),
            make_request(SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
            make_request(SamplingParams(temperature=0.7, top_k=CANDIDATES + 10)),
            make_request(SamplingParams(temperature=0.7, repetition_penalty=1.3), prompt=(3, 4), seed=4)]
    sampler = BatchSampler(vocab, CPU, seed=0)
    with _NoDeviceReads():
        tokens = sampler(logits, rows).token_ids
    assert len(tokens) == 6 and tokens[0] == logits[0].argmax()
    with pytest.raises(HostSyncRefused), _NoDeviceReads():
        sampler(logits[:1], [make_request(SamplingParams(temperature=0.7, top_p=0.5))])
