"""What every way of serving tern shares once its Config is built: the tokenizer, the engine's
start and the serving layer with its ASGI app. `tern launch` (frontend/server/launcher.py) puts the app
behind uvicorn; a Ray Serve replica (frontend/ray_serve/) hands it to Ray's HTTP proxy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette

from enginecore.config import Config
from enginecore.model_task import read_model_task
from frontend.cli.server import FrontendConfig
from frontend.common.metrics import Metrics
from frontend.disagg.requests import KVSide
from frontend.engine.client import EngineClient
from frontend.server.app import build_app
from frontend.serving.base import OpenAIServing

if TYPE_CHECKING:
    from frontend.text.tokenizer import Tokenizer

logger = logging.getLogger("tern.frontend")


def load_tokenizer(config: Config, frontend: FrontendConfig) -> Tokenizer:
    """The model's tokenizer with --generation-config's defaults (imports transformers: seconds)."""
    from frontend.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(config.model.path, frontend.chat_template)
    tokenizer.generation_defaults = generation_defaults(
        frontend.generation_config, tokenizer.generation_defaults
    )
    return tokenizer


async def start_serving(
    config: Config, frontend: FrontendConfig, engine: EngineClient, tokenizer: Tokenizer
) -> tuple[Starlette, OpenAIServing]:
    """Starts the engine (waits for every replica's EngineReady) and builds the serving layer and
    the ASGI app over it."""
    ready = await engine.start()
    logger.info("model: %s", ready.model_summary)
    logger.info(
        "KV cache: %d blocks x %d = %d tokens; max_model_len %d",
        ready.num_kv_blocks,
        ready.block_size,
        ready.num_kv_blocks * ready.block_size,
        ready.max_model_len,
    )
    names = frontend.served_model_names
    metrics = Metrics(names[0], lambda: engine.latest_stats)
    serving = OpenAIServing(
        engine, tokenizer, names, ready.max_model_len, ready.vocab_size, metrics,
        records_routing=config.model.enable_return_routed_experts,
    )  # fmt: skip
    kv = config.kv_transfer
    serving.kv = KVSide(kv, config.instance_id, config.parallel.tensor_parallel_size)
    if kv.enabled:
        logger.info(
            "KV transfer: %s (%s), bootstrap at %s:%d",
            kv.role, kv.connector, kv.bootstrap_host, kv.bootstrap_port,
        )  # fmt: skip
    task = read_model_task(config.model.path, config.model.task, config.model.language_model_only)
    if task.is_encoder_decoder:
        from frontend.audio.speech import SpeechModel

        serving.speech = SpeechModel(config.model.path, tokenizer)
    if task.takes_audio:
        from frontend.audio.prompts import AudioProcessor, AudioPrompts

        serving.audio = AudioPrompts(AudioProcessor(config.model.path), frontend.media)
    if task.takes_images:
        from frontend.media.processing import ImageProcessor
        from frontend.media.prompts import ImagePrompts

        processor = ImageProcessor(config.model.path)
        serving.images = ImagePrompts(processor, frontend.media)
    app = build_app(config, frontend, engine, serving)
    return app, serving


def generation_defaults(option: str, model_defaults: dict[str, Any]) -> dict[str, Any]:
    """--generation-config, as vLLM: 'auto' keeps the model's generation_config.json defaults,
    'vllm' drops them (the API's defaults apply), a folder's generation_config.json replaces them.
    EOS ids always come from the model's files."""
    if option == "auto":
        return model_defaults
    if option == "vllm":
        return {}
    import json
    from pathlib import Path

    from frontend.text.tokenizer import GENERATION_DEFAULT_KEYS

    with open(Path(option) / "generation_config.json") as f:
        config = json.load(f)
    return {k: config[k] for k in GENERATION_DEFAULT_KEYS if config.get(k) is not None}
