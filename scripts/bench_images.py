"""Images in, measured: time to first token for one 448x448 image and ~64 text tokens, and output
throughput at concurrency 8, on any OpenAI-compatible server (tern, vLLM, ...), on random
checkpoints shaped like the small image models people serve.

    python scripts/bench_images.py make --arch gemma3|qwen2_5_vl --out /tmp/bench-gemma3
    python scripts/bench_images.py run --base-url http://127.0.0.1:8000 --label tern \
        --encoder-of /tmp/bench-gemma3 --result-file docs/bench_results/images_tern_gemma3.json

`make` builds the checkpoint with its processor beside it (the default model's tokenizer with the
image tokens added): Gemma 3 at 448 px (SigLIP-base-sized tower, 1024 patches pooled to 256
placeholders) before a ~0.6B Gemma 3 text model; or Qwen2.5-VL with a 12-block windowed tower
(hidden 768, windows of 112 px, full attention in blocks 3, 7 and 11; a 448 px image is 1024
patches merged to 256 placeholders) before a Qwen2-0.5B-shaped text model (M-RoPE in sections). `run` sends streaming chat requests, each with its
own random image (no prefix-cache or encoder-cache hit), ignore_eos; TTFT is the first chunk with
text. `--encoder-of DIR` also times tern's image encoder alone on that checkpoint, in this process
with the same thread count as a worker, and reports its share of the median TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import (  # noqa: E402 (scripts/ is not a package)
    GEMMA3_CHAT_TEMPLATE,
    QWEN_VL_CHAT_TEMPLATE,
)

IMAGE_SIDE = 448
TEXT = (
    "Look at this picture carefully and describe every object you can see in it, their colours, "
    "their positions relative to each other, and anything unusual about the scene, in detail."
)


def make_gemma3(out: Path) -> Path:
    """A random Gemma3ForConditionalGeneration at 448 px with its processor."""
    import torch
    import transformers

    from frontend.model_prep import default_model_dir

    tokens = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
              "eoi_token": "<end_of_image>"}  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        default_model_dir(), extra_special_tokens=tokens
    )
    ids = {f"{k.removesuffix('_token')}_token_index": tokenizer.convert_tokens_to_ids(v)
           for k, v in tokens.items()}  # fmt: skip
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer) + (-len(tokenizer)) % 64, hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=4096,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=IMAGE_SIDE, patch_size=14, vision_use_head=False,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=256, **ids
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # from_config zeroes it; a trained checkpoint does not
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.02)
    model.save_pretrained(out)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(
            size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}
        ),
        tokenizer=tokenizer, image_seq_length=256,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote {out}: {params:.0f}M parameters")
    return out


def make_qwen2_5_vl(out: Path) -> Path:
    """A random Qwen2_5_VLForConditionalGeneration, its image processor and chat template."""
    import torch
    import transformers

    from frontend.model_prep import default_model_dir

    tokens = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
              "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        default_model_dir(), extra_special_tokens=tokens
    )
    ids = {f"{k}_id": tokenizer.convert_tokens_to_ids(v) for k, v in tokens.items()}
    rope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [8, 12, 12],
    }  # head_dim 64
    text = transformers.Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer) + (-len(tokenizer)) % 64, hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=rope,
    )  # fmt: skip
    vision = {"depth": 12, "hidden_size": 768, "intermediate_size": 2048, "num_heads": 12,
              "out_hidden_size": 896, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [3, 7, 11]}  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=True, **ids
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2
    ).save_pretrained(out)
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote {out}: {params:.0f}M parameters")
    return out


def _image_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _one(client: httpx.AsyncClient, model: str, seed: int, max_tokens: int) -> dict:
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _image_url(seed)}},
            {"type": "text", "text": TEXT}]}],
    }  # fmt: skip
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft, "e2e": time.perf_counter() - start, "tokens": tokens}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=600) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        await _one(client, model, 10_000, 4)  # warm-up
        single = [await _one(client, model, i, 16) for i in range(args.num_single)]
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(seed: int) -> dict:
            async with sem:
                return await _one(client, model, seed, args.output_len)

        start = time.perf_counter()
        batch = await asyncio.gather(*(bounded(1000 + i) for i in range(args.num_concurrent)))
        wall = time.perf_counter() - start
    result = {
        "label": args.label, "model": model, "cpu": _cpu(),
        "ttft_s_median": statistics.median(r["ttft"] for r in single),
        f"c{args.concurrency}_output_tok_s": sum(r["tokens"] for r in batch) / wall,
        f"c{args.concurrency}_ttft_s_median": statistics.median(r["ttft"] for r in batch),
        "image_side": IMAGE_SIDE, "output_len": args.output_len,
    }  # fmt: skip
    if args.encoder_of:
        encode = _encoder_seconds(Path(args.encoder_of), args.threads)
        result["encoder_s_median"] = encode
        result["encoder_share_of_ttft"] = encode / result["ttft_s_median"]
    return result


def _encoder_seconds(model_dir: Path, threads: int) -> float:
    """tern's image encoder alone on one image of the checkpoint, median of 5."""
    import torch

    from frontend.media.processing import ImageProcessor
    from workers.runner.images import tensor_from_data
    from workers.vision.encoders import build_image_encoder
    from workers.weight_loader import iter_safetensors

    torch.set_num_threads(threads)
    config = json.loads((model_dir / "config.json").read_text())
    encoder = build_image_encoder(config)
    assert encoder is not None, f"{model_dir} has no image encoder tern serves"
    encoder.load_weights(iter_safetensors(model_dir))
    processor = ImageProcessor(model_dir)
    image = Image.open(io.BytesIO(base64.b64decode(_image_url(7).split(",")[1])))
    tensors, _ = processor._image_tensors(image, {})
    inputs = {k: tensor_from_data(v, torch.device("cpu")) for k, v in tensors.items()}
    times = []
    with torch.inference_mode():
        for _ in range(5):
            t0 = time.perf_counter()
            encoder.encode(inputs)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    tiers = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return f"{platform.processor() or platform.machine()} ({', '.join(tiers) or 'no avx2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make")
    make.add_argument("--arch", choices=["gemma3", "qwen2_5_vl"], default="gemma3")
    make.add_argument("--out", type=Path, required=True)
    bench = sub.add_parser("run")
    bench.add_argument("--base-url", required=True)
    bench.add_argument("--model", default=None)
    bench.add_argument("--label", required=True)
    bench.add_argument("--num-single", type=int, default=5)
    bench.add_argument("--concurrency", type=int, default=8)
    bench.add_argument("--num-concurrent", type=int, default=16)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--encoder-of", default=None, help="time tern's encoder of this checkpoint")
    bench.add_argument("--threads", type=int, default=2)
    bench.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "make":
        {"gemma3": make_gemma3, "qwen2_5_vl": make_qwen2_5_vl}[args.arch](args.out)
        return
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
