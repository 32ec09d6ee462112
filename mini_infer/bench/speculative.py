"""The speculative-decoding workloads (issue 38; docs/decisions/024-speculative-decoding.md). Each setting runs on an
engine of its own, and every setting is bracketed by speculation-off runs of the same prompts just before and just
after it (its baseline is their mean: timings drift by 30-40 % over tens of minutes, so a baseline measured once at
the start would not do). One engine is alive at a time, so that a 7B target fits beside its own baseline.

speculative-draft prices a draft model. Random weights make real acceptance meaningless, so the bench controls which
tokens the draft proposes and nothing else: OracleProposer wraps the engine's real draft proposer (calling it, so
every draft step is paid in full) and makes each token its draft model picks the target's known greedy continuation
with probability alpha, independently per position from a seeded generator, else a token the continuation does not
hold there; the draft model goes on from the steered tokens as from its own. The continuation is the greedy output
of the first speculation-off run of the same batch size. It stays the target's continuation only where a verify row
computes what a decode step computes: in the default arithmetic a 1-row and a (k + 1)-row step round bfloat16
differently, and a random model's logits are so flat that near-ties flip within tens of tokens (1.5B target, 0.5B
draft: acceptance 0.81 at alpha 1 at batch 1, 0.04 at batch 4, every steered request leaving its continuation), so
the engines (speculation off too) run in deterministic mode by default, whose verify rows are bit for bit a decode
step's (decision 023: decode 1.00-1.07x).

Beside each measured speed-up stands the cost model's prediction, from costs measured in the same run: the median
decode step of speculation off (t1), and of the setting's alpha = 0 run (every step there verifies k drafts and asks
the draft for k more) the part spent in the draft proposer over k, c_d, and the rest, c_v(k), both relative to t1.
With each draft accepted with chance alpha after the one before it, a verify step brings
E = (1 - alpha^(k+1)) / (1 - alpha) tokens, so the prediction is E / (c_v(k) + k c_d); at alpha = 0 it equals the
measurement up to the median against the mean of the steps.

speculative-ngram measures the n-gram proposer on output that genuinely copies its prompt: each request asks to
rewrite a passage of the built-in texts with a word changed every --edit-every words, and its output is steered to
that edited passage, token for token as the tokenizer splits it: a structured-outputs choice of that one string
(which fixes the text) and a logit_bias on the passage's own tokens, larger for longer tokens (which fixes the
split: among the tokens the grammar allows, the passage's own longest one wins). A static bias alone cannot steer
a copy (it does not know where in the passage the request is). The proposer finds real matches in the prompt; the
target verifies them with real forwards, its grammar filling a bitmask row per verified position.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.prompts import TEXTS, fixed_prompts, load_stream
from mini_infer.bench.report import Column, Workload
from mini_infer.bench.systems import MiniInferSystem, greedy
from mini_infer.engine.speculation import SpecDecodeStats
from mini_infer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

DELTA = RequestOutputKind.DELTA
# Copy with edits: the words that replace every --edit-every-th word of a passage, in turn.
EDIT_WORDS = ("quietly", "green", "seven", "northern", "paper", "slowly", "bright", "careful")
TEXTS_PER_PASSAGE = 3
COPY_INSTRUCTION = "Rewrite the passage below, changing a few words.\n\n{passage}\n\nRewritten:\n"
# The copy's logit_bias: a passage token of n characters gets BIAS_BASE + BIAS_PER_CHAR * n (at most 100, the API's
# bound), so that the longer of two passage tokens the grammar both allows wins by far more than a random model's
# logits differ.
BIAS_BASE, BIAS_PER_CHAR, BIAS_MAX = 20.0, 8.0, 100.0
# Positions past a request's longest length in max_model_len, which also sizes the KV pool (max_num_seqs full
# rows): a draft model's request needs k lookahead slots and admission keeps a block free beside it, and where
# those did not fit, the request waited forever (a 16-token prompt, max_model_len 27, one sequence).
KV_MARGIN = 32
IDLE_STEPS = 100  # steps with nothing running before a run is declared stuck


class OracleProposer:
    """The engine's own proposer, its draft model's tokens steered: with `alpha` set, each token the draft model
    picks (one a draft step and request) becomes the request's known continuation at that position with probability
    alpha (one seeded draw per position), else a token the continuation does not hold there (the draft's own, or the
    id after it where the draft was right by itself, so that acceptance follows alpha exactly; those are counted).
    The draft model goes on from the steered token, as it goes on from its own: its next step's input and the K/V it
    keeps for the drafts the target accepts are those of the tokens it proposed, so a run pays what a draft with
    that acceptance would. A request whose tokens left its continuation (in the default arithmetic a verify row's
    bfloat16 rounding can decide a near-tie otherwise than a decode step) has no known continuation from then on: its
    drafts pass as the draft model picks them, and it is counted. With alpha None every proposal passes as it is (the
    n-gram proposer's runs). The wrapped proposer's time is summed in `seconds` either way."""

    def __init__(self, inner, batch, vocab_size: int, seed: int) -> None:
        self.inner, self.batch, self.vocab_size, self.seed = inner, batch, vocab_size, seed
        self.alpha: float | None = None
        self.generator = torch.Generator()
        self.expected = torch.full_like(batch.token_ids, -1)  # per slot: its prompt, then its continuation
        self.continuations: dict[str, list[int]] = {}  # request id -> prompt + continuation (set before adding)
        self.seconds = 0.0
        self.steered = 0  # draft positions with a known continuation
        self.right_by_itself = 0  # of those, the ones the wrapped proposer had right
        self.diverged: set[str] = set()
        self.on_track: dict[int, bool] = {}  # slot -> its tokens follow its continuation (set by each propose)
        if hasattr(inner, "_forward"):  # a draft model: steer each of its steps' tokens
            self._draft_forward, inner._forward = inner._forward, self._steered_forward

    def start(self, alpha: float | None, continuations: dict[str, list[int]], rep: int = 0) -> None:
        """A run's setting: the draws seeded by the rep, so that every setting's rep r steers alike and the reps
        average over as many draws (with one seed for all, a setting's acceptance was one draw's: 0.54 against
        alpha's mean 0.44 at alpha 0.7, k 4)."""
        self.alpha, self.continuations = alpha, continuations
        self.generator.manual_seed(self.seed + rep)
        self.steered = self.right_by_itself = 0
        self.diverged = set()

    def reset(self, slot: int) -> None:
        self.inner.reset(slot)
        request_id = next(rid for rid, s in self.batch.slots.items() if s == slot)  # (once per admission)
        row = self.continuations.get(request_id, [])
        self.expected[slot] = -1
        self.expected[slot, : len(row)] = torch.tensor(row, dtype=torch.int64)

    def propose(self, batch, slots: list[int], lengths: list[int], ks: list[int]) -> list[list[int]]:
        if self.alpha is not None and slots:
            rows, length = torch.tensor(slots), torch.tensor(lengths)
            span = int(length.max())
            # Every request's tokens so far against its prompt + continuation (positions past its length ignored).
            seen = batch.token_ids[rows, :span] == self.expected[rows, :span]
            on_track = (seen | (torch.arange(span) >= length[:, None])).all(1)
            self.on_track = dict(zip(slots, on_track.tolist()))
            if not bool(on_track.all()):
                ids = {s: rid for rid, s in batch.slots.items()}
                self.diverged.update(ids[slots[i]] for i in (~on_track).nonzero().flatten().tolist())
        start = time.perf_counter()
        drafts = self.inner.propose(batch, slots, lengths, ks)
        self.seconds += time.perf_counter() - start
        return drafts

    def _steered_forward(self, batch, slots: list[int], starts: list[int], counts: list[int]) -> list[int]:
        """The draft model's step (its tokens at positions starts + counts), each token steered (see the class)."""
        picked = self._draft_forward(batch, slots, starts, counts)
        if self.alpha is None:
            return picked
        rows, proposed = torch.tensor(slots), torch.tensor(picked, dtype=torch.int64)
        at = (torch.tensor(starts) + torch.tensor(counts)).clamp(max=self.expected.shape[1] - 1)
        truth = self.expected[rows, at]
        known = torch.tensor([self.on_track[slot] for slot in slots]) & (truth >= 0)
        right = known & (proposed == truth)
        wrong = torch.where(right, (proposed + 1) % self.vocab_size, proposed)
        take = torch.rand(proposed.shape, generator=self.generator) < self.alpha
        self.steered += int(known.sum())
        self.right_by_itself += int(right.sum())
        return torch.where(known & take, truth, wrong).tolist()


@dataclass(slots=True)
class TimedRun:
    """One batch run to completion: decode tok/s over the steps in which every request had computed its prompt
    (tokens emitted in them over their time, plus the proposer's time in the earlier steps: a draft model's prompt
    and first drafts are speculation's cost too), each such step's seconds and its proposer seconds, each request's
    tokens, and the spec_decode counts it added."""

    tok_s: float
    decode_s: float
    decode_tokens: int
    steps: list[tuple[float, float]]
    token_ids: list[list[int]]
    spec: SpecDecodeStats
    steered: int = 0
    right_by_itself: int = 0
    diverged: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict:
        return {"tok_s": self.tok_s, "decode_s": self.decode_s, "decode_tokens": self.decode_tokens,
                "decode_steps": len(self.steps), "wall_s": self.wall_s}


def _delta(after: SpecDecodeStats, before: SpecDecodeStats) -> SpecDecodeStats:
    width = len(after.accepted_per_position)
    per_position = before.accepted_per_position + [0] * (width - len(before.accepted_per_position))
    return SpecDecodeStats(after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                           after.num_accepted_tokens - before.num_accepted_tokens,
                           after.num_emitted_tokens - before.num_emitted_tokens,
                           [a - b for a, b in zip(after.accepted_per_position, per_position)])


def timed_run(engine, oracle: OracleProposer | None, prompts: list[list[int]], params: list[SamplingParams],
              tag: str) -> TimedRun:
    """Add the requests and step the engine until they finish, timing each step (see TimedRun)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt, sampling in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, sampling)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    before = engine.stats().spec_decode
    decode_s, early_propose, decode_tokens, steps, idle = 0.0, 0.0, 0, [], 0
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        idle = 0 if engine.scheduler.running else idle + 1
        if idle > IDLE_STEPS:
            raise RuntimeError(f"{tag}: the engine ran nothing for {IDLE_STEPS} steps with requests waiting (their "
                               "KV blocks never fit)")
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.requests.values())
        proposing = oracle.seconds if oracle is not None else 0.0
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        proposed = oracle.seconds - proposing if oracle is not None else 0.0
        new = 0
        for output in outputs:
            tokens[output.request_id] += output.outputs[0].token_ids
            new += len(output.outputs[0].token_ids)
        if decoding:
            decode_s += elapsed
            decode_tokens += new
            steps.append((elapsed, proposed))
        else:
            early_propose += proposed
    wall = time.perf_counter() - begin
    spent = decode_s + early_propose
    run = TimedRun(decode_tokens / spent if spent else 0.0, spent, decode_tokens, steps, [tokens[r] for r in ids],
                   _delta(engine.stats().spec_decode, before), wall_s=wall)
    if oracle is not None and oracle.alpha is not None:
        run.steered, run.right_by_itself, run.diverged = oracle.steered, oracle.right_by_itself, len(oracle.diverged)
    return run


@dataclass(frozen=True, slots=True)
class Setting:
    """An engine's speculation: None for off; else the speculative_config and the alphas it runs (None: no
    steering, the proposer as it is)."""

    name: str
    spec: dict | None
    alphas: tuple[float | None, ...] = (None,)
    k: int | None = None
    adaptive: bool = False


@dataclass(slots=True)
class Bracketed:
    """What run_bracketed measured: per setting, batch size and alpha the runs; per off bracket and batch size the
    runs; the off runs' greedy tokens per batch size (the oracle's continuations)."""

    settings: dict[str, dict[tuple[int, float | None], list[TimedRun]]] = field(default_factory=dict)
    off: list[dict[int, list[TimedRun]]] = field(default_factory=list)
    continuations: dict[int, list[list[int]]] = field(default_factory=dict)
    off_consistent: bool = True  # every off bracket produced the first one's tokens
    kernels: str | None = None


def run_bracketed(options: BenchOptions, target: str, engine_args: dict, settings: list[Setting],
                  requests: dict[int, tuple[list[list[int]], list[SamplingParams]]],
                  log: Callable[[str], None]) -> Bracketed:
    """off, settings[0], off, settings[1], ..., off: each on an engine of its own (built, warmed up on every batch
    size, run, shut down); `requests` maps each batch size to its prompts and sampling params."""
    result = Bracketed()
    sizes = sorted(requests)

    def build(spec: dict | None) -> tuple[MiniInferSystem, OracleProposer | None]:
        system = MiniInferSystem(target, {**engine_args, "speculative_config": spec})
        if result.kernels is None:
            result.kernels = system.info["kernels"]
        engine, oracle = system.engine, None
        if spec is not None:
            speculator = engine.runner.speculator
            oracle = OracleProposer(speculator.proposer, engine.runner.input_batch,
                                    engine.config.model_config.vocab_size, options.seed)
            speculator.proposer = oracle
        for size in sizes:  # warm-up: kernels timed, pages committed, grammars compiled, verify steps taken
            prompts, params = requests[size]
            if oracle is not None:
                oracle.start(0.5 if size in result.continuations and spec.get("model") else None,
                             _continuations(f"warm{size}", prompts, result.continuations.get(size)))
            timed_run(engine, oracle, prompts, [replace(p, max_tokens=min(p.max_tokens, options.warmup_tokens))
                                                for p in params], f"warm{size}")
        return system, oracle

    def off_bracket(index: int) -> None:
        system, _ = build(None)
        bracket: dict[int, list[TimedRun]] = {}
        try:
            for size in sizes:
                prompts, params = requests[size]
                for rep in range(options.reps):
                    run = timed_run(system.engine, None, prompts, params, f"off{index}-{size}-{rep}")
                    bracket.setdefault(size, []).append(run)
                    if size not in result.continuations:
                        result.continuations[size] = run.token_ids
                    elif run.token_ids != result.continuations[size]:
                        result.off_consistent = False
                    log(f"off (bracket {index}) B={size} rep {rep + 1}: {run.tok_s:.2f} decode tok/s")
        finally:
            _close(system)
        result.off.append(bracket)

    off_bracket(0)
    for index, setting in enumerate(settings, 1):
        system, oracle = build(setting.spec)
        runs = result.settings.setdefault(setting.name, {})
        try:
            for size in sizes:
                prompts, params = requests[size]
                for rep in range(options.reps):
                    alphas = setting.alphas if rep % 2 == 0 else tuple(reversed(setting.alphas))
                    for alpha in alphas:
                        tag = f"{setting.name}-{size}-{alpha}-{rep}"
                        oracle.start(alpha, _continuations(tag, prompts, result.continuations[size]), rep)
                        run = timed_run(system.engine, oracle, prompts, params, tag)
                        runs.setdefault((size, alpha), []).append(run)
                        accepted = run.spec.acceptance_rate
                        log(f"{setting.name} B={size} alpha={alpha} rep {rep + 1}: {run.tok_s:.2f} decode tok/s, "
                            f"acceptance {'-' if accepted is None else f'{accepted:.2f}'}")
        finally:
            _close(system)
            del system, oracle
        off_bracket(index)
    return result


def _close(system: MiniInferSystem) -> None:
    """Shut the engine down and give its memory back before the next one loads (a 7B target's 15 GB of bfloat16
    weights pass through memory at each load): its reference cycles collected, glibc's freed heap trimmed."""
    system.close()
    system.engine = None
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _continuations(tag: str, prompts: list[list[int]], outputs: list[list[int]] | None) -> dict[str, list[int]]:
    if outputs is None:
        return {}
    return {f"{tag}-{i}": prompt + output for i, (prompt, output) in enumerate(zip(prompts, outputs))}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify step of k drafts brings when each is accepted with chance alpha after the one before it."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _median_step(runs: list[TimedRun]) -> float:
    return statistics.median(elapsed for run in runs for elapsed, _ in run.steps)


def _off_baseline(measured: Bracketed, index: int, size: int) -> dict:
    """The off brackets just before and after setting `index` (1-based) at one batch size: each the median of its
    reps, and their mean."""
    before, after = measured.off[index - 1][size], measured.off[index][size]
    rates = [statistics.median(r.tok_s for r in runs) for runs in (before, after)]
    return {"off_tok_s": sum(rates) / 2, "off_before_tok_s": rates[0], "off_after_tok_s": rates[1],
            "off_step_s": (_median_step(before) + _median_step(after)) / 2}


def _row(setting: Setting, size: int, alpha: float | None, runs: list[TimedRun], base: dict,
         reference: list[list[int]]) -> dict:
    spec = sum((r.spec for r in runs), SpecDecodeStats())
    tok_s = statistics.median(r.tok_s for r in runs)
    same = sum(sum(a == b for a, b in zip(r.token_ids, reference)) for r in runs)
    rates = [r.tok_s for r in runs]
    row = {"setting": setting.name, "batch_size": size, "k": setting.k, "adaptive": setting.adaptive,
           "policy": "adaptive" if setting.adaptive else "fixed", "alpha": alpha, "tok_s": tok_s,
           "tok_s_runs": rates, "tok_s_spread": {"min": min(rates), "max": max(rates)}, **base,
           "speedup": tok_s / base["off_tok_s"], "acceptance": spec.acceptance_rate, "num_drafts": spec.num_drafts,
           "num_draft_tokens": spec.num_draft_tokens, "num_accepted_tokens": spec.num_accepted_tokens,
           "accepted_per_position": spec.accepted_per_position,
           "tokens_per_verify": spec.num_emitted_tokens / spec.num_drafts if spec.num_drafts else None,
           "same_tokens": f"{same}/{len(reference) * len(runs)}", "runs": [r.summary() for r in runs]}
    if alpha is not None:
        row.update(steered=sum(r.steered for r in runs), right_by_itself=sum(r.right_by_itself for r in runs),
                   diverged=sum(r.diverged for r in runs))
        row["draft_right"] = row["right_by_itself"] / row["steered"] if row["steered"] else None
        if not setting.adaptive:
            k = setting.k
            row["expected_acceptance"] = sum(alpha ** i for i in range(1, k + 1)) / k
            row["expected_tokens_per_verify"] = expected_tokens(alpha, k)
    return row


# ---- speculative-draft ----


def run_draft(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    target = resolve_model(options.target or model_dir, log)
    draft = resolve_model(options.draft, log)
    stream = load_stream(target)
    requests = {b: (fixed_prompts(stream, b, options.prompt_len), [greedy(options.max_tokens, DELTA)] * b)
                for b in options.batches}
    alphas = tuple(sorted({0.0, *options.alphas}))  # alpha 0 always: the cost model's costs are measured there
    spec = {"model": draft, "quantization": options.draft_quantization}
    settings = []
    for k in options.ks:
        settings.append(Setting(f"k={k}", {**spec, "num_speculative_tokens": k, "adaptive": False}, alphas, k))
        if options.adaptive_alphas:
            settings.append(Setting(f"k<={k} adaptive", {**spec, "num_speculative_tokens": k, "adaptive": True},
                                    tuple(options.adaptive_alphas), k, True))
    engine_args = dict(dtype=options.dtype, max_num_seqs=max(options.batches), enable_prefix_caching=False,
                       max_model_len=options.prompt_len + options.max_tokens + max(options.ks) + KV_MARGIN,
                       quantization=options.quantization[0] if options.quantization else None,
                       deterministic=options.deterministic == "on")
    measured = run_bracketed(options, target, engine_args, settings, requests, log)
    rows = []
    for index, setting in enumerate(settings, 1):
        for size in options.batches:
            base = _off_baseline(measured, index, size)
            costs = None
            if not setting.adaptive:
                calibration = measured.settings[setting.name][(size, 0.0)]
                costs = _costs([s for run in calibration for s in run.steps], setting.k, base["off_step_s"])
            for alpha in setting.alphas:
                row = _row(setting, size, alpha, measured.settings[setting.name][(size, alpha)], base,
                           measured.continuations[size])
                if costs is not None:
                    row.update(costs)
                    row["predicted_speedup"] = expected_tokens(alpha, setting.k) / (
                        costs["c_verify"] + setting.k * costs["c_draft"])
                rows.append(row)
    config = {"target": target, "draft": draft, "dtype": options.dtype, "deterministic": options.deterministic,
              "quantization": engine_args["quantization"], "draft_quantization": options.draft_quantization,
              "batch_sizes": list(options.batches), "ks": list(options.ks), "alphas": list(alphas),
              "adaptive_alphas": list(options.adaptive_alphas), "prompt_len": options.prompt_len,
              "max_tokens": options.max_tokens, "reps": options.reps, "seed": options.seed,
              "kernels": measured.kernels, "off_consistent": measured.off_consistent, "note": options.note}
    return {"workload": "speculative-draft", "config": config, "off_brackets": _brackets(measured), "rows": rows}


def _costs(steps: list[tuple[float, float]], k: int, off_step_s: float) -> dict:
    """c_d and c_v(k) from the alpha = 0 run's decode steps (each: a verify step of k drafts, then k draft steps),
    relative to the off step."""
    draft = statistics.median(proposed for _, proposed in steps)
    verify = statistics.median(elapsed - proposed for elapsed, proposed in steps)
    return {"c_draft": draft / k / off_step_s, "c_verify": verify / off_step_s, "draft_step_s": draft / k,
            "verify_step_s": verify}


def _brackets(measured: Bracketed) -> list[dict]:
    return [{str(size): [run.summary() for run in runs] for size, runs in bracket.items()} for bracket in measured.off]


def resolve_model(name: str, log: Callable[[str], None]) -> str:
    """A model directory as given, or a factory preset's random-weight checkpoint in the model cache (written on
    first use, never into the repository)."""
    if Path(name).is_dir():
        return str(name)
    from mini_infer.factory import PRESETS, make_model
    from mini_infer.paths import cache_dir

    if name not in PRESETS:
        raise ValueError(f"--target/--draft: {name!r} is neither a model directory nor a preset "
                         f"({', '.join(sorted(PRESETS))})")
    path = cache_dir() / "models" / f"{name}-random"
    if not (path / "config.json").is_file():
        log(f"writing a {name} checkpoint with RANDOM weights to {path} (first use only)")
        make_model(name, path)
    return str(path)


def _draft_headline(report: dict) -> list[str]:
    config = report["config"]
    quantized = f", target {config['quantization']}" if config["quantization"] else ""
    quantized += f", draft {config['draft_quantization']}" if config["draft_quantization"] else ""
    quantized += ", deterministic mode" if config.get("deterministic") == "on" else ""
    return [f"target {config['target']}, draft {config['draft']} ({config['dtype']}{quantized}): "
            f"{config['prompt_len']}-token prompts, {config['max_tokens']} new tokens each (greedy, EOS ignored), "
            f"{config['reps']} reps",
            "the draft model runs for real; which tokens it proposes is steered: each position gets the target's "
            "greedy token with probability alpha (seeded), else a wrong one; tok/s over the decode steps (the "
            "draft's prompt and first drafts included), off tok/s the mean of the speculation-off runs just before "
            "and after the setting's engine",
            "predicted: E(alpha, k) / (c_v + k c_d), E = (1 - alpha^(k+1)) / (1 - alpha) tokens a verify step; c_d, "
            "c_v: the alpha = 0 run's median draft step and verify step (the rest of its step), relative to the off "
            "step; same tokens: requests whose output equals speculation off's; draft right: the share of steered "
            "positions where the draft had the target's token by itself (changed to a wrong one unless alpha drew "
            "the target's); a request's last verify steps carry fewer drafts (max_tokens), so tok/verify falls a "
            "little short of E; diverged: steered requests whose tokens left speculation off's (default arithmetic "
            "only: deterministic mode computes a verify row as a decode step)",
            *_footer(config)]


def _footer(config: dict) -> list[str]:
    lines = [f"kernels: {config['kernels']}"]
    if not config["off_consistent"]:
        lines.append("WARNING: the speculation-off brackets did not all produce the same tokens")
    if config.get("note"):
        lines.append(f"note: {config['note']}")
    return lines


def _draft_rows(report: dict) -> list[dict | None]:
    rows, last = [], None
    for row in sorted(report["rows"], key=lambda r: (r["batch_size"], r["k"], r["adaptive"], r["alpha"])):
        if last is not None and (row["batch_size"], row["k"]) != last:
            rows.append(None)
        last = (row["batch_size"], row["k"])
        rows.append(row)
    return rows


def _speedup_chart(report: dict) -> tuple[str, list[Panel]]:
    """Per batch size, the measured speed-up of each (k, alpha) beside the cost model's prediction."""
    config, panels = report["config"], []
    for size in config["batch_sizes"]:
        rows = sorted((r for r in report["rows"] if r["batch_size"] == size),
                      key=lambda r: (r["k"], r["adaptive"], r["alpha"]))
        labels = [f"k{'<=' if r['adaptive'] else '='}{r['k']}\na={r['alpha']:g}" for r in rows]
        series = [Series("measured", [r["speedup"] for r in rows]),
                  Series("predicted", [r.get("predicted_speedup") or 0.0 for r in rows])]
        panels.append(Panel(f"B={size}: decode speed-up vs speculation off", labels, series,
                            width=max(1.0, len(rows) / 8), fontsize=6))
    return (f"speculative decoding: target {Path(config['target']).name}, draft {Path(config['draft']).name}, "
            f"{config['dtype']}", panels)


# ---- speculative-ngram ----


def copy_requests(tokenizer, num: int,
                  edit_every: int) -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """`num` copy-with-edits requests (passage i: TEXTS_PER_PASSAGE texts from text i on), their params, and the
    tokens each output must be."""
    prompts, params, targets = [], [], []
    for i in range(num):
        passage = " ".join(TEXTS[(i + j) % len(TEXTS)] for j in range(TEXTS_PER_PASSAGE))
        words = passage.split(" ")
        edited = " ".join(EDIT_WORDS[(n // edit_every) % len(EDIT_WORDS)] if n % edit_every == edit_every - 1 else w
                          for n, w in enumerate(words))
        wanted = tokenizer.encode(edited, add_special_tokens=False)
        bias = {t: min(BIAS_MAX, BIAS_BASE + BIAS_PER_CHAR * len(tokenizer.decode([t]))) for t in set(wanted)}
        prompts.append(tokenizer.encode(COPY_INSTRUCTION.format(passage=passage), add_special_tokens=False))
        params.append(replace(greedy(len(wanted) + 1, DELTA), logit_bias=bias,
                              structured_outputs=StructuredOutputsParams(choice=[edited])))
        targets.append(wanted)
    return prompts, params, targets


def run_ngram(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    from mini_infer.engine.detokenizer import load_tokenizer

    target = resolve_model(options.target or model_dir, log)
    prompts, params, wanted = copy_requests(load_tokenizer(Path(target)), max(options.batches), options.edit_every)
    requests = {b: (prompts[:b], params[:b]) for b in options.batches}
    low, high = options.prompt_lookup
    settings = []
    for k in options.ks:
        for adaptive in (False, True):
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
                    "prompt_lookup_max": high, "adaptive": adaptive}
            settings.append(Setting(f"k{'<=' if adaptive else '='}{k}{' adaptive' if adaptive else ''}", spec,
                                    (None,), k, adaptive))
    longest = max(len(p) + s.max_tokens for p, s in zip(prompts, params))
    engine_args = dict(dtype=options.dtype, max_num_seqs=max(options.batches), enable_prefix_caching=False,
                       max_model_len=longest + max(options.ks) + KV_MARGIN,
                       quantization=options.quantization[0] if options.quantization else None)
    measured = run_bracketed(options, target, engine_args, settings, requests, log)
    rows = []
    for index, setting in enumerate(settings, 1):
        for size in options.batches:
            rows.append(_row(setting, size, None, measured.settings[setting.name][(size, None)],
                             _off_baseline(measured, index, size), measured.continuations[size]))
    copied = [sum(a == b for a, b in zip(out, want)) for out, want in zip(measured.continuations[max(options.batches)],
                                                                        wanted)]
    config = {"target": target, "dtype": options.dtype, "quantization": engine_args["quantization"],
              "batch_sizes": list(options.batches), "ks": list(options.ks), "prompt_lookup_min": low,
              "prompt_lookup_max": high, "edit_every": options.edit_every, "reps": options.reps,
              "prompt_lens": [len(p) for p in prompts], "output_lens": [len(w) for w in wanted],
              "copied_tokens": f"{sum(copied)}/{sum(len(w) for w in wanted)}", "kernels": measured.kernels,
              "off_consistent": measured.off_consistent, "note": options.note}
    return {"workload": "speculative-ngram", "config": config, "off_brackets": _brackets(measured), "rows": rows}


def _ngram_headline(report: dict) -> list[str]:
    config = report["config"]
    return [f"{config['target']} ({config['dtype']}): copy with edits, n-gram proposer (lookup "
            f"{config['prompt_lookup_min']}-{config['prompt_lookup_max']} tokens), {config['reps']} reps",
            f"each request rewrites a passage of {TEXTS_PER_PASSAGE} built-in texts with every "
            f"{config['edit_every']}th word changed (prompts {min(config['prompt_lens'])}-{max(config['prompt_lens'])} "
            f"tokens, outputs {min(config['output_lens'])}-{max(config['output_lens'])}); the output is steered to "
            "the edited passage by a structured-outputs choice and a logit_bias on its tokens (greedy); off's "
            f"outputs matched the edited passage's tokens at {config['copied_tokens']} positions",
            "tok/s over the decode steps; off tok/s the mean of the speculation-off runs just before and after the "
            "setting's engine; same tokens: requests whose output equals speculation off's; the grammar cuts a "
            "request's drafts at the first it would not take (the scheduler's rule), so drafts that run into an edit "
            "are cut there instead of rejected: accepted is of the drafts verified, and tok/verify is what it would be "
            "without the cut",
            *_footer(config)]


def _ngram_rows(report: dict) -> list[dict | None]:
    rows, last = [], None
    for row in sorted(report["rows"], key=lambda r: (r["batch_size"], r["k"], r["adaptive"])):
        if last is not None and row["batch_size"] != last:
            rows.append(None)
        last = row["batch_size"]
        rows.append(row)
    return rows


def _ngram_chart(report: dict) -> tuple[str, list[Panel]]:
    config, rows = report["config"], report["rows"]
    labels, off, on = [], [], []
    for row in sorted(rows, key=lambda r: (r["batch_size"], r["k"], r["adaptive"])):
        labels.append(f"B={row['batch_size']}\n{row['setting']}")
        off.append(row["off_tok_s"])
        on.append(row["tok_s"])
    return (f"n-gram speculation, copy with edits: {Path(config['target']).name}, {config['dtype']}",
            [Panel("decode tokens / s", labels, [Series("speculation off", off), Series("n-gram", on)],
                   width=max(1.0, len(labels) / 6), fontsize=7)])


_COMMON = (Column("batch", "batch_size"), Column("setting", "setting"))
_RATES = (Column("tok/s", "tok_s", "{:.2f}"), Column("min-max", "tok_s_spread", "{0[min]:.1f}-{0[max]:.1f}"),
          Column("off tok/s", "off_tok_s", "{:.2f}"),
          Column("speed-up", "speedup", "{:.2f}x"))
SPECULATIVE_DRAFT = Workload(run_draft, _draft_headline, (
    *_COMMON, Column("alpha", "alpha", "{:g}"), *_RATES, Column("predicted", "predicted_speedup", "{:.2f}x"),
    Column("accepted", "acceptance", "{:.2f}"), Column("expected", "expected_acceptance", "{:.2f}"),
    Column("tok/verify", "tokens_per_verify", "{:.2f}"), Column("expected", "expected_tokens_per_verify", "{:.2f}"),
    Column("c_v", "c_verify", "{:.2f}"), Column("c_d", "c_draft", "{:.3f}"),
    Column("draft right", "draft_right", "{:.2f}"), Column("same tokens", "same_tokens"),
    Column("diverged", "diverged")),
    _draft_rows, _speedup_chart)
SPECULATIVE_NGRAM = Workload(run_ngram, _ngram_headline, (
    *_COMMON, *_RATES, Column("accepted", "acceptance", "{:.2f}"), Column("tok/verify", "tokens_per_verify", "{:.2f}"),
    Column("verify steps", "num_drafts"), Column("same tokens", "same_tokens")),
    _ngram_rows, _ngram_chart)
