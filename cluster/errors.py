"""OpenAI-style errors: one exception type, the JSON body and the status code it maps to.

Every failure the ingress reports to a client goes through ``APIError`` and leaves as
``{"error": {"message", "type", "param", "code"}}`` (``code`` a string or null, as OpenAI's
clients expect; 5xx errors have type ``server_error``) with a 4xx status for anything the client
can fix (400 bad input, 401 key, 404 model, 413 body size, 429 overload with Retry-After) and
a 5xx only for faults of the server itself. Pydantic ``ValidationError``s and the
``ValueError``s raised by ``SamplingParams``/the engine (whose messages start with the field
name) are translated here so the param the client must fix is named in ``param``.
"""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

# Seconds a client should wait before retrying an overloaded server; one engine step on a
# loaded replica is tens of milliseconds, so a second is enough for the queue to move.
DEFAULT_RETRY_AFTER_S = 1
# OpenAI's error type for faults of the server (5xx); clients retry on it.
SERVER_ERROR = "server_error"

# Request fields whose name may start a ValueError message from SamplingParams or the engine;
# the first word of such a message names the offending field.
KNOWN_PARAMS = frozenset(
    {
        "n",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "messages",
        "prompt",
        "model",
        "cache_salt",
        "tokens",
        "stream_options",
        "logit_bias",
        "prompt_logprobs",
        "echo",
        "chat_template_kwargs",
        "add_special_tokens",
    }
)


class APIError(Exception):
    """An error the ingress reports to the client as OpenAI-style JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        if err_type is None:
            err_type = SERVER_ERROR if status >= 500 else "invalid_request_error"
        self.err_type = err_type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse_payload(self) -> str:
        """The error as one SSE event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code="not_found")


def unauthorized() -> APIError:
    return APIError(
        401,
        "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
        err_type="authentication_error",
        code="invalid_api_key",
    )


def body_too_large(limit_bytes: int) -> APIError:
    return APIError(
        413, f"Request body exceeds the limit of {limit_bytes} bytes.", code="request_too_large"
    )


def overloaded(reason: str, retry_after_s: int = DEFAULT_RETRY_AFTER_S) -> APIError:
    return APIError(
        429,
        f"The server is overloaded ({reason}); retry after {retry_after_s} s.",
        err_type="rate_limit_error",
        code="server_overloaded",
        retry_after_s=retry_after_s,
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, err_type=SERVER_ERROR, code="service_unavailable")


def internal(message: str) -> APIError:
    return APIError(500, message, err_type=SERVER_ERROR, code="internal_error")


def param_of(message: str) -> str | None:
    """The field a ValueError message names first (``"top_p must be in (0, 1]"`` -> top_p)."""
    match = re.match(r"[A-Za-z_][A-Za-z_.]*", message)
    first = match.group(0).rstrip(".") if match else ""
    if "." in first:  # "EngineConfig.max_model_len: ..." names a server setting, not a field
        return None
    return first if first in KNOWN_PARAMS else None


def from_value_error(exc: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """A 400 from a ValueError raised while validating the request (SamplingParams, engine)."""
    message = str(exc) or "invalid request"
    param = param_of(message)
    if rename and param in rename:
        # Blame the field the client sent (chat's top_logprobs is the engine's logprobs).
        message = rename[param] + message[len(param) :]
        param = rename[param]
    return bad_request(message, param)


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first field pydantic rejected; malformed JSON gets its own message."""
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"Malformed JSON body: {first['msg']}", None)
    # Union members add their type names to the location ("prompt.list[int].0"); drop them.
    loc = [str(part) for part in first.get("loc", ()) if not _is_type_tag(str(part))]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    if first["type"] == "model_type" and not loc:
        return bad_request("The request body must be a JSON object.", None)
    return bad_request(f"{where}: {first['msg']}", param)
