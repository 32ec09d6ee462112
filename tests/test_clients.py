"""Real clients of the Responses API against mini-infer: the OpenAI Codex CLI (npm @openai/codex) runs `codex exec` to
completion, and the OpenAI Agents SDK (PyPI openai-agents) runs an agent that calls a function tool, streamed and not.
Each client is installed once into the cache (its own directory or venv), and its test is skipped with the reason
when it cannot be installed.

Random weights never end an answer, and these clients send no token limit of their own, so the model here is one
whose answers end: the final norm keeps one hidden dimension, on which the two end-of-turn tokens' output rows are
+-1000 (whatever that dimension's sign, one of them dominates), and generation_config.json's min_new_tokens gives an
answer its first tokens before that. What the tests check (the protocol) does not depend on the weights' sense.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from mini_infer.engine.async_engine import AsyncLLMEngine
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.metrics import EngineMetrics
from mini_infer.entrypoints.openai.api_server import build_app
from mini_infer.paths import cache_dir
from tests.test_server import ServerThread

CODEX_VERSION = "0.171.0"
AGENTS_VERSION = "0.24.0"
MODEL = "mini-model"
ANSWER_TOKENS = 6
END_OF_TURN = (151645, 151643)  # <|im_end|>, <|endoftext|>: generation_config.json's eos_token_id


@pytest.fixture(scope="module")
def ending_model_dir(tmp_path_factory):
    from mini_infer.factory import make_model

    path = make_model("tiny", tmp_path_factory.mktemp("ending") / "model", seed=0, dtype="float32",
                      overrides={"max_position_embeddings": 32768})
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    weights["model.norm.weight"][0] = 1.0
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head][END_OF_TURN[0], 0], weights[head][END_OF_TURN[1], 0] = 1000.0, -1000.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "min_new_tokens": ANSWER_TOKENS}))
    return path


@pytest.fixture(scope="module")
def server(ending_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(ending_model_dir), dtype="float64", num_kv_blocks=2048,
                                                max_model_len=32768), EngineMetrics(MODEL))
    with ServerThread(build_app(engine, MODEL)) as thread:
        yield thread
    engine.shutdown()


def _run(what: str, command: list[str]) -> str | None:
    """Run an install command: None if it succeeded, else why not."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot install {what}: {e}"
    return None if result.returncode == 0 else f"cannot install {what}: {result.stderr.strip()[-300:]}"


def _install_codex() -> tuple[str | None, str | None]:
    """(the codex binary, None), or (None, why it cannot be installed)."""
    root = cache_dir() / "clients" / f"codex-{CODEX_VERSION}"
    binary = root / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        if shutil.which("npm") is None:
            return None, "cannot install the Codex CLI: npm is not on PATH"
        why = _run(f"@openai/codex@{CODEX_VERSION}", ["npm", "install", "--no-audit", "--no-fund", "--prefix",
                                                     str(root), f"@openai/codex@{CODEX_VERSION}"])
        if why is not None:
            return None, why
    return str(binary), None


def _install_agents() -> tuple[str | None, str | None]:
    """(the python of a venv with openai-agents, None), or (None, why it cannot be installed)."""
    venv = cache_dir() / "clients" / f"openai-agents-{AGENTS_VERSION}"
    python, marker = venv / "bin" / "python", venv / ".installed"  # the marker: written once the install succeeded
    if not marker.exists():
        why = _run("a venv", [sys.executable, "-m", "venv", "--clear", str(venv)]) or _run(
            f"openai-agents=={AGENTS_VERSION}", [str(python), "-m", "pip", "install", "-q",
                                                 f"openai-agents=={AGENTS_VERSION}"])
        if why is not None:
            return None, why
        marker.touch()
    return str(python), None


_installs: dict[str, Future] = {}


def start_installs() -> None:
    """Install both clients in the background (conftest starts this as the session begins, when these tests are
    collected: the downloads then overlap the tests that run before)."""
    if not _installs:
        pool = ThreadPoolExecutor(max_workers=2)
        _installs.update(codex=pool.submit(_install_codex), agents=pool.submit(_install_agents))
        pool.shutdown(wait=False)


def _installed(name: str) -> str:
    start_installs()
    path, why = _installs[name].result()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def codex() -> str:
    return _installed("codex")


@pytest.fixture(scope="module")
def agents_python() -> str:
    return _installed("agents")


def test_codex_exec_runs_to_completion(server, codex, tmp_path):
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(textwrap.dedent(f"""\
        model = "{MODEL}"
        model_provider = "mini"
        approval_policy = "never"
        sandbox_mode = "read-only"

        [model_providers.mini]
        name = "mini-infer"
        base_url = "{server.url}/v1"
        wire_api = "responses"
        env_key = "MINI_API_KEY"
        request_max_retries = 0
        stream_max_retries = 0
        """))
    env = {**os.environ, "CODEX_HOME": str(home), "MINI_API_KEY": "unused"}
    result = subprocess.run([codex, "exec", "--skip-git-repo-check", "--ephemeral", "--json", "say hi"], cwd=work,
                            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages and messages[-1], result.stdout[-2000:]  # the model's answer reached Codex
    assert any(e.get("type") == "turn.completed" for e in events), result.stdout[-2000:]


AGENT = """
import asyncio, json, sys
from typing import Literal
from openai import AsyncOpenAI
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

calls = []

@function_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    \"\"\"The weather in a city.\"\"\"
    calls.append(city)
    return f"sunny in {city}"

async def main(base_url, model):
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agent = Agent(name="Assistant", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200))
    whole = await Runner.run(agent, "What is the weather in Paris?")
    streamed = Runner.run_streamed(agent, "And in Rome?")
    kinds = [event.data.type async for event in streamed.stream_events() if event.type == "raw_response_event"]
    print(json.dumps({"calls": calls, "finals": [whole.final_output, streamed.final_output], "kinds": kinds}))

asyncio.run(main(*sys.argv[1:]))
"""


def test_agents_sdk_runs_an_agent_with_a_function_tool(server, agents_python, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    result = subprocess.run([agents_python, str(script), f"{server.url}/v1", MODEL], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    # tool_choice required: the first turn of each run calls the tool; the SDK then resets it to auto, and the model
    # answers in text, which ends the run.
    assert len(outcome["calls"]) == 2 and set(outcome["calls"]) <= {"Paris", "Rome"}
    assert all(outcome["finals"]), outcome
    assert "response.function_call_arguments.delta" in outcome["kinds"]
    assert outcome["kinds"][-1] == "response.completed"
