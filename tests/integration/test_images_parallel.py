"""Images on the parallel and RL paths, against Hugging Face: the tiny random LLaVA served at
`--tp 2 --pp 2` (the encoder on the first stage, replicated across its tensor-parallel ranks; the
second stage keeps the images for bookkeeping only) and at `--dp 2`, each greedy answer with one
and two images token for token `LlavaForConditionalGeneration.generate`'s in float32, with chunks
of 32 tokens that split the 16-placeholder images.

A third server takes weight updates that carry the vision tower's tensors (from disk, as
tensors, through /dev/shm, from a trainer's process group, and one refused and rolled back): after
each, the answers with images are HF's on the new weights, so neither the old tower nor the
encoder cache's outputs of the old weights were served. It also serves a PEFT LoRA adapter on the
language model, asked with an image in the same batch as a base-model image request (HF:
PeftModel over the LLaVA).
"""

from __future__ import annotations

import multiprocessing
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from enginecore.executor import free_port
from frontend.client.trainer import TernAPIError, TrainerClient
from tests.conftest import make_tiny_model
from tests.integration.hf_vision import HFVision
from tests.integration.test_images import MAX_TOKENS, _data_url, _image, _tokens
from tests.integration.test_rl import _trainer

pytestmark = pytest.mark.timeout(600)

# The prompts of every server: (text, image seeds); one and two images.
ASKS = [
    ("What is in this picture? Describe it in a few words.", [1]),
    ("Compare the two pictures.", [2, 3]),
    ("And this one, in a single word?", [4]),
]
_COMMON = ("--served-model-name", "vl", "--dtype", "float32", "--max-num-batched-tokens", "32",
           "--limit-mm-per-prompt", '{"image": 2}', "--kv-cache-memory", "0.05")  # fmt: skip


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model("llava", tmp_path_factory.mktemp("llava"), tokenizer_dir)


@pytest.fixture(scope="module")
def llava_perturbed(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """The same architecture with other random weights, vision tower included."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model("llava", tmp_path_factory.mktemp("llava_p"), tokenizer_dir, 1)


@pytest.fixture(scope="module")
def hf(llava_dir: Path) -> HFVision:
    return HFVision(llava_dir, "LlavaForConditionalGeneration", MAX_TOKENS)


def _client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def _ask(client: openai.OpenAI, text: str, seeds: list[int], model: str = "vl") -> list[int]:
    content: list[dict] = [{"type": "image_url", "image_url": {"url": _data_url(_image(s))}}
                           for s in seeds]  # fmt: skip
    content.append({"type": "text", "text": text})
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    return _tokens(r)


def _ask_all(client: openai.OpenAI, asks: list[tuple[str, list[int]]], **kw: Any) -> list:
    """All at once: their chunks share steps."""
    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(lambda a: _ask(client, *a, **kw), asks))


def _expected(hf: HFVision, asks: list[tuple[str, list[int]]]) -> list[list[int]]:
    return [hf.greedy(text, [_image(s) for s in seeds]) for text, seeds in asks]


def test_tp2_pp2_answers_with_images_are_hf_exact(
    launch_server: Any, llava_dir: Path, hf: HFVision
) -> None:
    server = launch_server("--model", str(llava_dir), "--tp", "2", "--pp", "2", *_COMMON)
    client = _client(server)
    expected = _expected(hf, ASKS)
    assert _ask(client, *ASKS[0]) == expected[0]  # alone, then all at once
    assert _ask_all(client, ASKS) == expected
    assert expected[0] != hf.greedy(ASKS[0][0], [_image(5)])  # the image matters


def test_dp2_answers_with_images_are_hf_exact(
    launch_server: Any, llava_dir: Path, hf: HFVision
) -> None:
    server = launch_server("--model", str(llava_dir), "--dp", "2", *_COMMON)
    asks = ASKS + [(text, seeds[::-1]) for text, seeds in ASKS]  # both replicas get images
    assert _ask_all(_client(server), asks) == _expected(hf, asks)
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    computed = re.findall(
        r"^tern:replica_prompt_tokens_computed_total\{[^}]*\} (\S+)$", metrics, re.M
    )
    assert len(computed) == 2 and all(float(n) > 0 for n in computed), computed


# --------------------------------------------------------------------------- updates and LoRA


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(model_dir.glob("*.safetensors"))))


def _is_vision(name: str) -> bool:
    return "vision_tower" in name or "multi_modal_projector" in name


# The checkpoint's (transformers 4) prefixes as the loaded model names them (transformers 5).
_HF_NAMES = (("language_model.model.", "model.language_model."),
             ("language_model.lm_head.", "lm_head."),
             ("vision_tower.", "model.vision_tower."),
             ("multi_modal_projector.", "model.multi_modal_projector."))  # fmt: skip


def _hf_name(name: str) -> str:
    for old, new in _HF_NAMES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def _hf_on(hf: HFVision, state: dict[str, torch.Tensor]) -> HFVision:
    """`hf` with its weights replaced by `state` (a checkpoint's tensors)."""
    renamed = {_hf_name(n): t for n, t in state.items()}
    missing, unexpected = hf.model.load_state_dict(renamed, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


@pytest.fixture(scope="module")
def adapter_dir(llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA adapter on the language model's projections only (the CLIP tower has q/k/v
    projections too): its modules are named `model.language_model.layers...`."""
    import peft
    import transformers

    torch.manual_seed(3)
    base = transformers.LlavaForConditionalGeneration.from_pretrained(
        llava_dir, dtype=torch.float32
    )
    config = peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
        target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    )  # fmt: skip
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    out = tmp_path_factory.mktemp("llava_lora")
    model.save_pretrained(out)
    names = load_file(str(out / "adapter_model.safetensors"))
    assert names and all("language_model" in n for n in names), sorted(names)[:4]
    return out


@pytest.fixture(scope="module")
def rl_server(module_server: Any, llava_dir: Path, adapter_dir: Path) -> Any:
    return module_server("--model", str(llava_dir), "--tp", "2", *_COMMON,
                         "--lora-modules", f"ad={adapter_dir}", "--max-lora-rank", "8")  # fmt: skip


def test_lora_on_the_language_model_with_images_in_the_batch(
    rl_server: Any, llava_dir: Path, adapter_dir: Path, hf: HFVision
) -> None:
    import peft

    _hf_on(hf, _state(llava_dir))  # the base weights, whatever ran before
    text, seeds = ASKS[0]
    base_expected = hf.greedy(text, [_image(s) for s in seeds])
    with ThreadPoolExecutor(2) as pool:
        on_adapter = pool.submit(_ask, _client(rl_server), text, seeds, "ad")
        on_base = pool.submit(_ask, _client(rl_server), text, seeds, "vl")
        answers = on_adapter.result(), on_base.result()
    lora = HFVision.__new__(HFVision)
    lora.processor, lora.max_tokens = hf.processor, hf.max_tokens
    lora.model = peft.PeftModel.from_pretrained(
        hf.model, adapter_dir, is_trainable=False
    ).eval()  # fmt: skip
    try:
        adapter_expected = lora.greedy(text, [_image(s) for s in seeds])
    finally:
        hf.model = lora.model.unload()  # the base model back, without the adapter's layers
    assert answers == (adapter_expected, base_expected)
    assert adapter_expected != base_expected


def test_weight_updates_carry_the_vision_tower(
    rl_server: Any, llava_dir: Path, llava_perturbed: Path, hf: HFVision
) -> None:
    client, trainer = _client(rl_server), TrainerClient(rl_server.base_url)
    original, perturbed = _state(llava_dir), _state(llava_perturbed)
    assert any(_is_vision(n) for n in perturbed)
    expected_original = _expected(_hf_on(hf, original), ASKS)
    assert _ask_all(client, ASKS) == expected_original  # the images' encoder outputs are cached

    # Only the vision tower and projector change: the same language model, other image rows.
    vision_only = {**original, **{n: t for n, t in perturbed.items() if _is_vision(n)}}
    trainer.update_weights_from_tensors(
        {n: t for n, t in perturbed.items() if _is_vision(n)}, bucket_bytes=1 << 16
    )
    expected_vision = _expected(_hf_on(hf, vision_only), ASKS)
    assert expected_vision != expected_original
    assert _ask_all(client, ASKS) == expected_vision

    trainer.update_weights_from_disk(str(llava_perturbed))
    expected_perturbed = _expected(_hf_on(hf, perturbed), ASKS)
    assert _ask_all(client, ASKS) == expected_perturbed

    # A refused push (its second tensor has the wrong shape) rolls the tower back too.
    name = next(n for n in original if "vision_tower" in n and n.endswith("q_proj.weight"))
    bad = {n: t for n, t in original.items() if _is_vision(n) and n != name}
    bad[name] = original[name][:, :-1].contiguous()
    with pytest.raises(TernAPIError):
        trainer.update_weights_from_tensors(bad, bucket_bytes=1)
    assert _ask_all(client, ASKS) == expected_perturbed

    # Through /dev/shm, the original tower back under the new language model.
    trainer.update_weights_from_tensors(
        {n: t for n, t in original.items() if _is_vision(n)}, load_format="shm"
    )
    lm_only = {**perturbed, **{n: t for n, t in original.items() if _is_vision(n)}}
    assert _ask_all(client, ASKS) == _expected(_hf_on(hf, lm_only), ASKS)

    # A trainer's process group (gloo here) broadcasts the original checkpoint back.
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(
        target=_trainer, args=(rl_server.base_url, free_port(), str(llava_dir), False, q)
    )
    proc.start()
    assert q.get(timeout=120) == "ok"
    proc.join(30)
    assert proc.exitcode == 0
    _hf_on(hf, original)
    assert _ask_all(client, ASKS) == expected_original
