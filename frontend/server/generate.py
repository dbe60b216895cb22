"""POST /generate: LMDeploy's and SGLang's, told apart by the body.

Both servers call the route /generate. The rule, applied to the JSON object of the body:
- SGLang's when it has a key only SGLang's GenerateReqInput has (`SGLANG_ONLY_KEYS`: text,
  sampling_params, rid, return_text_in_logprobs, token_ids_logprob, input_embeds, lora_path...),
  or when its `input_ids` is a batch (a list whose first item is a list: LMDeploy takes one prompt);
- LMDeploy's otherwise, which covers every body made only of the keys both have (input_ids,
  stream, return_logprob, top_logprobs_num, logprob_start_len, image_data, session_id,
  return_routed_experts) and anything that is not a JSON object (LMDeploy's decoder answers 400).
A body with keys of both (e.g. `prompt` beside `sampling_params`) is SGLang's; its LMDeploy-only
keys are then a 400 naming the first one.

The rule lives here, above both API packages, because it needs both schemas (lmdeploy/protocol.py,
sglang/protocol.py) and neither package knows the other.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.common.errors import bad_request
from frontend.lmdeploy.protocol import GenerateRequest
from frontend.lmdeploy.serving import LMDeployServing
from frontend.sglang.protocol import SGLangGenerateRequest
from frontend.sglang.serving import SGLangServing

# Keys of SGLang's GenerateReqInput that LMDeploy's GenerateReqInput does not have.
SGLANG_ONLY_KEYS = frozenset(SGLangGenerateRequest.__struct_fields__) - frozenset(
    GenerateRequest.__struct_fields__
)
_LMDEPLOY_ONLY_KEYS = frozenset(GenerateRequest.__struct_fields__) - frozenset(
    SGLangGenerateRequest.__struct_fields__
)


class GenerateServing:
    def __init__(self, lmdeploy: LMDeployServing, sglang: SGLangServing) -> None:
        self.lmdeploy = lmdeploy
        self.sglang = sglang

    async def generate(self, http_request: Request) -> Response:
        body = await http_request.body()
        if not is_sglang_generate(body):
            return await self.lmdeploy.generate(http_request, body)
        check_no_lmdeploy_keys(body)
        return await self.sglang.generate(http_request, body)


def is_sglang_generate(body: bytes) -> bool:
    """Whether a /generate body is SGLang's (the rule in the module docstring)."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False  # LMDeploy's decoder answers the 400
    if not isinstance(obj, dict):
        return False
    if not SGLANG_ONLY_KEYS.isdisjoint(obj):
        return True
    ids = obj.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def check_no_lmdeploy_keys(body: bytes) -> None:
    """400 naming the first LMDeploy-only key of a body the rule told SGLang's."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict):
        mixed = sorted(_LMDEPLOY_ONLY_KEYS.intersection(obj))
        if mixed:
            raise bad_request(
                f"'{mixed[0]}' is LMDeploy's /generate field; this body is SGLang's (it has "
                f"{', '.join(sorted(SGLANG_ONLY_KEYS.intersection(obj))) or 'a batch'})",
                mixed[0],
            )
