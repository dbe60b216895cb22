"""The worker-side routes that routers call, beside the ones server/app.py serves for everyone.

What the routers in front of a tern server call, read from their sources and checked against the
binaries (vllm-router 0.1.17, sglang-router 0.3.2):
- at registration: GET /health (both), GET /server_info and /model_info (sglang-router: model_path,
  served_model_name, dp_size; model_type, architectures), GET /get_server_info and /get_model_info
  (older SGLang routers) -- served by server/app.py;
- per request, vllm-router's cache-aware policy: POST /v1/completions/render or
  /v1/chat/completions/render (vLLM's render routes: the prompt's token ids, so it routes on tokens),
  falling back to POST /tokenize;
- for load-based policies: GET /get_load (SGLang's shape: one entry per data-parallel replica with
  num_reqs, num_waiting_reqs, num_tokens; sglang-router sums num_tokens) and GET /load (vLLM's
  {"server_load"});
- health checks on demand: GET /health_generate (SGLang: generate one token; 200 when it came);
- fanned out by the router: GET/POST /flush_cache (control/routes.py), GET /v1/models.

This module knows the HTTP shapes only; prompts are built as the generating routes build them.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.common.decoding import decode_request
from frontend.common.errors import APIError, engine_dead_error
from frontend.common.http import json_response
from frontend.control.serving import ControlServing
from frontend.engine.client import EngineDeadError
from frontend.openai.chat import ChatServing
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend.serving.base import OpenAIServing
from frontend.serving.sampling import RequestSampling, truncate_prompt

HEALTH_GENERATE_TIMEOUT_S = 20.0


class RouterServing:
    def __init__(self, serving: OpenAIServing, chat: ChatServing, control: ControlServing) -> None:
        self.serving = serving
        self.chat = chat
        self.control = control

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/get_load", self.get_load, methods=["GET"]),
            Route("/load", self.load, methods=["GET"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
        ]

    # ------------------------------------------------------------------ render (vLLM)

    def _rendered(self, prefix: str, req: Any, ids: list[int], param: str) -> dict[str, Any]:
        """vLLM's GenerateRequest: what the generating route would run for this prompt."""
        params = self.serving.sampling_params(req.to_sampling(), ids, param)
        return {
            "request_id": prefix + uuid.uuid4().hex,
            "token_ids": ids,
            "sampling_params": msgspec.to_builtins(params),
            "model": self.serving.model_name,
        }

    async def render_completion(self, request: Request) -> Response:
        s = self.serving
        req = decode_request(await request.body(), CompletionRequest)
        s.check_model(req.model)
        out = []
        for prompt in req.normalized_prompts():
            ids = s.encode_prompt(prompt, req.add_special_tokens, "prompt")
            ids = truncate_prompt(ids, req.truncate_prompt_tokens, s.max_model_len)
            out.append(self._rendered("cmpl-", req, ids, "prompt"))
        return json_response(out)

    async def render_chat(self, request: Request) -> Response:
        req = decode_request(await request.body(), ChatCompletionRequest)
        self.serving.check_model(req.model)
        _, ids = self.chat.render(req, self.chat.plan(req))
        return json_response(self._rendered("chatcmpl-", req, ids, "messages"))

    # ------------------------------------------------------------------ load

    async def get_load(self, request: Request) -> Response:
        """SGLang's /get_load: one entry per living data-parallel replica (--dp)."""
        try:
            replicas = await self.serving.engine.replica_stats()
        except EngineDeadError as e:
            raise engine_dead_error(str(e)) from e
        return json_response([
            {
                "dp_rank": index,
                "num_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
                "num_waiting_reqs": s["num_waiting_reqs"],
                "num_tokens": (s["num_total_blocks"] - s["num_free_blocks"]) * s["block_size"],
            }
            for index, s in replicas
        ])  # fmt: skip

    async def load(self, request: Request) -> Response:
        """vLLM's /load: the HTTP requests in flight."""
        return json_response({"server_load": len(self.serving.inflight.all())})

    # ------------------------------------------------------------------ health_generate (SGLang)

    async def health_generate(self, request: Request) -> Response:
        """200 once the engine generated one token; 503 when it cannot (asleep, dead, stuck)."""
        s = self.serving
        if not self.control.is_serving:
            raise APIError("the server is asleep or waits for weights", 503, None, "unhealthy")
        ids = s.tokenizer.encode("ping", add_special_tokens=True)
        request_id = "health-" + uuid.uuid4().hex
        sampling = RequestSampling(max_tokens=1, temperature=0.0)
        group = s.start(request_id, [request_id], sampling, [ids], "prompt")
        try:
            await asyncio.wait_for(group.gens[0].collect(), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineDeadError, APIError) as e:
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e)
            raise APIError(f"health_generate failed: {reason}", 503, None, "unhealthy") from None
        finally:
            group.close()
        return Response(status_code=200)
