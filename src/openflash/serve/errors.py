"""The server's error responses: OpenAI-style bodies {"error": {"message", "type", "param", "code"}}, and the
translation of FastAPI's and the engine's refusals into them, each naming the field as the request named it.

Every refusal of a request's content is a 400, as OpenAI and vLLM answer (their clients catch `BadRequestError`,
context overflow included, code `context_length_exceeded`)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from openflash.engine.prompt import INVALID_IMAGES, MAX_TOKENS, TOO_LONG, PromptError
from openflash.errors import RequestError
from openflash.serve.guards import safe_text
from openflash.chat.messages import LONE_SURROGATE, TOO_DEEP
from openflash.serve.protocol import NOT_SUPPORTED
from openflash.serve.responses import ErrorInfo, ErrorResponse

FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's words for any exception of its JSON parser


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=safe_text(self.message), type=self.type,
                                             param=None if self.param is None else safe_text(self.param, 200),
                                             code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def prompt_error(exc: PromptError, body: Any = None) -> APIError:
    """A prompt the intake refused (engine/prompt.py): a 400 with the intake's code (context_length_exceeded for
    a prompt or max_tokens the context cannot hold, as OpenAI's and vLLM's clients expect), the field named as the
    request named it."""
    if exc.code == MAX_TOKENS:
        err = field_error(exc, body) if body is not None else APIError(400, str(exc), param=exc.param)
        err.code = TOO_LONG
        return err
    code = "invalid_value" if exc.code == INVALID_IMAGES else exc.code
    return APIError(400, str(exc), param=exc.param, code=code)


def engine_failure(error: str | None, unavailable: bool) -> APIError:
    """A request the engine failed: 503 when a storage tier could not be read (the engine's message names no
    file), 500 otherwise."""
    if unavailable:
        return APIError(503, f"temporarily unavailable: {error}", "server_error", code="engram_unavailable")
    return APIError(500, f"generation failed: {error}", "server_error", code="engine_error")


def field_error(exc: RequestError, body: Any) -> APIError:
    """A field's error (400), named as the request named it: a chat request's length may come as
    max_completion_tokens."""
    param, message = exc.param, str(exc)
    field_name = body.max_tokens_field()
    if param == "max_tokens" and field_name != param:
        param, message = field_name, message.replace("max_tokens", field_name, 1)
    return APIError(400, message, param=param, code="invalid_value")


def http_error(status: int, detail: str) -> APIError:
    """An HTTPException from Starlette or FastAPI (unknown route, the body guards, an unparsable body)."""
    code = {404: "not_found", 408: "request_timeout", 413: "request_too_large"}.get(status)
    if status == 400 and detail == FASTAPI_PARSE_ERROR:
        detail = ("malformed JSON body: it could not be parsed (broken, or nested deeper than the parser's limit of "
                  "about 1,000 levels)")
        code = "invalid_json"
    return APIError(status, detail, code=code)


def validation_error(exc: RequestValidationError, raw: bytes) -> APIError:
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            return APIError(400, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}",
                            code="invalid_json")
    e = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if e.get("type") in (LONE_SURROGATE, TOO_DEEP, NOT_SUPPORTED):
        code = {LONE_SURROGATE: "invalid_text", TOO_DEEP: "too_deep"}.get(e.get("type"), "unsupported_parameter")
        return APIError(400, str(e.get("msg")), param=e.get("ctx", {}).get("param") or None, code=code)
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    # Union members add their type name to the location (e.g. prompt.str); keep the field path.
    loc = [p for p in loc if p not in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "function-after")
           and not p.startswith(("list[", "function-"))]
    param = ".".join(loc) or None
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "missing"):
        # No body, a body that is not JSON (sent without a JSON content type), or JSON that is not an object.
        try:
            parsed = json.loads(raw)
        except ValueError as bad:
            return APIError(400, f"malformed JSON body: {bad}", code="invalid_json")
        if isinstance(parsed, dict):  # valid JSON that FastAPI did not parse: the content type says otherwise
            return APIError(400, "the request body is JSON but its Content-Type is not application/json",
                            code="invalid_content_type")
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: unrecognized request argument (this server refuses what it would not act "
                             f"on; README: Serving)", param=param, code="unknown_parameter")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
