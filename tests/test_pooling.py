"""Pooling models: embeddings and rerank scores against HF transformers in float64 on random Qwen3 models (every
tensor perturbed), through the same scheduler as generation (batched, chunked, preempted, from the prefix cache);
task detection; the server's /v1/embeddings (the official openai client), /v1/score and /v1/rerank, and their
refusals."""

from __future__ import annotations

import base64
import json
import random
import shutil
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from conftest import build_hf_model, save_hf_model
from mini_infer import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams, ScoringRequestOutput
from mini_infer.config import EngineConfig
from mini_infer.engine.async_engine import AsyncLLMEngine
from mini_infer.engine.detokenizer import load_tokenizer
from mini_infer.engine.input_processor import InputProcessor
from mini_infer.engine.kv_cache import KVCacheManager
from mini_infer.engine.llm_engine import LLMEngine
from mini_infer.engine.request import Request, RequestStatus
from mini_infer.engine.scheduler import Scheduler
from mini_infer.entrypoints.openai.api_server import build_app
from mini_infer.factory import make_model
from mini_infer.factory.checkpoint import SENTENCE_TRANSFORMERS
from mini_infer.runner.pooler import PoolerOutput
from test_server import ServerThread, start

# vLLM's hf_overrides for Qwen3-Reranker (a Qwen3ForCausalLM checkpoint).
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}
PROMPT_LENGTHS = [1, 3, 9, 16, 29, 41]
BLOCKS = 64
F64 = dict(dtype="float64", block_size=4, num_kv_blocks=BLOCKS)
# float64 against HF in float64 (whose RoPE frequencies are float32: ~1e-8 apart on unit vectors)
TOL = 1e-6


def write_sentence_transformers(path, mode: str) -> None:
    """modules.json and a Pooling config of pooling mode `mode` (the presets' files, the mode swapped)."""
    for name, content in SENTENCE_TRANSFORMERS.items():
        if name.startswith("1_Pooling"):
            content = {**content, "pooling_mode_lasttoken": False, f"pooling_mode_{mode}": True}
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(content))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(a Qwen3Model checkpoint as HF saves it, the same with sentence-transformers mean pooling, the HF model, token
    prompts)."""
    hf = build_hf_model(seed=7, architecture="qwen3").model
    last = save_hf_model(hf, tmp_path_factory.mktemp("embed") / "last")
    mean = shutil.copytree(last, last.parent / "mean")
    write_sentence_transformers(mean, "mean_tokens")
    rng = random.Random(7)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return last, mean, hf, prompts


def hidden(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).last_hidden_state[0]


def vectors(outputs) -> list[torch.Tensor]:
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outputs)
    return [torch.tensor(o.outputs.embedding, dtype=torch.float64) for o in outputs]


def assert_free(llm: LLM) -> None:
    """No request left, every KV block free (cached prefix blocks count as free)."""
    assert not llm.engine.requests and llm.engine.kv_cache.num_free_blocks == BLOCKS
    assert llm.engine.kv_cache_usage() == 0.0


@pytest.fixture(scope="module")
def last_llm(embedder):
    return LLM(str(embedder[0]), **F64, hf_overrides={"is_matryoshka": True})


def test_last_token_embeddings_equal_hf_batched_and_alone(embedder, last_llm):
    _, _, hf, prompts = embedder
    assert last_llm.engine.config.task == "embed"
    batched = vectors(last_llm.embed(prompts, use_tqdm=False))
    for prompt, got in zip(prompts, batched):
        torch.testing.assert_close(got, F.normalize(hidden(hf, prompt)[-1], dim=0), rtol=0, atol=TOL)
    for prompt, got in zip(prompts[:3], batched):
        torch.testing.assert_close(vectors(last_llm.embed(prompt, use_tqdm=False))[0], got, rtol=0, atol=1e-12)
    assert_free(last_llm)


def test_normalize_off_and_dimensions(embedder, last_llm):
    _, _, hf, prompts = embedder
    raw, cut = vectors(last_llm.embed(prompts[2:4], [PoolingParams(normalize=False), PoolingParams(dimensions=5)],
                                      use_tqdm=False))
    torch.testing.assert_close(raw, hidden(hf, prompts[2])[-1], rtol=0, atol=TOL)
    torch.testing.assert_close(cut, F.normalize(hidden(hf, prompts[3])[-1, :5], dim=0), rtol=0, atol=TOL)


def test_chunked_mixed_batch_and_prefix_cache_give_the_same_vectors(embedder, last_llm):
    """A step budget of 8 tokens: prompts chunked over steps beside others; one shares a cached prefix."""
    path, _, hf, prompts = embedder
    llm = LLM(str(path), **F64, max_num_batched_tokens=8)
    expected = vectors(last_llm.embed(prompts, use_tqdm=False))
    assert all(torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=1e-12)
               for a, b in zip(vectors(llm.embed(prompts, use_tqdm=False)), expected))
    sharing = prompts[-1][:24] + [3, 1, 4]
    got = vectors(llm.embed(sharing, use_tqdm=False))[0]
    assert llm.engine.stats().prefix_hits >= 24
    torch.testing.assert_close(got, F.normalize(hidden(hf, sharing)[-1], dim=0), rtol=0, atol=TOL)
    assert_free(llm)


def test_mean_pooling_accumulates_over_chunks(embedder):
    """Mean pooling over prompts chunked 8 tokens a step beside each other: each prompt's mean counts every token once;
    it never reads the prefix cache (a repeated prompt is computed again)."""
    _, path, hf, prompts = embedder
    llm = LLM(str(path), **F64, max_num_batched_tokens=8)
    assert llm.engine.config.pooler.pooling_type == "mean"
    got = vectors(llm.embed(prompts + prompts[-2:], use_tqdm=False))
    for prompt, vector in zip(prompts + prompts[-2:], got):
        torch.testing.assert_close(vector, F.normalize(hidden(hf, prompt).mean(dim=0), dim=0), rtol=0, atol=TOL)
    assert llm.engine.stats().prefix_hits == 0
    assert_free(llm)
    with pytest.raises(ValueError, match="dimensions: this model's embeddings cannot be cut short"):
        llm.embed(prompts[0], PoolingParams(dimensions=8), use_tqdm=False)
    assert not llm.engine.requests


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tiny_model_dir):
    """(a plain Qwen3ForCausalLM checkpoint with the real vocabulary and tokenizer, the HF model)."""
    model = build_hf_model(seed=11, vocab_size=151936, architecture="qwen3", tie_word_embeddings=True)
    path = save_hf_model(model, tmp_path_factory.mktemp("rerank") / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, path / name)
    return path, model


def test_rerank_scores_equal_sigmoid_of_hf_yes_minus_no(reranker):
    path, model = reranker
    llm = LLM(str(path), **F64, hf_overrides=RERANKER)
    assert llm.engine.config.task == "score"
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    query, documents = "<Query>: where do rivers end?\n", ["<Document>: at the sea", "<Document>: in a cupboard",
                                                           "<Document>: rivers flow downhill into lakes and seas"]
    outputs = llm.score(query, documents, use_tqdm=False)
    for document, output in zip(documents, outputs):
        ids = tokenizer.encode(query, add_special_tokens=False) + tokenizer.encode(document, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        assert isinstance(output, ScoringRequestOutput) and output.prompt_token_ids == ids
        assert output.outputs.score == pytest.approx(torch.sigmoid(logits[yes] - logits[no]).item(), abs=TOL)
    paired = llm.score([query, query], documents[:2], use_tqdm=False)  # N:N
    assert [o.outputs.score for o in paired] == pytest.approx([o.outputs.score for o in outputs[:2]], abs=1e-12)
    with pytest.raises(ValueError, match="text_1 has 2 items and text_2 3"):
        llm.score([query, query], documents, use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions is for embeddings"):
        llm.score(query, documents, PoolingParams(dimensions=4), use_tqdm=False)
    assert_free(llm)


def test_embedding_model_scores_by_cosine_similarity(embedder, last_llm):
    _, _, _, prompts = embedder
    a, b, c = vectors(last_llm.embed(prompts[1:4], use_tqdm=False))
    scores = [o.outputs.score for o in last_llm.score(prompts[1], prompts[2:4], use_tqdm=False)]
    assert scores == pytest.approx([float(a @ b), float(a @ c)], abs=1e-12)


@pytest.mark.parametrize("budget", [8, 3])
def test_scheduler_admits_a_prompt_that_fills_the_cache_and_retires_it_with_its_value(budget):
    """No block is kept back for a first decode that a pooling request never makes; it finishes in the step that
    computes its last token (chunks before it give no value), its blocks returned."""
    kv = KVCacheManager(4, 2, 4, 64)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget)
    request = Request("p", None, list(range(1, 9)), PoolingParams(normalize=True), 0, frozenset(), None)
    scheduler.add(request)
    computed = 0
    while computed + budget < 8:
        plan = scheduler.schedule()
        assert plan.num_new_tokens == [budget]
        assert scheduler.update(plan, None).finished == []
        computed += budget
    plan = scheduler.schedule()
    assert plan.request_ids == ["p"] and plan.num_new_tokens == [8 - computed]
    update = scheduler.update(plan, PoolerOutput([[0.6, 0.8]]))
    assert update.pooled == [(request, [0.6, 0.8])] and update.finished == [request] and not update.sampled
    assert request.status is RequestStatus.FINISHED_STOPPED and kv.num_free_blocks == 4
    assert not scheduler.has_unfinished()


# ---- task detection and refusals ----

@pytest.fixture(scope="module")
def presets(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("presets")
    return {name: make_model(f"qwen3-{name}-tiny", root / name, dtype="float32", tokenizer_from=tiny_model_dir)
            for name in ("embedding", "reranker")}


def test_presets_are_detected_as_vllm_detects_pooling_models(presets, embedder, tiny_model_dir):
    embedding = EngineConfig(str(presets["embedding"]))
    assert (embedding.task, embedding.pooler.pooling_type, embedding.pooler.normalize) == ("embed", "last", True)
    assert embedding.model_config.is_matryoshka
    reranker = EngineConfig(str(presets["reranker"]))
    tokenizer = load_tokenizer(presets["reranker"])
    assert reranker.task == "score"
    assert reranker.pooler.classifier_token_ids == tuple(tokenizer.convert_tokens_to_ids(["no", "yes"]))
    assert EngineConfig(str(tiny_model_dir)).task == "generate" and EngineConfig(str(tiny_model_dir)).pooler is None
    assert EngineConfig(str(tiny_model_dir), task="embed").task == "embed"  # a causal LM pooled, as vLLM allows
    assert EngineConfig(str(embedder[1])).pooler.pooling_type == "mean"


@pytest.mark.parametrize("which, kwargs, message", [
    ("embedding", dict(task="generate"), "task generate needs a causal LM"),
    ("embedding", dict(task="score"), "task score needs a Qwen3-Reranker"),
    ("reranker", dict(task="embed"), "serves task score, not embed"),
    ("reranker", dict(hf_overrides={"is_original_qwen3_reranker": False}), "the Qwen3-Reranker form only"),
    ("reranker", dict(hf_overrides={"classifier_from_token": ["no", "definitely"]}), "'definitely' is not one token"),
    ("embedding", dict(task="sing"), "task must be one of auto, generate, embed, score"),
    ("embedding", dict(pipeline_parallel_size=2), "runs in one pipeline stage"),
    ("embedding", dict(hf_overrides=["not", "a", "dict"]), "hf_overrides must be a JSON object"),
])
def test_tasks_a_checkpoint_cannot_serve_are_refused(presets, which, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(str(presets[which]), **kwargs)


@pytest.mark.parametrize("mode, message", [("cls_token", r"pooling modes \['pooling_mode_cls_token'\]"),
                                           ("dense", "module 'Dense' is not supported")])
def test_sentence_transformers_modules_it_does_not_apply_are_refused(presets, tmp_path, mode, message):
    path = shutil.copytree(presets["embedding"], tmp_path / "model")
    if mode == "dense":
        modules = json.loads((path / "modules.json").read_text())
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
        (path / "modules.json").write_text(json.dumps(modules))
    else:
        write_sentence_transformers(path, mode)
    with pytest.raises(ValueError, match=message):
        EngineConfig(str(path))


def test_requests_for_another_task_or_beyond_the_model_are_refused_naming_the_field(presets, tiny_model_dir):
    generate = InputProcessor(EngineConfig(str(tiny_model_dir)), None, 16)
    embed = InputProcessor(EngineConfig(str(presets["embedding"])), None, 256)
    listed = InputProcessor(EngineConfig(str(presets["embedding"]), hf_overrides={"matryoshka_dimensions": [8, 16]}),
                            None, 256)
    for processor, params, field, message in (
            (generate, PoolingParams(), "params", "runs task generate: PoolingParams"),
            (embed, SamplingParams(), "params", "runs task embed: it computes embeddings"),
            (embed, PoolingParams(dimensions=65), "dimensions", "dimensions must be <= 64"),
            (listed, PoolingParams(dimensions=9), "dimensions", r"dimensions must be one of \[8, 16\]"),
            (embed, PoolingParams(), "prompt", "prompt has 4097 tokens, more than max_model_len")):
        with pytest.raises(ValueError, match=message) as info:
            processor.process([1] * (4097 if field == "prompt" else 2), params)
        assert info.value.field == field
    assert embed.process([1] * 4096, None).params == PoolingParams(normalize=True)  # the model's default filled in
    assert listed.process([1], PoolingParams(dimensions=16)).params.dimensions == 16
    with pytest.raises(ValueError, match="dimensions must be an integer >= 1"):
        PoolingParams(dimensions=0)


# ---- the server ----

MODEL = "pooling-test"


@pytest.fixture(scope="module")
def servers(presets):
    """An embedding model's and a reranker's server (the presets, float32; torch's matmuls: nothing to build or
    time)."""
    engines, running = {}, {}
    for name, path in presets.items():
        engines[name] = AsyncLLMEngine(LLMEngine.from_args(str(path), dtype="float32", num_kv_blocks=BLOCKS,
                                                             cpu_kernels="off"))
        running[name] = ServerThread(build_app(engines[name], MODEL)).__enter__()
    yield running
    for name in presets:
        running[name].__exit__(None, None, None)
        engines[name].shutdown()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_openai_client_embeddings(servers):
    server = servers["embedding"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["The capital of France", "a second, longer input that has more tokens in it"]
    packed = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and unpacks it
    floats = post(server, "/v1/embeddings", {"input": texts, "encoding_format": "float"}).json()
    assert [d.index for d in packed.data] == [0, 1] and floats["object"] == "list" and floats["model"] == MODEL
    for a, b in zip(packed.data, floats["data"]):
        assert b["object"] == "embedding" and len(b["embedding"]) == 64
        assert a.embedding == pytest.approx(b["embedding"], abs=1e-6)
        assert sum(x * x for x in b["embedding"]) == pytest.approx(1.0, abs=1e-5)
    assert packed.usage.prompt_tokens == packed.usage.total_tokens == floats["usage"]["prompt_tokens"] > 5
    raw = post(server, "/v1/embeddings", {"input": texts[0], "encoding_format": "base64"}).json()["data"][0]
    assert list(struct.unpack("<64f", base64.b64decode(raw["embedding"]))) == pytest.approx(
        floats["data"][0]["embedding"], abs=1e-6)
    ids = client.embeddings.create(model=MODEL, input=[[1, 2, 3], [4, 5]], dimensions=8, encoding_format="float")
    assert [len(d.embedding) for d in ids.data] == [8, 8] and ids.usage.prompt_tokens == 5
    one = client.embeddings.create(model=MODEL, input=[4, 5], encoding_format="float")
    assert one.data[0].embedding[:8] != pytest.approx(ids.data[1].embedding)  # cut, then renormalised
    torch.testing.assert_close(F.normalize(torch.tensor(one.data[0].embedding[:8]), dim=0),
                               torch.tensor(ids.data[1].embedding), rtol=0, atol=1e-6)


def test_score_and_rerank(servers):
    server = servers["reranker"]
    docs = ["alpha beta", "gamma", "delta epsilon zeta"]
    scored = post(server, "/v1/score", {"text_1": "which one?", "text_2": docs})
    assert scored.status_code == 200, scored.text
    body = scored.json()
    scores = [d["score"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and all(0 < s < 1 for s in scores)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    ranked = post(server, "/v1/rerank", {"query": "which one?", "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert [r["document"] for r in ranked["results"]] == [{"text": docs[i]} for i in order]
    bare = post(server, "/v2/rerank", {"query": "which one?", "documents": docs, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    cosine = post(servers["embedding"], "/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "c"]}).json()
    assert cosine["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("which, path, body, param", [
    ("embedding", "/v1/embeddings", {"input": []}, "input"),
    ("embedding", "/v1/embeddings", {"input": ""}, "input"),
    ("embedding", "/v1/embeddings", {"input": [[1, 2], [1, 10**9]]}, "input"),
    ("embedding", "/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("embedding", "/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
    ("embedding", "/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("embedding", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("embedding", "/v1/completions", {"prompt": "hi"}, "model"),
    ("reranker", "/v1/embeddings", {"input": "x"}, "model"),
    ("reranker", "/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("reranker", "/v1/rerank", {"query": "", "documents": ["d"]}, "query"),
    ("reranker", "/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("reranker", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
])
def test_bad_requests_get_a_400_naming_the_field_and_the_server_serves_on(servers, which, path, body, param):
    server = servers[which]
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    ok = post(server, "/v1/embeddings" if which == "embedding" else "/v1/rerank",
              {"input": "fine"} if which == "embedding" else {"query": "q", "documents": ["fine"]})
    assert ok.status_code == 200


def test_a_generating_model_refuses_the_pooling_endpoints(tiny_model_dir):
    engine, server = start(tiny_model_dir)
    with server:
        for path, body in (("/v1/embeddings", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
            response = httpx.post(server.url + path, json=body, timeout=60)
            assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text
            assert "runs task generate" in response.json()["error"]["message"]
    engine.shutdown()
