"""ASGI guards in front of the routes: the request id, the request body limit (size and stalls), the API key, and
a last-resort error handler.

They are plain ASGI wrappers rather than FastAPI dependencies so that they act before a body is read or parsed:
a 20 MiB upload is refused by its Content-Length (or once its streamed bytes pass the limit) without being held in
memory, and an unauthenticated client never reaches the JSON parser.

`ErrorGuard` exists because Starlette's own handler for unhandled exceptions sends the 500 and then re-raises,
which makes uvicorn drop the kept-alive connection; here the 500 is the end of it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

log = logging.getLogger("openflash.serve")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_ECHO_CHARS = 80  # longest user value quoted back in an error message
MAX_MESSAGE_CHARS = 2000  # longest error message sent at all


def clip(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """repr() of a user-supplied value for an error message: at most `limit` characters, then how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(str(value))} characters)"


def safe_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message that always encodes as UTF-8 (lone surrogates escaped) and has a bounded length."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "... (message cut)"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": safe_text(message), "type": type_, "param": param, "code": code}},
                      ensure_ascii=False).encode("utf-8")


async def send_error(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class _StartTracker:
    """Wraps `send` and remembers whether a response has started (after that, no error body can be sent)."""

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit; an HTTPException, so that FastAPI's body
    reader passes it on (it turns other exceptions into a 400) and the app's handler answers 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is over this server's limit of {max_bytes} bytes "
                              f"(--max-request-bytes)")


class BodyStalled(HTTPException):
    """Raised from `receive` when a body's next bytes do not come in time (a client that stalls mid-upload would
    otherwise hold its connection and handler forever); an HTTPException for the same reason as BodyTooLarge."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body stalled: no bytes for {seconds:g} s (--body-timeout)")


class BodyLimit:
    """413 for a request body over `max_bytes`: at once from Content-Length, or when the streamed bytes pass it;
    408 when the body's next bytes take more than `idle_timeout` seconds (only while the body is incomplete: the
    wait for a disconnect during a long stream is not timed)."""

    def __init__(self, app: ASGIApp, max_bytes: int, idle_timeout: float = 30.0) -> None:
        self.app, self.max_bytes, self.idle_timeout = app, max_bytes, idle_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                body = error_body(f"invalid Content-Length header {clip(declared.decode('latin-1'))}",
                                  "invalid_request_error", code="invalid_header")
                return await send_error(send, 400, body)
            if length > self.max_bytes:
                body = error_body(f"the request body is {length} bytes, over this server's limit of {self.max_bytes} "
                                  f"bytes (--max-request-bytes)", "invalid_request_error", code="request_too_large")
                return await send_error(send, 413, body)
        seen, complete = 0, False
        tracked = _StartTracker(send)

        async def counted_receive() -> Message:
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle_timeout)
            except asyncio.TimeoutError:
                raise BodyStalled(self.idle_timeout) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, counted_receive, tracked)
        except (BodyTooLarge, BodyStalled) as exc:
            if not tracked.started:
                code = "request_too_large" if exc.status_code == 413 else "request_timeout"
                await send_error(send, exc.status_code, error_body(exc.detail, "invalid_request_error", code=code),
                                 [(b"connection", b"close")] if exc.status_code == 408 else [])


class ApiKey:
    """Every route under `protected` prefixes needs `Authorization: Bearer KEY` (401 otherwise); others stay open."""

    def __init__(self, app: ASGIApp, key: str,
                 protected: tuple[str, ...] = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")):
        self.app, self.key, self.protected = app, key.encode("utf-8"), protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.protected):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                why = "no API key given" if not given else "the API key is not valid"
                body = error_body(f"{why}: send the header 'Authorization: Bearer <key>' with the key the server "
                                  f"was started with (--api-key or OPENFLASH_API_KEY)", "invalid_request_error",
                                  code="invalid_api_key")
                return await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class RequestId:
    """Every response carries `x-request-id`: the client's own (a printable value of up to 128 characters, as vLLM
    and OpenAI's clients send it) or a new one, for matching a client's record with the server's log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = given if 0 < len(given) <= 128 and given.isascii() and given.decode().isprintable() else \
            uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ErrorGuard:
    """An exception no handler took becomes a logged 500 (if no response started) and the connection lives on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked = _StartTracker(send)
        try:
            await self.app(scope, receive, tracked)
        except (BodyTooLarge, BodyStalled):
            raise  # BodyLimit, outside this guard, answers it
        except Exception as exc:
            log.exception("unhandled error in %s", scope.get("path"))
            if not tracked.started:
                await send_error(send, 500, error_body(f"internal error: {type(exc).__name__}: {exc}",
                                                       "server_error"))
