"""`bench --workload kl`: how far each quantised model's next-token distributions are from the unquantised model's,
over the same ~2,000 tokens of English text, the way llama.cpp's `llama-perplexity --kl-divergence` measures it.

The text (texts/kl.txt) is cut into chunks of CHUNK tokens (no BOS: Qwen2 has none), each run from position 0; the
distributions at positions CHUNK/2 .. CHUNK-2 of each chunk are scored (the first half is context; llama-perplexity
scores the same positions). Per position: KL(base || quantised) = sum over the vocabulary of p_base (log p_base -
log p_quantised), in float64, and whether the two argmaxes agree. mini-infer's quantised engines are compared with
its own engine in --dtype; llama.cpp's q8_0 / q4_0 GGUFs with its own bf16 GGUF, by llama-perplexity itself.

With --kl-base, the model is a quantised GGUF file (a Q4_K_M, say) and both systems run that very file: mini-infer's
engine of it against its engine of the base (a bf16 GGUF or a checkpoint directory), llama-perplexity on it against
the base as a bf16 GGUF.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from mini_infer import gguf_file
from mini_infer.bench.charts import Panel, Series
from mini_infer.bench.options import BenchOptions
from mini_infer.bench.peer_env import PeerUnavailable, PeerVenv
from mini_infer.bench.peers import LLAMA_CPP, convert_to_gguf, llama_cpp_tools, quantize_gguf
from mini_infer.bench.report import Column, Workload
from mini_infer.bench.systems import QUANTIZED_SYSTEMS
from mini_infer.config import EngineConfig
from mini_infer.engine.detokenizer import load_tokenizer
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.model.attention import AttentionMetadata

TEXT = Path(__file__).parent / "texts" / "kl.txt"
CHUNK = 512


def text_tokens(model_dir: str) -> list[int]:
    tokenizer = load_tokenizer(Path(model_dir))
    if tokenizer is None:
        raise ValueError(f"model {model_dir} has no tokenizer.json; the KL workload scores real text")
    return tokenizer.encode(TEXT.read_text(), add_special_tokens=False)


def chunk_logprobs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """float64 log-softmax [CHUNK/2 - 1, vocab] of the model's next-token logits at positions CHUNK/2 .. CHUNK-2 of
    one chunk, run as a single prefill into the idle engine's first KV blocks (none of which a request holds)."""
    runner, block_size = engine.runner, engine.config.block_size
    blocks = -(-len(tokens) // block_size)
    if engine.has_unfinished_requests() or engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks \
            or blocks > engine.kv_cache.num_blocks:
        raise RuntimeError("the KL workload runs its chunks in an idle engine with room for one chunk")
    count = len(tokens)
    meta = AttentionMetadata(slot_mapping=torch.arange(count), block_tables=torch.arange(blocks)[None],
                             context_lens=torch.tensor([count]), query_start_loc=torch.tensor([0, count]),
                             context_lens_host=[count], num_decodes=0)
    with torch.inference_mode():
        logits = runner.model(torch.tensor(tokens), torch.arange(count), runner.kv_caches, meta,
                              torch.arange(count // 2, count - 1))
    vocab = engine.config.model_config.vocab_size
    return torch.log_softmax(logits[:, :vocab].double(), dim=-1)


def engine_settings(model_dir: str, dtype: str) -> dict:
    """EngineConfig fields of an engine that runs one chunk at a time (chunk_logprobs)."""
    return dict(model=model_dir, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=CHUNK,
                num_kv_blocks=CHUNK // 16 + 1)


def text_logprobs(model_dir: str, dtype: str, **settings) -> torch.Tensor:
    """chunk_logprobs of every whole chunk of the text, concatenated, from an engine of its own (`settings`: more
    EngineConfig fields, quantization say)."""
    tokens = text_tokens(model_dir)
    engine = LLMEngine(EngineConfig(**engine_settings(model_dir, dtype), **settings))
    try:
        return torch.cat([chunk_logprobs(engine, tokens[c * CHUNK: (c + 1) * CHUNK])
                          for c in range(len(tokens) // CHUNK)])
    finally:
        engine.shutdown()


def divergence(base: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(base || other) and whether the argmaxes agree (first index on ties, as torch's argmax)."""
    return (base.exp() * (base - other)).sum(dim=-1), base.argmax(dim=-1) == other.argmax(dim=-1)


def run_kl(options: BenchOptions, model_dir: str, log: Callable[[str], None]) -> dict:
    tokens = text_tokens(model_dir)
    chunks = len(tokens) // CHUNK
    if chunks < 2:
        raise ValueError(f"{TEXT} gives {len(tokens)} tokens; the KL workload needs at least {2 * CHUNK}")
    config = {"model": model_dir, "dtype": options.dtype, "systems": list(options.systems), "text": TEXT.name,
              "text_tokens": len(tokens), "chunk": CHUNK, "chunks": chunks,
              "scored_positions": f"{CHUNK // 2}..{CHUNK - 2} of each chunk"}
    if options.kl_base is not None:
        return {"workload": "kl", "config": {**config, "base": options.kl_base},
                "systems": _file_kl(options, model_dir, tokens, log)}
    ours = [name for name in options.systems if QUANTIZED_SYSTEMS.get(name, ("",))[0] == "mini-infer"]
    peers = [name for name in options.systems if QUANTIZED_SYSTEMS.get(name, ("",))[0] == "llama.cpp"]
    if not ours and not peers:
        raise ValueError("the KL workload compares quantised systems: pass --quantization int8,int4 with "
                         "--systems mini-infer (and llama.cpp), or name mini-infer-int8, llama.cpp-q8_0 ...; or a "
                         "quantised GGUF file as --model with --kl-base")
    systems = {}
    if ours:
        settings = engine_settings(model_dir, options.dtype)
        log(f"mini-infer: {options.dtype} and {', '.join(ours)} over {chunks} chunks of {CHUNK} tokens")
        engines = {name: LLMEngine(EngineConfig(**settings, quantization=QUANTIZED_SYSTEMS[name][1])) for name in ours}
        systems.update(_scores(LLMEngine(EngineConfig(**settings)), engines, tokens, f"mini-infer {options.dtype}"))
    for name in peers:
        try:
            systems[name] = _llama_cpp_kl(model_dir, QUANTIZED_SYSTEMS[name][1], log)
        except (PeerUnavailable, RuntimeError) as error:
            systems[name] = {"reason": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
            log(f"{name} skipped: {systems[name]['reason']}")
    return {"workload": "kl", "config": config, "systems": systems}


def _scores(base: LLMEngine, engines: dict[str, LLMEngine], tokens: list[int], base_name: str) -> dict:
    """Each engine's mean KL from `base` and its top-1 agreement over the text's chunks; every engine shut down."""
    scores = {name: ([], []) for name in engines}
    try:
        for c in range(len(tokens) // CHUNK):
            chunk = tokens[c * CHUNK: (c + 1) * CHUNK]
            reference = chunk_logprobs(base, chunk)
            for name, engine in engines.items():
                kl, same = divergence(reference, chunk_logprobs(engine, chunk))
                scores[name][0].append(kl)
                scores[name][1].append(same)
    finally:
        for engine in (base, *engines.values()):
            engine.shutdown()
    systems = {}
    for name, (kl, same) in scores.items():
        kl, same = torch.cat(kl), torch.cat(same)
        systems[name] = {"reason": None, "base": base_name, "mean_kl": kl.mean().item(),
                         "top1_same_pct": 100 * same.double().mean().item(), "positions": len(kl)}
    return systems


def _file_kl(options: BenchOptions, model_dir: str, tokens: list[int], log: Callable[[str], None]) -> dict:
    """--kl-base: the quantised GGUF file `model_dir` stands for, run by mini-infer and llama.cpp, each against its own
    run of the base."""
    link = Path(model_dir) / gguf_file.LINK
    if not link.exists():
        raise ValueError(f"--kl-base compares a quantised GGUF file (--model file.gguf) with its base; {model_dir} is "
                         "not a GGUF file's")
    base = Path(options.kl_base)
    if not (base.is_dir() or gguf_file.is_gguf(str(base))):
        raise ValueError(f"--kl-base must be a checkpoint directory or a GGUF file, got {options.kl_base}")
    systems = {}
    if "mini-infer" in options.systems:
        log(f"mini-infer: {link.resolve().name} against {base.name} over {len(tokens) // CHUNK} chunks of {CHUNK} "
            "tokens")
        engine = LLMEngine(EngineConfig(**engine_settings(model_dir, options.dtype)))
        systems.update(_scores(LLMEngine(EngineConfig(**engine_settings(str(base), options.dtype))),
                               {"mini-infer": engine}, tokens, f"mini-infer, {base.name} in {options.dtype}"))
    if "llama.cpp" in options.systems:
        try:
            venv = PeerVenv("llama.cpp")
            venv.ensure(LLAMA_CPP, log)
            base_gguf = base if base.is_file() else convert_to_gguf(venv.root, venv.root / "gguf", str(base), "bf16",
                                                                    log)
            systems["llama.cpp"] = _perplexity_kl(llama_cpp_tools(log), base_gguf, link.resolve(), venv.root / "gguf")
        except (PeerUnavailable, RuntimeError) as error:
            systems["llama.cpp"] = {"reason": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
            log(f"llama.cpp skipped: {systems['llama.cpp']['reason']}")
    return systems


_MEAN_KLD = re.compile(r"Mean\s+KLD:\s+([0-9.eE+-]+)")
_SAME_TOP = re.compile(r"Same top p:\s+([0-9.]+)")
_CHUNKS = re.compile(r"(\d+) chunks")


def _llama_cpp_kl(model_dir: str, outtype: str, log: Callable[[str], None]) -> dict:
    """llama-perplexity's two steps: the bf16 GGUF's distributions saved once, then each quantised GGUF's KL to them,
    on the same text and chunk size."""
    venv = PeerVenv("llama.cpp")
    venv.ensure(LLAMA_CPP, log)
    tools = llama_cpp_tools(log)
    bf16 = convert_to_gguf(venv.root, venv.root / "gguf", model_dir, "bf16", log)
    quantised = quantize_gguf(tools, bf16, outtype, log) if outtype == "q4_0" else \
        convert_to_gguf(venv.root, venv.root / "gguf", model_dir, outtype, log)
    return _perplexity_kl(tools, bf16, quantised, venv.root / "gguf")


def _perplexity_kl(tools: Path, base_gguf: Path, quantised: Path, cache: Path) -> dict:
    """llama-perplexity's two steps: the base GGUF's distributions saved once (in `cache`, keyed by the file), then
    the quantised GGUF's KL to them, on the same text and chunk size."""
    threads = str(torch.get_num_threads())
    stat = base_gguf.stat()
    base = cache / f"{base_gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}.kld"
    if not base.is_file():
        _perplexity(tools, ["-m", str(base_gguf), "-f", str(TEXT), "-c", str(CHUNK), "-t", threads,
                            "--kl-divergence-base", str(base)], base.with_suffix(".kld.log"))
    log_path = cache / f"{quantised.stem}.kld.log"
    output = _perplexity(tools, ["-m", str(quantised), "--kl-divergence-base", str(base), "--kl-divergence", "-t",
                                 threads], log_path)
    kl, same = _MEAN_KLD.search(output), _SAME_TOP.search(output)
    if kl is None or same is None:
        raise RuntimeError(f"llama-perplexity printed no 'Mean KLD' / 'Same top p' (log {log_path})")
    chunks = _CHUNKS.search(output)
    return {"reason": None, "base": f"llama.cpp, {base_gguf.name}", "mean_kl": float(kl.group(1)),
            "top1_same_pct": float(same.group(1)),
            "positions": int(chunks.group(1)) * (CHUNK // 2 - 1) if chunks is not None else None,
            "gguf": str(quantised)}


def _perplexity(tools: Path, args: list[str], log_path: Path) -> str:
    result = subprocess.run([str(tools / "llama-perplexity"), *args], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    log_path.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited {result.returncode} (log {log_path})")
    return result.stdout + result.stderr


def _headline(report: dict) -> list[str]:
    config = report["config"]
    return [f"{config['model']} ({config['dtype']}): KL divergence of each quantised model's next-token distribution "
            f"from its own unquantised one, {config['text']} ({config['text_tokens']} tokens) in {config['chunks']} "
            f"chunks of {config['chunk']}, positions {config['scored_positions']} scored"]


def _chart(report: dict) -> tuple[str, list[Panel]]:
    ran = {name: s for name, s in report["systems"].items() if s["reason"] is None}
    names = list(ran)
    return (f"KL divergence from the unquantised model, {Path(report['config']['model']).name}",
            [Panel("mean KL divergence", names, [Series("mean KL", [ran[n]["mean_kl"] for n in names])]),
             Panel("top-1 agrees (%)", names, [Series("same top-1", [ran[n]["top1_same_pct"] for n in names])])])


KL = Workload(run_kl, _headline, (
    Column("system", "system"), Column("against", "base"), Column("mean KL", "mean_kl", "{:.6f}"),
    Column("same top-1", "top1_same_pct", "{:.2f}%"), Column("positions", "positions")),
    lambda report: [{"system": name, **s} for name, s in report["systems"].items() if s["reason"] is None],
    _chart)
