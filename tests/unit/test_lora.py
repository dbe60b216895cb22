"""LoRA adapters in the engine, in process: PEFT adapters written by the `peft` package on a tiny
random Llama, requests on the base model and on three adapters mixed in one batch, against
Hugging Face PEFT (greedy tokens, and each token's logprob within 1e-3); with chunked prefill and
prefix caching, on float32, int8 and int4 base weights; adapter versions living side by side, unload
while requests run, LRU eviction and reload, and what tern refuses.
(--tp 2 / --pp 2: tests/integration/test_parallel.py; over HTTP: tests/integration/test_lora_server.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from enginecore.config import CacheConfig, Config, LoraConfig, ModelConfig, SchedulerConfig
from enginecore.core import EngineCore
from enginecore.executor import InProcExecutor
from enginecore.lora import LoraError, adapter_spec
from enginecore.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LoadLora,
    SamplingParams,
)
from scripts.make_tiny_model import make_lora_adapter
from tests.conftest import IN_PROCESS_KV_CACHE_GIB
from tests.unit.test_engine_inproc import make_prompts, vocab_of

MAX_TOKENS = 8
# Three adapters unlike each other: ranks 4, 8 (rsLoRA) and 16, and one that adapts only q, v and
# down (the other projections keep slot rows of zeros).
ADAPTERS = {
    "a4": {"rank": 4, "seed": 1},
    "a8": {"rank": 8, "seed": 2, "use_rslora": True},
    "a16": {"rank": 16, "seed": 3, "targets": ("q_proj", "v_proj", "down_proj")},
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        name: make_lora_adapter(tiny_llama, root / name, **spec) for name, spec in ADAPTERS.items()
    }


def lora_core(model_dir: Path, adapters: dict[str, Path], **kw) -> EngineCore:
    lora = LoraConfig(
        enabled=True,
        max_loras=kw.pop("max_loras", 4),
        max_lora_rank=16,
        max_cpu_loras=kw.pop("max_cpu_loras", None),
        modules=tuple((name, str(path)) for name, path in adapters.items()),
    )
    config = Config(
        model=ModelConfig(path=str(model_dir), dtype="float32", quantization=kw.pop("quant", None)),
        cache=CacheConfig(block_size=4, kv_cache_memory_gib=IN_PROCESS_KV_CACHE_GIB),
        scheduler=SchedulerConfig(**kw),
        lora=lora,
    )
    return EngineCore(config, InProcExecutor(config))


def hf_reference(
    base: Path, adapter: Path | None, prompt: list[int], n: int = MAX_TOKENS
) -> tuple[list[int], list[float]]:
    """Hugging Face PEFT's greedy tokens and each one's logprob (full recompute per token)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(row.argmax()))
            logprobs.append(float(row[ids[-1]]))
    return ids[len(prompt) :], logprobs


def run(core: EngineCore, requests: dict[str, tuple[list[int], str | None]]) -> dict:
    """(tokens, logprobs, last output) by request id, every request greedy with logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for req_id, (prompt, lora) in requests.items():
        req = EngineCoreRequest(req_id, prompt, params, lora_name=lora)
        assert core.add_request(req) == []
    return drain(core)


def drain(
    core: EngineCore, earlier: list[EngineCoreOutput] = ()
) -> dict[str, tuple[list[int], list[float], EngineCoreOutput]]:
    """Steps until every request finished, after the outputs of steps the caller ran."""
    results: dict[str, tuple[list[int], list[float], EngineCoreOutput]] = {}
    steps = [list(earlier)] + [None] * 10_000
    for outputs in steps:
        if outputs is None:
            if not core.scheduler.has_requests:
                break
            outputs = core.step()
        for out in outputs:
            tokens, logprobs, _ = results.get(out.request_id, ([], [], out))
            tokens += out.new_token_ids
            logprobs += out.new_logprobs.logprobs if out.new_logprobs is not None else []
            results[out.request_id] = (tokens, logprobs, out)
    assert not core.scheduler.has_requests
    return results


def mixed_requests(model_dir: Path) -> dict[str, tuple[list[int], str | None]]:
    """12 requests: 3 prompts (one shares another's prefix) on the base model and each adapter."""
    prompts = make_prompts(vocab_of(model_dir), n=6)[3:]
    names = [None, *ADAPTERS]
    return {f"p{i}-{name}": (p, name) for i, p in enumerate(prompts) for name in names}


def int8_reference(base: Path, out: Path) -> Path:
    """The base model with every weight tern stores int8 (--quantization int8) replaced by its
    int8 rows times their scales: what tern's int8 layers multiply."""
    from workers.quant.quantization import quantize_rows

    shutil.copytree(base, out)
    tensors = load_file(base / "model.safetensors")
    for name, w in tensors.items():
        if w.dim() == 2:
            q, scale = quantize_rows(w)
            tensors[name] = q.float() * scale[:, None]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def int4_reference(base: Path, out: Path) -> Path:
    """The base model with every linear layer's weight as its INT4_ZP blocks' values
    (--quantization int4)."""
    from tests.unit.test_quantized_checkpoints import LINEARS
    from workers.quant import int4_blocks

    shutil.copytree(base, out)
    tensors = load_file(base / "model.safetensors")
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        w = tensors[name].float().numpy()
        tensors[name] = torch.from_numpy(
            int4_blocks.dequantize(int4_blocks.quantize(w), w.shape[1])
        )
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("case", ["float32", "chunked", "int8", "int4"])
def test_base_and_three_adapters_in_one_batch_match_hf_peft(
    case: str, tiny_llama: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    kw = {"max_num_batched_tokens": 7} if case == "chunked" else {}
    references = {"int8": int8_reference, "int4": int4_reference}
    reference_base = tiny_llama
    if case in references:
        kw["quant"] = case
        reference_base = references[case](tiny_llama, tmp_path / case)
    core = lora_core(tiny_llama, adapters, **kw)
    requests = mixed_requests(tiny_llama)
    # Twice: the second round's prompts are found in the prefix cache, each under its adapter.
    for round_ in range(2):
        results = run(core, {f"{k}.{round_}": v for k, v in requests.items()})
        outputs = {}
        for req_id, (prompt, name) in requests.items():
            tokens, logprobs, last = results[f"{req_id}.{round_}"]
            ref_tokens, ref_logprobs = hf_reference(
                reference_base, adapters.get(name) if name else None, prompt
            )
            assert tokens == ref_tokens, req_id
            atol = 3e-3 if case == "int8" else 1e-3  # int8: activations rounded to int16
            torch.testing.assert_close(
                torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=atol, rtol=0
            )
            assert last.lora_version == ("1" if name else None)
            outputs.setdefault(prompt[0], set()).add(tuple(tokens))
        assert all(len(v) > 1 for v in outputs.values())  # the adapters change the answers
    assert core.scheduler.kv.prefix_cache_hits > 0


def test_versions_live_side_by_side_and_unload_lets_requests_finish(
    tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    core = lora_core(tiny_llama, {"x": adapters["a4"]})
    prompt = make_prompts(vocab_of(tiny_llama), n=3)[2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core.add_request(EngineCoreRequest("old", prompt, params, lora_name="x"))
    first = core.step()
    # A new version under the same name: the running request keeps version 1.
    registry = core.loras
    assert registry is not None
    source = LoadLora(-1, 8, adapter_spec(json.loads((adapters["a8"] / "adapter_config.json")
                                                     .read_text()))[1], path=str(adapters["a8"]))  # fmt: skip
    registry.load("x", source, None, core.scheduler.running_adapters())
    core.add_request(EngineCoreRequest("new", prompt, params, lora_name="x"))
    registry.unload("x")  # both still finish, each on its version
    results = drain(core, first)
    assert results["old"][0] == hf_reference(tiny_llama, adapters["a4"], prompt)[0]
    assert results["new"][0] == hf_reference(tiny_llama, adapters["a8"], prompt)[0]
    assert (results["old"][2].lora_version, results["new"][2].lora_version) == ("1", "2")
    assert registry.slots == [None] * len(registry.slots)  # both versions gave their slot back
    out = core.add_request(EngineCoreRequest("gone", prompt, params, lora_name="x"))
    assert out[0].finish_reason == FinishReason.ERROR and "no LoRA adapter" in out[0].error
    # A staged load (--dp: every replica loads before any serves) is served only on commit.
    registry.load("x", source, None, (), stage=True)
    assert "x" not in registry.current
    registry.finish_staged("x", commit=False)
    assert "x" not in registry.current and registry.slots == [None] * len(registry.slots)
    registry.load("x", source, "v9", (), stage=True)
    registry.finish_staged("x", commit=True)
    assert registry.current["x"].version == "v9"


def test_more_adapters_than_slots_are_evicted_and_reloaded(
    tiny_llama: Path, adapters: dict[str, Path]
) -> None:
    """Two slots, three adapters, one per batch (--max-loras 1): each batch evicts the least
    recently used idle adapter and loads its own again; every answer is its adapter's."""
    core = lora_core(tiny_llama, {}, max_loras=1, max_cpu_loras=2)
    registry = core.loras
    assert registry is not None
    for name, path in adapters.items():
        rank, scaling = adapter_spec(json.loads((path / "adapter_config.json").read_text()))
        registry.load(name, LoadLora(-1, rank, scaling, path=str(path)), None, ())
    assert sum(a.slot >= 0 for a in registry.current.values()) == 2
    prompt = make_prompts(vocab_of(tiny_llama), n=3)[1]
    requests = {f"{name}{i}": (prompt, name) for i in range(2) for name in ADAPTERS}
    results = run(core, requests)
    for req_id, (_, name) in requests.items():
        assert results[req_id][0] == hf_reference(tiny_llama, adapters[name], prompt)[0], req_id


def test_what_tern_refuses(tiny_llama: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    for change, message in [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"r": 300}, "--max-lora-rank"),
        ({"peft_type": "IA3"}, "not LoRA"),
    ]:
        with pytest.raises(LoraError, match=message):
            adapter_spec({**base, **change}, max_rank=256)
    core = lora_core(tiny_llama, {})
    registry = core.loras
    assert registry is not None
    rank, scaling = adapter_spec(json.loads((adapters["a4"] / "adapter_config.json").read_text()))
    tensors = load_file(adapters["a4"] / "adapter_model.safetensors")
    name = next(n for n in tensors if "q_proj.lora_B" in n)
    for bad, message in [
        ({**tensors, name: tensors[name][:, :2].contiguous()}, "do not pair"),
        ({**tensors, name.replace("q_proj", "lm_head"): tensors[name].clone()}, "not served"),
        (
            {**tensors, name.replace("lora_B", "lora_magnitude_vector"): tensors[name].clone()},
            "DoRA",
        ),
        ({k: v for k, v in tensors.items() if k != name}, "lacks lora_B"),
    ]:
        path = tmp_path / "bad"
        shutil.copytree(adapters["a4"], path, dirs_exist_ok=True)
        save_file(bad, path / "adapter_model.safetensors")
        with pytest.raises(LoraError, match=message):
            registry.load("bad", LoadLora(-1, rank, scaling, path=str(path)), None, ())
        assert "bad" not in registry.current
    with pytest.raises(LoraError, match="max-lora-rank"):
        registry.load("big", LoadLora(-1, 32, 1.0, path=str(adapters["a4"])), None, ())


def test_an_evicted_adapter_that_no_longer_loads_fails_its_requests(
    tiny_llama: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """One slot: loading b evicts a; a's files then vanish, so a request on a fails with a
    message naming it while b keeps serving (nothing waits forever)."""
    copies = {n: Path(shutil.copytree(adapters[n], tmp_path / n)) for n in ("a4", "a8")}
    core = lora_core(tiny_llama, {}, max_loras=1, max_cpu_loras=1)
    registry = core.loras
    assert registry is not None
    for name, path in copies.items():
        rank, scaling = adapter_spec(json.loads((path / "adapter_config.json").read_text()))
        registry.load(name, LoadLora(-1, rank, scaling, path=str(path)), None, ())
    assert registry.current["a4"].slot == -1  # evicted by a8
    shutil.rmtree(copies["a4"])
    prompt = make_prompts(vocab_of(tiny_llama), n=3)[1]
    results = run(core, {"on-a4": (prompt, "a4"), "on-a8": (prompt, "a8")})
    assert results["on-a4"][2].finish_reason == FinishReason.ERROR
    assert "could not be loaded again" in results["on-a4"][2].error
    assert results["on-a8"][0] == hf_reference(tiny_llama, adapters["a8"], prompt)[0]
