"""The bench's peers (bench/peers.py, bench/peer_env.py, bench/workers/): the flags that name them, setup once
and the skip with its reason when setup fails (no real build: the recipes are replaced), the worker protocol
through a fake worker, and, where the llama.cpp peer is set up on this machine, its greedy tokens."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

import pytest

from mini_infer.bench import peers
from mini_infer.bench.options import BenchOptions, add_bench_args
from mini_infer.bench.peer_env import WORKERS_DIR, PeerUnavailable, PeerVenv, Recipe, Worker, parse_answer
from mini_infer.bench.peers import checkpoint_key, run_result
from mini_infer.bench.systems import DEFAULT_SYSTEMS, Case, SystemFactory, run_systems


def _options(*flags: str) -> BenchOptions:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return BenchOptions.from_args(parser.parse_args(list(flags)))


def test_default_systems_stay_hf_and_mini_infer_and_peers_are_accepted_by_name():
    assert _options().systems == DEFAULT_SYSTEMS == ("hf-generate", "hf-continuous", "mini-infer")
    named = _options("--systems", "vllm-cpu,hf-generate,llama.cpp,mini-infer", "--gguf-outtype", "q8_0")
    assert named.systems == ("hf-generate", "mini-infer", "llama.cpp", "vllm-cpu")
    assert named.gguf_outtype == "q8_0" and _options().gguf_outtype is None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_INFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_peer_whose_setup_fails_is_skipped_with_the_reason(cache, tiny_model_dir, monkeypatch):
    failing = Recipe("llama.cpp", minutes=6, steps=(
        ("{base}", "-c", "print('building llama.cpp'); raise SystemExit('no C++ compiler found')"),))
    monkeypatch.setattr(peers, "LLAMA_CPP", failing)
    messages = []
    factory = SystemFactory(str(tiny_model_dir), "float32", max_requests=1, max_seq_len=8, log=messages.append)
    case = Case("B=1", [[1, 2]], [2], [[1, 2]], [1])
    records = run_systems(factory, ["llama.cpp"], [case], 1, messages.append)
    reason = records["llama.cpp"]["reason"]
    assert reason.startswith("PeerUnavailable: llama.cpp setup failed") and "no C++ compiler found" in reason
    assert str(cache / "peers" / "llama.cpp" / "setup.log") in reason
    assert records["llama.cpp"]["runs"] == {} and records["llama.cpp"]["setup"] is None
    assert any(m.startswith("llama.cpp: first use, setting it up in") for m in messages)
    assert f"llama.cpp skipped: {reason}" in messages
    assert not PeerVenv("llama.cpp").marker.exists()  # the next run tries again


def test_setup_runs_once_and_its_record_is_kept(cache):
    counting = Recipe("demo", minutes=1, record={"package": "demo 1.0"},
                      steps=(("{base}", "-c", "open(r'{root}/runs', 'a').write('x')"),))
    messages = []
    venv = PeerVenv("demo")
    assert venv.ensure(counting, messages.append) == {"package": "demo 1.0"}
    assert venv.ensure(counting, messages.append) == {"package": "demo 1.0"}
    assert (cache / "peers" / "demo" / "runs").read_text() == "x"
    assert len(messages) == 2 and "first use" in messages[0]  # the first use and "set up", nothing the second time


FAKE_WORKER = textwrap.dedent("""
    import os
    import sys

    from worker_protocol import serve

    def load(settings):
        if settings.get("fail"):
            raise OSError("no such model")
        if settings.get("exit"):
            print("fatal: out of memory", file=sys.stderr, flush=True)
            os._exit(settings["exit"])

        def run(prompts, output_lens):
            print("library chatter on stdout")  # must not reach the answers
            if min(output_lens) < 1:
                raise ValueError("output_len must be >= 1")
            ids = [[prompt[-1] + i for i in range(n)] for prompt, n in zip(prompts, output_lens)]
            return {"token_ids": ids, "finish_s": [0.25 * n for n in output_lens], "wall_s": 0.5}

        return {"version": settings["version"]}, run

    serve(load)
""")


def _fake_worker(tmp_path, settings: dict) -> Worker:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return Worker("fake", sys.executable, script, settings, tmp_path / "worker.log",
                  env={"PYTHONPATH": str(WORKERS_DIR)})


def test_a_worker_answers_runs_and_reports_its_errors(tmp_path):
    worker = _fake_worker(tmp_path, {"version": "9.9"})
    try:
        assert worker.ready == {"version": "9.9"}
        result = run_result(worker.call({"prompts": [[5, 7], [3]], "output_lens": [3, 1]}), [3, 1])
        assert result.token_ids == [[7, 8, 9], [3]] and result.finish_s == [0.75, 0.25] and result.wall_s == 0.5
        with pytest.raises(RuntimeError, match="fake worker: ValueError: output_len must be >= 1"):
            worker.call({"prompts": [[1]], "output_lens": [0]})
        assert run_result(worker.call({"prompts": [[1]], "output_lens": [2]}), [2]).token_ids == [[1, 2]]
    finally:
        worker.close()
    assert worker.process.returncode == 0
    assert "library chatter on stdout" in (tmp_path / "worker.log").read_text()


def test_a_worker_that_cannot_load_or_dies_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="fake worker: loading failed: OSError: no such model"):
        _fake_worker(tmp_path, {"fail": True})
    with pytest.raises(RuntimeError, match="fake worker exited with 3: fatal: out of memory"):
        _fake_worker(tmp_path, {"exit": 3})


def test_worker_answers_are_checked():
    assert parse_answer('{"ready": {"version": "1"}}', "w") == {"ready": {"version": "1"}}
    with pytest.raises(RuntimeError, match="not JSON"):
        parse_answer("llama_model_loader: loaded meta data\n", "w")
    with pytest.raises(RuntimeError, match="w worker: boom"):
        parse_answer('{"error": "boom"}', "w")
    with pytest.raises(RuntimeError, match="asked for"):
        run_result({"token_ids": [[1, 2]], "finish_s": [0.1], "wall_s": 0.1}, [3])
    with pytest.raises(RuntimeError, match="lacks"):
        run_result({"token_ids": [[1]]}, [1])


def test_the_gguf_cache_key_follows_the_checkpoint_files(tmp_path):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    key = checkpoint_key(checkpoint)
    assert checkpoint_key(checkpoint) == key
    os.utime(checkpoint / "config.json", ns=(1, 1))
    assert checkpoint_key(checkpoint) != key
    (checkpoint / "model.safetensors").write_bytes(b"0")
    assert len({key, checkpoint_key(checkpoint)}) == 2


def test_an_unknown_gguf_type_is_refused(cache, tiny_model_dir):
    with pytest.raises(ValueError, match="GGUF outtype must be one of f32, bf16, q8_0, q4_0"):
        peers.LlamaCpp(str(tiny_model_dir), "q2_k", max_requests=1, max_seq_len=8, log=print)


@pytest.mark.skipif(not PeerVenv("llama.cpp").marker.is_file(), reason="the llama.cpp peer is not set up here")
def test_llama_cpp_decodes_the_greedy_tokens_of_mini_infer_in_float32(tiny_model_dir):
    """Same prompts, each request its own length, several sequences decoding together."""
    prompts, output_lens = [[9707, 11, 1879, 0, 576], [785, 3974], [40, 1079, 264, 3460, 1614, 13]], [6, 3, 5]
    factory = SystemFactory(str(tiny_model_dir), "float32", max_requests=3, max_seq_len=16)
    outputs = {}
    for name in ("mini-infer", "llama.cpp"):
        system = factory.build(name)
        try:
            outputs[name] = system.run(prompts, output_lens).token_ids
        finally:
            system.close()
    os.unlink(system.info["gguf"])  # converted from this session's temporary checkpoint: never used again
    assert [len(ids) for ids in outputs["llama.cpp"]] == output_lens
    assert outputs["llama.cpp"] == outputs["mini-infer"]


def test_a_failed_step_stops_the_setup_with_a_one_line_reason(cache):
    recipe = Recipe("demo", minutes=1, steps=(("{base}", "-c", "import sys; print('step one'); sys.exit(3)"),
                                              ("{base}", "-c", "open(r'{root}/second', 'w')")))
    with pytest.raises(PeerUnavailable) as failure:
        PeerVenv("demo").ensure(recipe, lambda message: None)
    assert "\n" not in str(failure.value) and "exited 3 (step one)" in str(failure.value)
    assert not (cache / "peers" / "demo" / "second").exists()
