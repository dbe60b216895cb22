"""The pooling routes without an engine: request decoding and validation, the vector arithmetic
(normalisation, dimensions, base64, softmax, sigmoid), and each route end to end through the real
app (build_app) on a fake engine whose pooling requests finish at once with a vector computed from
their token ids, so that the tests know what each answer must be."""

from __future__ import annotations

import base64
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from enginecore.config import Config, ModelConfig
from enginecore.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineReady,
    FinishReason,
)
from frontend.cli.server import FrontendConfig
from frontend.common.errors import APIError
from frontend.engine.client import RequestStream
from frontend.pooling.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    EncodeRequest,
    PoolingRequest,
    ScoreRequest,
    base64_float32,
    class_probabilities,
    cosine_similarity,
    decode_pooling_request,
    embedding_vector,
    normalize_input,
    score_pairs,
    sigmoid,
    softmax,
)
from frontend.server.app import build_app
from frontend.serving.base import OpenAIServing

# --------------------------------------------------------------------------- decoding


def decode(body: str, typ: type = EmbeddingRequest) -> Any:
    return decode_pooling_request(body.encode(), typ, "/v1/embeddings")


def param_of(body: str, typ: type = EmbeddingRequest) -> str | None:
    with pytest.raises(APIError) as e:
        decode(body, typ)
    assert e.value.status == 400
    return e.value.param


def test_input_shapes() -> None:
    assert normalize_input("hi") == ["hi"]
    assert normalize_input(["a", "b"]) == ["a", "b"]
    assert normalize_input([1, 2, 3]) == [[1, 2, 3]]
    assert normalize_input([[1], [2, 3]]) == [[1], [2, 3]]
    req = decode('{"input": [[5, 6], [7]], "model": "m", "user": "u"}')
    assert req.inputs == [[5, 6], [7]] and req.wants_normalized


@pytest.mark.parametrize(
    "value",
    ["", [], [""], ["a", ""], [[]], [[1], []], [1, "a"], [[1], "a"], [True, 2], [[1.5]], [{}]],
)
def test_bad_inputs(value: Any) -> None:
    with pytest.raises(APIError) as e:
        normalize_input(value)
    assert e.value.status == 400 and e.value.param == "input"


def test_generation_parameters_are_rejected_by_name() -> None:
    for name, value in [("max_tokens", 5), ("temperature", 0.5), ("stream", True), ("n", 2)]:
        with pytest.raises(APIError) as e:
            decode(f'{{"input": "x", "{name}": {str(value).lower()}}}')
        assert e.value.param == name and "generation parameter" in e.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{}", "input"),
        ('{"input": "x", "messages": [{"role": "user", "content": "x"}]}', "input"),
        ('{"messages": []}', "messages"),
        ('{"input": "x", "add_generation_prompt": true}', "add_generation_prompt"),
        ('{"input": "x", "truncate_prompt_tokens": 0}', "truncate_prompt_tokens"),
        ('{"input": "x", "dimensions": 0}', "dimensions"),
        ('{"input": "x", "normalize": true, "use_activation": false}', "use_activation"),
        ('{"input": "x", "encoding_format": "int8"}', "encoding_format"),
        ('{"input": "x", "priority": 3}', "priority"),
        ('{"input": "x", "bogus": 1}', "bogus"),
    ],
)
def test_bad_requests(body: str, param: str) -> None:
    assert param_of(body) == param


def test_other_requests() -> None:
    assert decode('{"input": "x", "normalize": false}').wants_normalized is False
    assert decode('{"input": "x", "use_activation": false}').wants_normalized is False
    assert decode('{"input": "x", "task": "reward"}', PoolingRequest).task == "reward"
    assert decode('{"input": ["a"], "use_activation": false}', ClassificationRequest).inputs == [
        "a"
    ]
    score = decode('{"text_1": "q", "text_2": ["a", "b"]}', ScoreRequest)
    assert score.pairs() == [("q", "a"), ("q", "b")]
    assert decode('{"input": "x"}', EncodeRequest).add_bos is True
    assert param_of('{"input": []}', EncodeRequest) == "input"


def test_score_pairs() -> None:
    assert score_pairs("q", "a") == [("q", "a")]
    assert score_pairs(["q1", "q2"], ["a1", "a2"]) == [("q1", "a1"), ("q2", "a2")]
    assert score_pairs(["q"], ["a1", "a2"]) == [("q", "a1"), ("q", "a2")]
    for t1, t2 in [(["q1", "q2"], "a"), (["q1", "q2"], ["a"] * 3), ([], "a"), ("q", [""])]:
        with pytest.raises(APIError):
            score_pairs(t1, t2)


# --------------------------------------------------------------------------- arithmetic


def test_embedding_vector() -> None:
    v = embedding_vector([3.0, 4.0, 12.0])
    assert np.allclose(v, [3 / 13, 4 / 13, 12 / 13])
    v = embedding_vector([3.0, 4.0, 12.0], dimensions=2)  # truncated, then re-normalised
    assert np.allclose(v, [0.6, 0.8])
    assert np.allclose(embedding_vector([3.0, 4.0, 12.0], 2, normalize=False), [3.0, 4.0])
    assert np.allclose(embedding_vector([0.0, 0.0]), [0.0, 0.0])  # no division by zero


def test_base64_is_little_endian_float32() -> None:
    values = [0.5, -1.25, 3.0e-8, 1234.5]
    raw = base64.b64decode(base64_float32(values))
    assert len(raw) == 4 * len(values)
    assert struct.unpack("<4f", raw) == pytest.approx(values, rel=1e-7)
    # How the openai client reads it (numpy, native order: little-endian on this machine).
    assert np.frombuffer(raw, dtype="<f4").tolist() == pytest.approx(values, rel=1e-7)


def test_activations() -> None:
    p = softmax([1.0, 2.0, 3.0])
    assert sum(p) == pytest.approx(1.0) and p[2] > p[1] > p[0]
    assert softmax([1000.0, 0.0]) == pytest.approx([1.0, 0.0])  # no overflow
    assert class_probabilities([0.0]) == [0.5]  # one label: sigmoid, as vLLM
    assert class_probabilities([0.0, 0.0]) == [0.5, 0.5]
    assert sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0
    assert sigmoid(1.0) == pytest.approx(1 / (1 + math.exp(-1)))
    assert cosine_similarity([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine_similarity([1.0, 0.0], [0.0, 5.0]) == pytest.approx(0.0)


# --------------------------------------------------------------------------- routes (fake engine)

MAX_LEN = 64
LABELS = {0: "neg", 1: "pos"}


def fake_vector(task: str, ids: list[int]) -> list[float]:
    """What the fake engine pools: a function of the token ids the tests can recompute."""
    if task == "embed":
        return [float(len(ids)), float(sum(ids) % 97), 1.0, -2.0]
    if task == "classify":
        return [0.1 * len(ids), -0.05 * len(ids)]
    return [0.25 * len(ids) - 1.0]  # reward, or a single-label classifier


class FakeEngine:
    """The EngineClient surface the pooling routes use; every request finishes at once."""

    def __init__(self, task: str, num_labels: int = 2) -> None:
        size = {"embed": 4, "classify": num_labels, "reward": 1, "generate": 0}[task]
        self.ready = EngineReady(
            num_kv_blocks=8, block_size=16, max_model_len=MAX_LEN, vocab_size=49152,
            model_summary="Fake: 1 layer", task=task, pooling_type="LAST", pooled_size=size,
            id2label=LABELS if task == "classify" else {},
        )  # fmt: skip
        self.task = task if num_labels == 2 else "single_label"
        self.requests: list[EngineCoreRequest] = []
        self.is_dead = False
        self.dead_reason = None
        self.num_in_flight = 0
        self.pid = None

    def is_in_flight(self, request_id: str) -> bool:
        return False

    def add_request(self, request: EngineCoreRequest) -> RequestStream:
        assert request.pooling
        self.requests.append(request)
        stream = RequestStream(request.request_id)
        pooled = fake_vector(self.task, request.prompt_token_ids)
        out = EngineCoreOutput(request.request_id, [], FinishReason.STOP, pooled=pooled)
        stream.queue.put_nowait(out)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path | None) -> Any:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    from frontend.text.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir)


def client(tokenizer: Any, task: str, num_labels: int = 2) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine(task, num_labels)
    serving = OpenAIServing(engine, tokenizer, ["m"], MAX_LEN, 49152)  # type: ignore[arg-type]
    config = Config(model=ModelConfig(path="/m", served_model_name="m"))
    app = build_app(config, FrontendConfig(("m",)), engine, serving)  # type: ignore[arg-type]
    return TestClient(app), engine


def expected_embedding(ids: list[int], dimensions: int | None = None) -> np.ndarray:
    return embedding_vector(fake_vector("embed", ids), dimensions)


def test_embeddings_route(tokenizer: Any) -> None:
    c, engine = client(tokenizer, "embed")
    r = c.post("/v1/embeddings", json={"input": ["hello world", "a b c"], "model": "m"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m" and len(body["data"]) == 2
    ids = [tokenizer.encode("hello world"), tokenizer.encode("a b c")]
    assert [q.prompt_token_ids for q in engine.requests] == ids
    for i, item in enumerate(body["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        assert np.allclose(item["embedding"], expected_embedding(ids[i]), atol=1e-12)
    n = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}

    r = c.post(
        "/v1/embeddings", json={"input": [5, 6, 7], "encoding_format": "base64", "dimensions": 2}
    )
    assert r.status_code == 200, r.text
    got = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(got, expected_embedding([5, 6, 7], 2), atol=1e-6)

    r = c.post("/v1/embeddings", json={"input": [5, 6, 7], "normalize": False})
    assert r.json()["data"][0]["embedding"] == fake_vector("embed", [5, 6, 7])

    long = list(range(1, MAX_LEN + 5))
    r = c.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and engine.requests[-1].prompt_token_ids == long[-3:]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [1, 49152]}, "input"),  # out of the vocabulary
        ({"input": list(range(MAX_LEN + 1))}, "input"),  # too long
        ({"input": "x", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens"),
        ({"input": "x", "dimensions": 5}, "dimensions"),  # larger than the embedding
        ({"input": "x", "max_tokens": 4}, "max_tokens"),
        ({"input": ["x", ""]}, "input"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_embeddings_bad_input(tokenizer: Any, body: dict[str, Any], param: str) -> None:
    c, engine = client(tokenizer, "embed")
    r = c.post("/v1/embeddings", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param
    assert not engine.requests


def test_pooling_route(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    c, engine = client(tokenizer, "reward")
    r = c.post("/pooling", json={"messages": messages})
    assert r.status_code == 200, r.text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert engine.requests[0].prompt_token_ids == ids
    item = r.json()["data"][0]
    assert item["object"] == "pooling" and item["data"] == fake_vector("reward", ids)
    r = c.post("/pooling", json={"input": [[1, 2], [3]], "encoding_format": "base64"})
    got = [np.frombuffer(base64.b64decode(d["data"]), "<f4") for d in r.json()["data"]]
    assert np.allclose(got[1], fake_vector("reward", [3]))
    for body in ({"input": "x", "normalize": True}, {"input": "x", "task": "embed"}):
        assert c.post("/pooling", json=body).status_code == 400

    c, _ = client(tokenizer, "classify")
    r = c.post("/pooling", json={"input": [1, 2, 3]})
    assert r.json()["data"][0]["data"] == pytest.approx(softmax(fake_vector("classify", [1, 2, 3])))
    r = c.post("/pooling", json={"input": [1, 2, 3], "use_activation": False})
    assert r.json()["data"][0]["data"] == fake_vector("classify", [1, 2, 3])

    c, _ = client(tokenizer, "embed")
    r = c.post("/pooling", json={"input": [1, 2, 3], "dimensions": 3})
    assert np.allclose(r.json()["data"][0]["data"], expected_embedding([1, 2, 3], 3))


def test_classify_and_score_routes(tokenizer: Any) -> None:
    c, _ = client(tokenizer, "classify")
    r = c.post("/classify", json={"input": [[1, 2, 3], [4]]})
    assert r.status_code == 200, r.text
    first = r.json()["data"][0]
    assert first["probs"] == pytest.approx(softmax(fake_vector("classify", [1, 2, 3])))
    assert first["label"] == "neg" and first["num_classes"] == 2  # logits (0.3, -0.15)
    assert r.json()["usage"]["prompt_tokens"] == 4
    r = c.post("/score", json={"text_1": "q", "text_2": "a"})
    assert r.status_code == 400 and "num_labels 1" in r.json()["error"]["message"]

    c, engine = client(tokenizer, "classify", num_labels=1)
    r = c.post("/score", json={"text_1": "what?", "text_2": ["this", "that one"]})
    assert r.status_code == 200, r.text
    for i, text in enumerate(["this", "that one"]):
        ids = tokenizer.hf("what?", text_pair=text)["input_ids"]
        assert engine.requests[i].prompt_token_ids == ids
        score = r.json()["data"][i]["score"]
        assert score == pytest.approx(sigmoid(fake_vector("single", ids)[0]))

    c, engine = client(tokenizer, "embed")
    r = c.post("/score", json={"text_1": ["a b", "c"], "text_2": ["c", "d e f"]})
    assert r.status_code == 200, r.text
    assert len(engine.requests) == 3  # each distinct text embedded once
    a, c_, d = (tokenizer.encode(t) for t in ("a b", "c", "d e f"))
    vec = {tuple(x): fake_vector("embed", x) for x in (a, c_, d)}
    want = [
        cosine_similarity(vec[tuple(a)], vec[tuple(c_)]),
        cosine_similarity(vec[tuple(c_)], vec[tuple(d)]),
    ]
    assert [x["score"] for x in r.json()["data"]] == pytest.approx(want)


def test_wrong_task_is_a_400_naming_it(tokenizer: Any) -> None:
    c, _ = client(tokenizer, "reward")
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/generate", {"prompt": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
        ("/classify", {"input": "hi"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
    ]:
        r = c.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert "'reward'" in error["message"] and error["code"] == "wrong_task", error
    c, _ = client(tokenizer, "generate")
    for path in ("/v1/embeddings", "/pooling", "/classify"):
        r = c.post(path, json={"input": "hi"})
        assert r.status_code == 400 and "'generate'" in r.json()["error"]["message"]


def test_encode_route(tokenizer: Any) -> None:
    c, _ = client(tokenizer, "generate")  # tokenization works whatever the task
    r = c.post("/v1/encode", json={"input": "hello world"})
    assert r.json() == {"input_ids": tokenizer.encode("hello world"), "length": 2}
    r = c.post("/v1/encode", json={"input": ["hi", "a b"], "do_preprocess": True, "add_bos": False})
    rendered = [
        tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": t}]), False)
        for t in ("hi", "a b")
    ]
    bos = tokenizer.hf.bos_token_id
    assert rendered[0][0] == bos  # SmolLM2's BOS is <|im_start|>, which the template opens with
    assert r.json() == {
        "input_ids": [x[1:] for x in rendered],
        "length": [len(x) - 1 for x in rendered],
    }
