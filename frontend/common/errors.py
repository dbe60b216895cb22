"""OpenAI-style errors: one exception type for every client-visible failure, and its JSON body.

Every error the server returns has the shape `{"error": {"message", "type", "param", "code"}}`, the
one the OpenAI clients parse. Client mistakes are 4xx with `param` naming the offending field; only
server faults are 5xx.
"""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def to_response(self) -> ErrorResponse:
        err_type = _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return ErrorResponse(ErrorInfo(self.message, err_type, self.param, self.code))


# Anthropic's error types by status (its Messages API answers {"type": "error", "error": {...}}).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"


class AnthropicErrorInfo(msgspec.Struct):
    type: str
    message: str  # names the offending field, when there is one


class AnthropicErrorResponse(msgspec.Struct, tag="error", tag_field="type"):
    error: AnthropicErrorInfo


def error_body(err: APIError, path: str) -> ErrorResponse | AnthropicErrorResponse:
    """The error body clients of `path` parse: Anthropic's under /v1/messages, else OpenAI's."""
    if not path.startswith(ANTHROPIC_PATH_PREFIX):
        return err.to_response()
    message = err.message
    if err.param is not None and err.param not in message:
        message = f"{err.param}: {message}"
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
    return AnthropicErrorResponse(AnthropicErrorInfo(kind, message))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)


def engine_dead_error(reason: str | None) -> APIError:
    return APIError(
        f"the engine is not running: {reason or 'unknown reason'}", 503, None, "engine_dead"
    )
