"""Pooling models end to end: real `tern launch` servers on tiny random checkpoints, Hugging Face
as the oracle (float32, the last token's final hidden state: LAST pooling).

- embed (the tiny Llama, --task embed): the official openai client's embeddings.create, float and
  base64, with `dimensions`, equals HF's AutoModel hidden state (truncated, L2-normalised);
- reward (a LlamaForSequenceClassification with one label, --task reward): /pooling on chat
  messages equals HF's score head on the template-rendered conversation; the generating routes are
  a 400 naming the task;
- classify (three labels): /classify's probabilities are the softmax of HF's logits, with labels;
- cross-encoder (one label, --task classify): /score is the sigmoid of HF's logit on the pair;
- every bad input is a 400.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoModel, AutoTokenizer, LlamaForSequenceClassification

from tests.conftest import make_tiny_model
from tests.integration.conftest import TernServer

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-4
MAX_MODEL_LEN = 64
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["hello world", "the cat sat on the mat", "a"]
CHAT = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
]


def make_classifier(out: Path, tokenizer_dir: Path, num_labels: int, seed: int) -> Path:
    """A tiny LlamaForSequenceClassification (tests/conftest.py's builder) with the default
    model's tokenizer; three labels get names."""
    make_tiny_model("llama", out, tokenizer_dir, seed, "score", num_labels)
    if num_labels == len(LABELS):
        config = json.loads((out / "config.json").read_text())
        config["id2label"] = {str(k): v for k, v in LABELS.items()}
        config["label2id"] = {v: k for k, v in LABELS.items()}
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def checkpoints(
    tiny_llama_with_tokenizer: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling_models")
    return {
        "embed": tiny_llama_with_tokenizer,
        "single": make_classifier(root / "single", tokenizer_dir, 1, seed=1),
        "three": make_classifier(root / "three", tokenizer_dir, 3, seed=2),
    }


@pytest.fixture(scope="module")
def servers(checkpoints: dict[str, Path]) -> Iterator[dict[str, TernServer]]:
    """One server per task, started together (their start-ups overlap)."""
    common = [
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "0.02",
    ]
    args = {
        "embed": ["--model", str(checkpoints["embed"]), "--task", "embed"],
        "reward": ["--model", str(checkpoints["single"]), "--task", "reward"],
        "cross": ["--model", str(checkpoints["single"]), "--task", "classify"],
        "classify": ["--model", str(checkpoints["three"])],  # auto: classify
    }
    started = {
        name: TernServer([*a, *common, "--served-model-name", name]) for name, a in args.items()
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:  # their shutdowns overlap too
            list(pool.map(TernServer.stop, started.values()))
        leftovers = [p for server in started.values() for p in server.survivors()]
        for server in started.values():
            server.log_path.unlink(missing_ok=True)
        assert not leftovers, f"processes survived their server: {leftovers}"


@pytest.fixture(scope="module")
def tokenizer(checkpoints: dict[str, Path]) -> Any:
    return AutoTokenizer.from_pretrained(checkpoints["embed"])


def post(server: TernServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def ok(server: TernServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


# --------------------------------------------------------------------------- Hugging Face


def hf_last_hidden(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1].float()


def hf_logits(model: LlamaForSequenceClassification, ids: list[int]) -> list[float]:
    """The score head on the last token's hidden state (HF's classifier, without its padding
    search: these inputs have no padding, and may contain the pad id)."""
    with torch.no_grad():
        return model.score(hf_last_hidden(model.model, ids)).tolist()


def load_classifier(path: Path) -> LlamaForSequenceClassification:
    return LlamaForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


def unit(v: torch.Tensor | np.ndarray) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    return a / np.linalg.norm(a)


# --------------------------------------------------------------------------- embeddings


def test_embeddings_with_the_openai_client(
    servers: dict[str, TernServer], checkpoints: dict[str, Path], tokenizer: Any
) -> None:
    server = servers["embed"]
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    hf = AutoModel.from_pretrained(checkpoints["embed"], dtype=torch.float32).eval()
    hidden = [hf_last_hidden(hf, tokenizer.encode(t)) for t in TEXTS]

    # Without encoding_format the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model="embed", input=TEXTS)
    as_float = client.embeddings.create(
        model="embed", input=TEXTS, encoding_format="float", dimensions=16
    )
    as_b64 = client.embeddings.create(
        model="embed", input=TEXTS, encoding_format="base64", dimensions=16
    )
    n = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == n
    for i, h in enumerate(hidden):
        assert default.data[i].index == i and default.data[i].object == "embedding"
        assert len(default.data[i].embedding) == h.numel()
        assert np.allclose(default.data[i].embedding, unit(h), atol=ATOL)
        assert np.linalg.norm(default.data[i].embedding) == pytest.approx(1.0, abs=1e-5)
        assert np.allclose(as_float.data[i].embedding, unit(h[:16]), atol=ATOL)
        raw = base64.b64decode(as_b64.data[i].embedding)  # type: ignore[arg-type]
        assert np.allclose(np.frombuffer(raw, dtype="<f4"), unit(h[:16]), atol=ATOL)

    # Token ids in, raw (unnormalised) vectors out; truncation keeps the last tokens.
    ids = tokenizer.encode(TEXTS[1])
    body = ok(server, "/v1/embeddings", {"input": [ids, ids[2:]], "normalize": False})
    assert np.allclose(body["data"][0]["embedding"], hidden[1].numpy(), atol=ATOL)
    long = (ids * MAX_MODEL_LEN)[: MAX_MODEL_LEN + 10]
    body = ok(server, "/v1/embeddings", {"input": [long], "truncate_prompt_tokens": 5})
    assert np.allclose(body["data"][0]["embedding"], unit(hf_last_hidden(hf, long[-5:])), atol=ATOL)
    assert body["usage"]["prompt_tokens"] == 5


BAD_EMBEDDINGS = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [5, 49152]}, "input"),  # outside the vocabulary
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input"),  # longer than --max-model-len
    ({"input": "x", "max_tokens": 5}, "max_tokens"),
    ({"input": "x", "temperature": 0.5}, "temperature"),
    ({"input": "x", "dimensions": 65}, "dimensions"),  # the embedding has 64
    ({"input": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
]


def test_bad_inputs_are_400(servers: dict[str, TernServer]) -> None:
    for body, param in BAD_EMBEDDINGS:
        r = post(servers["embed"], "/v1/embeddings", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    for path, body in [
        ("/pooling", {"input": "x", "max_tokens": 3}),
        ("/pooling", {"input": [[1], [2, 49999]]}),
        ("/pooling", {"input": "x", "dimensions": 4}),  # a reward model has no dimensions
        ("/pooling", {"messages": []}),
    ]:
        r = post(servers["reward"], path, body)
        assert r.status_code == 400, (path, body, r.text)
    r = post(servers["cross"], "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert r.status_code == 400, r.text


# --------------------------------------------------------------------------- reward, classify, score


def test_reward_on_a_conversation(
    servers: dict[str, TernServer], checkpoints: dict[str, Path], tokenizer: Any
) -> None:
    hf = load_classifier(checkpoints["single"])
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    body = ok(servers["reward"], "/pooling", {"model": "reward", "messages": CHAT})
    assert body["object"] == "list" and body["id"].startswith("pool-")
    item = body["data"][0]
    assert item["object"] == "pooling" and item["index"] == 0
    assert np.allclose(item["data"], hf_logits(hf, ids), atol=ATOL)
    assert body["usage"]["prompt_tokens"] == len(ids)

    # A batch of texts, as LMDeploy's /pooling takes it.
    body = ok(servers["reward"], "/pooling", {"input": TEXTS})
    for i, text in enumerate(TEXTS):
        assert np.allclose(
            body["data"][i]["data"], hf_logits(hf, tokenizer.encode(text)), atol=ATOL
        )


def test_generating_routes_on_a_reward_model_name_the_task(servers: dict[str, TernServer]) -> None:
    server = servers["reward"]
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(Exception) as e:
        client.chat.completions.create(model="reward", messages=[{"role": "user", "content": "hi"}])
    assert getattr(e.value, "status_code", None) == 400
    assert "'reward'" in str(e.value)
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/generate", {"prompt": "hi"}),
        ("/v1/embeddings", {"input": "hi"}),
        ("/classify", {"input": "hi"}),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400 and "'reward'" in r.json()["error"]["message"], (path, r.text)


def test_classify_probabilities_and_labels(
    servers: dict[str, TernServer], checkpoints: dict[str, Path], tokenizer: Any
) -> None:
    hf = load_classifier(checkpoints["three"])
    body = ok(servers["classify"], "/classify", {"input": TEXTS})
    for i, text in enumerate(TEXTS):
        logits = torch.tensor(hf_logits(hf, tokenizer.encode(text)))
        item = body["data"][i]
        assert item["num_classes"] == 3
        assert np.allclose(item["probs"], logits.softmax(-1).numpy(), atol=ATOL)
        assert item["label"] == LABELS[int(logits.argmax())]
    raw = ok(servers["classify"], "/pooling", {"input": TEXTS[0], "use_activation": False})
    assert np.allclose(raw["data"][0]["data"], hf_logits(hf, tokenizer.encode(TEXTS[0])), atol=ATOL)


def test_score_cross_encoder(
    servers: dict[str, TernServer], checkpoints: dict[str, Path], tokenizer: Any
) -> None:
    hf = load_classifier(checkpoints["single"])
    query, docs = "where is the cat?", ["the cat sat on the mat", "dogs bark"]
    body = ok(servers["cross"], "/score", {"text_1": query, "text_2": docs})
    assert [d["index"] for d in body["data"]] == [0, 1]
    for i, doc in enumerate(docs):
        ids = tokenizer(query, text_pair=doc)["input_ids"]
        want = torch.sigmoid(torch.tensor(hf_logits(hf, ids)[0])).item()
        assert body["data"][i]["object"] == "score"
        assert body["data"][i]["score"] == pytest.approx(want, abs=ATOL)
    # /classify on a one-label head: the sigmoid too (the softmax of one logit is always 1).
    one = ok(
        servers["cross"], "/classify", {"input": [tokenizer(query, text_pair=docs[0])["input_ids"]]}
    )
    assert one["data"][0]["probs"][0] == pytest.approx(body["data"][0]["score"], abs=1e-6)


def test_encode_and_concurrency(servers: dict[str, TernServer], tokenizer: Any) -> None:
    body = ok(servers["reward"], "/v1/encode", {"input": TEXTS})
    assert body == {
        "input_ids": [tokenizer.encode(t) for t in TEXTS],
        "length": [len(tokenizer.encode(t)) for t in TEXTS],
    }
    # Many pooling requests at once: each answer is its own input's.
    inputs = [[7 + i, 100 + i, 9] for i in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda ids: ok(servers["embed"], "/v1/embeddings", {"input": ids}), inputs)
        )
    single = {tuple(ids): r["data"][0]["embedding"] for ids, r in zip(inputs, results)}
    batch = ok(servers["embed"], "/v1/embeddings", {"input": inputs})
    for ids, item in zip(inputs, batch["data"]):
        assert np.allclose(item["embedding"], single[tuple(ids)], atol=ATOL)
