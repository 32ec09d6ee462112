"""Shared fixtures: random-weight Qwen2 checkpoints written by HF transformers, every tensor perturbed; the
processes under a pid, from /proc (what a test checks is left behind)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from mini_infer.paths import cache_dir

# What mini-infer writes once (autotune tables, the tokenizer, the default model) goes to a cache of this test run's
# own, so that no result depends on what a developer's cache holds. Lent from the user's cache instead: the peers'
# set-ups (llama.cpp, vLLM's CPU build: minutes each) and the real clients' installs (the Codex CLI, the Agents SDK),
# all outside the project's code; the compiled kernels, each named by a hash of its source, headers, flags and
# compiler (kernels/build.py), so that a library is only ever the build of the code it is tested as; and the
# converted Qwen tokenizer, named by a hash of the vocabulary and the builder's version (factory/tokenizer.py;
# tests/test_factory.py converts it afresh in a cache of its own). The clients' installs, the kernels and the
# tokenizer are kept there for the next run (the kernels take ~45 s to build on two cores, the tokenizer ~6 s).
# A process the test run starts that imports this module (a rank or replica unpickling a test's function) inherits
# the run's cache and its MINI_INFER_CACHE through the environment: it makes no cache of its own, which nothing would
# remove.
_USER_PEERS = cache_dir() / "peers"
_OWNER = None  # the process that made the cache (it removes it at the end)
if "MINI_INFER_TEST_CACHE" in os.environ:
    TEST_CACHE = Path(os.environ["MINI_INFER_TEST_CACHE"])
else:
    TEST_CACHE, _OWNER = Path(tempfile.mkdtemp(prefix="mini-infer-test-cache-")), os.getpid()
    if _USER_PEERS.is_dir():
        (TEST_CACHE / "peers").symlink_to(_USER_PEERS)
    for _kept in ("clients", "kernels", "tokenizers"):
        (cache_dir() / _kept).mkdir(parents=True, exist_ok=True)
        (TEST_CACHE / _kept).symlink_to(cache_dir() / _kept)
    os.environ["MINI_INFER_TEST_CACHE"] = os.environ["MINI_INFER_CACHE"] = str(TEST_CACHE)


def pytest_collection_finish(session):
    """The real clients' installs start as soon as their tests are collected (tests/test_clients.py)."""
    if any(item.nodeid.startswith("tests/test_clients.py") for item in session.items):
        from tests.test_clients import start_installs

        start_installs()


def pytest_sessionfinish(session, exitstatus):
    if os.getpid() == _OWNER:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


# The engine's device in the parity tests (the HF reference always runs on the CPU in float64).
DEVICE = os.environ.get("MINI_INFER_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    # The GPU's Triton kernels run in Triton's interpreter on the CPU (gpu_kernels="on"); it must be chosen before
    # any kernel is defined, that is before mini_infer.kernels.triton is first imported.
    os.environ["TRITON_INTERPRET"] = "1"
# gpu_kernels for the tests of the GPU path: "on" runs them in the interpreter here, "auto" on a CUDA device.
GPU_KERNELS = "on" if DEVICE == "cpu" else "auto"

PARITY_CONFIGS = {
    # tied head, a single KV head (4 query heads share it)
    "tied-1kv": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0,
                     tie_word_embeddings=True),
    # untied head, GQA with 2 KV heads, Qwen2.5's rope_theta
    "untied-gqa": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                       tie_word_embeddings=False),
    # plain multi-head (6 KV heads), another rope_theta, 3 layers
    "untied-mha": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6, rope_theta=500000.0,
                       tie_word_embeddings=False, num_hidden_layers=3),
}


def build_hf_model(seed: int = 0, vocab_size: int = 1000, *, architecture: str = "qwen2", rope_scaling=None,
                   **overrides):
    """A transformers Qwen2ForCausalLM (or Qwen3ForCausalLM / LlamaForCausalLM / Qwen2MoeForCausalLM /
    Qwen3MoeForCausalLM, `architecture="qwen3"` / `"llama"` / `"qwen2_moe"` / `"qwen3_moe"`;
    `rope_scaling`: llama3 parameters) in float64 with every tensor randomised: HF's init leaves biases at 0 and norm
    weights at 1, which would hide loading bugs there."""
    import transformers

    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0)
    settings.update(overrides)
    rope = {"rope_type": "default", "rope_theta": settings.pop("rope_theta")}
    if rope_scaling is not None:
        rope.update(rope_type="llama3", **rope_scaling)
    family = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
    config_class, model_class = (getattr(transformers, name) for name in family[architecture])
    # The experts in HF's own loop (its default grouped matmul refuses float64).
    experts = {"experts_implementation": "eager"} if architecture.endswith("moe") else {}
    config = config_class(**settings, rope_parameters=rope, attn_implementation="sdpa", **experts)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model, out_dir: Path, *, layout: str = "transformers5", max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if layout == "published":
        to_published_layout(out_dir / "config.json")
    return out_dir


def to_published_layout(config_path: Path) -> None:
    """Rewrite a transformers-5 config.json the way published Qwen2.5 checkpoints spell it."""
    raw = json.loads(config_path.read_text())
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    raw["rope_scaling"] = None
    raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("layer_types", None)
    config_path.write_text(json.dumps(raw, indent=2))


def rms_norm_float64(self, hidden_states):
    """HF's RMSNorm forward, normalising in the model's float64 rather than float32 (patched over HF's class where a
    test compares logits to float64 rounding)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The logits of every position of `prompt`, from one prefill step of `engine` (the request stays scheduled)."""
    from dataclasses import replace

    from mini_infer import SamplingParams

    engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    step = engine.runner.prepare(engine.scheduler.schedule())
    return engine.runner.forward(replace(step, logits_indices=torch.arange(step.num_tokens)))


# The prompts of the architecture parity tests (test_families.py, test_moe.py) and their greedy continuations' length.
FAMILY_PROMPT_LENGTHS = [1, 3, 17, 40, 96, 7]
FAMILY_NEW_TOKENS = 24


def family_checkpoint(name: str, architecture: str, config: dict, out_dir: Path):
    """(checkpoint dir, HF model, prompts, HF greedy continuation of each prompt alone) of a perturbed random model
    of `architecture` (build_hf_model) named `name` (its seed and prompts' seed)."""
    import random

    model = build_hf_model(seed=len(name), architecture=architecture, **config)
    path = save_hf_model(model, out_dir)
    rng = random.Random(name)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in FAMILY_PROMPT_LENGTHS]
    return path, model, prompts, [hf_greedy(model, p, FAMILY_NEW_TOKENS) for p in prompts]


def check_preemption_prefix_caching_and_chunks(path: Path, model, prompts: list[list[int]],
                                               expected: list[list[int]]) -> None:
    """Greedy tokens equal HF's alone with 36 blocks of 4 tokens (the longest request alone needs 30: preemption),
    shared prefixes (cache hits) and 16-token chunks, and every block returns."""
    from mini_infer import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=FAMILY_NEW_TOKENS, ignore_eos=True)
    shared = prompts + [prompts[4][:50] + prompts[2][:9]]
    llm = LLM(str(path), dtype="float64", block_size=4, num_kv_blocks=36, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=16, device=DEVICE)
    outputs = llm.generate(shared + shared[:2], greedy, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    alone = hf_greedy(model, shared[-1], FAMILY_NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == expected + [alone] + expected[:2]
    assert llm.engine.kv_cache.num_free_blocks == 36


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def processes() -> list[tuple[int, str, int, int, bytes]]:
    """(pid, state, parent pid, process group, command line) of every process /proc lists."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            found.append((int(entry), fields[0], int(fields[1]), int(fields[2]), cmdline))
    return found


def descendants(root: int) -> list[int]:
    """Every live process under `root`, bar multiprocessing's resource tracker and fork servers (each leaves with the
    process that started it); the processes a fork server started are listed."""
    live = [(pid, ppid, cmdline) for pid, state, ppid, _, cmdline in processes() if state != "Z"]
    parents = {pid: ppid for pid, ppid, cmdline in live if b"resource_tracker" not in cmdline}
    servers = {pid for pid, _, cmdline in live if is_fork_server(pid, cmdline)}
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += [pid for pid in children if pid not in servers]
        frontier += children
    return found


def is_fork_server(pid: int, cmdline: bytes) -> bool:
    """multiprocessing's fork server itself: the processes it forks share its command line, but the engine's name
    themselves (distributed/processes.py)."""
    if b"multiprocessing.forkserver" not in cmdline:
        return False
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return not f.read().startswith(b"mini-infer:")
    except OSError:
        return False


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The `tiny` preset written by mini-infer's own factory (Qwen2.5 vocabulary and tokenizer)."""
    from mini_infer.factory import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny") / "model", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory) -> Path:
    """The `qwen3-tiny` preset: Qwen3's tokenizer (<think> tokens) and its chat template with the thinking switch."""
    from mini_infer.factory import make_model

    return make_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3") / "model", seed=0, dtype="float32")


@pytest.fixture
def short_kl_workload(tmp_path, monkeypatch):
    """bench/kl.py over the first half of its text (two chunks of 512, the fewest it takes), its engines on one kernel
    path (no autotuning); the module."""
    from mini_infer.bench import kl

    half = tmp_path / "kl.txt"
    text = kl.TEXT.read_text()
    half.write_text(text[: len(text) // 2])
    monkeypatch.setattr(kl, "TEXT", half)
    settings = kl.engine_settings
    monkeypatch.setattr(kl, "engine_settings", lambda *a: {**settings(*a), "cpu_kernels": "on"})
    return kl
