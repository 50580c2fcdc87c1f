"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) and `openflash serve`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events, or one JSON body; both
report `usage`; log-probabilities of sampled and, with echo, prompt tokens; `response_format` JSON through a
grammar, serve/grammar.py), GET /v1/models (and /v1/models/{id}), GET /health, GET /metrics (Prometheus), POST
/tokenize, POST /detokenize, GET /tokenizer_info (vLLM's endpoints, which lm-eval's remote tokenizer reads). Every
response carries an `x-request-id` header (the client's, or a new one).

The engine runs its own thread (engine/engine.py); a request handler submits one engine request per choice and
waits on an asyncio queue that the engine thread feeds (loop.call_soon_threadsafe). A client that disconnects
(closes a stream, or drops a pending non-streaming request) cancels its engine requests, which frees their state
at the next engine step. Shutdown stops intake, lets running requests finish for a while, then aborts the rest.
A chat choice that must call a tool after its reasoning (tool_choice required / named in thinking mode) runs as
two engine requests: the first stops at `</think>`, the second continues from the forced start of the call.

Errors are OpenAI-style bodies (serve/errors.py): 400 for anything wrong with a request's content, as OpenAI and
vLLM answer: malformed JSON or JSON nested too deeply, an unknown or unsupported field (named), an invalid value
(named), a prompt the model cannot take (empty, token ids outside the vocabulary, longer than the context: code
context_length_exceeded, refused before tokenizing where the tokenizer allows a bound), a chat request its template
cannot (malformed tools, tool turns, reasoning effort; serve/chat.py), a schema that does not compile; 401 without
the API key, 404 unknown model or route, 408 a body that stalls, 413 a body over the size limit, 429 queue full,
503 shutting down or an Engram tier that cannot be read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from openflash.chat.conversation import ChatOptions
from openflash.engine.engine import LLMEngine
from openflash.engine.prompt import PromptError
from openflash.engine.request import ERROR, EngineStoppedError, QueueFullError, RequestOutput
from openflash.engine.sampling import SamplingParams
from openflash.errors import RequestError
from openflash.serve import metrics as prom
from openflash.serve.chat import ChatFormat, ChatReply
from openflash.serve.errors import APIError, engine_failure, field_error, http_error, prompt_error, validation_error
from openflash.serve.grammar import Grammar, GrammarCompiler
from openflash.serve.guards import ApiKey, BodyLimit, ErrorGuard, RequestId, clip
from openflash.serve.images import ImagePolicy
from openflash.serve.jobs import Choice, Job
from openflash.serve.logprobs import TokenNames, chat_choice_logprobs, completion_choice_logprobs
from openflash.serve.prompts import ServerPrompts
from openflash.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from openflash.serve.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                       ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionResponse,
                                       DeltaMessage, DetokenizeResponse, ModelCard, ModelList, TokenizeResponse,
                                       TokenizerInfo)

log = logging.getLogger("openflash.serve")


@dataclass
class ServerConfig:
    model_name: str
    chat_format: ChatFormat
    thinking_default: bool = False  # chat requests that do not say: thinking mode on or off
    default_max_tokens: int = 256  # chat requests without max_tokens: this, capped by the context left
    drain_timeout: float = 10.0  # seconds running requests get to finish at shutdown
    disconnect_poll: float = 0.25  # seconds between client-disconnect checks of non-streaming requests
    max_request_bytes: int = 32 << 20  # larger bodies get a 413 before they are read (images come inline)
    api_key: str | None = None  # when set, /v1, /tokenize and /detokenize need "Authorization: Bearer <key>"
    body_timeout: float = 30.0  # seconds a request body may stall between its bytes before a 408
    images: ImagePolicy = field(default_factory=ImagePolicy)  # image content parts: sources and limits


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenflashServer:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.max_context = engine.config.max_context
        self.prompts = ServerPrompts(tokenizer, engine.prompt_intake, config.chat_format, config.thinking_default,
                                     config.images, engine.cfg)  # serve/prompts.py
        self.grammars = GrammarCompiler(tokenizer, engine.cfg.vocab_size, engine.cfg.eos_token_id)

    # ---- request -> engine ----------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for a name not served."""
        if name is None or name == self.config.model_name:
            return None
        if name in self.engine.adapter_names:
            return name
        served = [self.config.model_name] + self.engine.adapter_names
        raise APIError(404, f"model {clip(name)} does not exist; this server serves {', '.join(map(repr, served))}",
                       param="model", code="model_not_found")

    def card(self, adapter: str | None) -> ModelCard:
        """/v1/models' entry of the base model or of a served adapter (its parent: the base)."""
        if adapter is None:
            return ModelCard(id=self.config.model_name, max_model_len=self.max_context)
        return ModelCard(id=adapter, max_model_len=self.max_context, parent=self.config.model_name)

    def sampling(self, body: Any, max_tokens: int, choice: int, **logprobs: Any) -> SamplingParams:
        """A choice's sampling parameters from the request's fields (logprobs: the endpoint's log-prob fields)."""
        vocab = self.engine.cfg.vocab_size
        for field_name, ids in (("stop_token_ids", body.stop_token_ids or ()),
                                ("logit_bias", [int(k) for k in body.logit_bias or ()])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{field_name}: token id {clip(bad)} is outside the model's vocabulary "
                                    f"(0..{vocab - 1})", param=field_name, code="invalid_token")
        seed = None if body.seed is None else body.seed + choice
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        params = SamplingParams(temperature=1.0 if body.temperature is None else float(body.temperature),
                                top_p=1.0 if body.top_p is None else float(body.top_p), top_k=top_k,
                                min_p=body.min_p or 0.0, max_tokens=max_tokens, seed=seed, stop=body.stop_list(),
                                stop_token_ids=tuple(body.stop_token_ids or ()),
                                include_stop_str_in_output=body.include_stop_str_in_output,
                                presence_penalty=body.presence_penalty or 0.0,
                                frequency_penalty=body.frequency_penalty or 0.0,
                                repetition_penalty=body.repetition_penalty or 1.0,
                                logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
                                min_tokens=body.min_tokens, **logprobs)
        try:
            return params.validate()
        except RequestError as exc:
            raise field_error(exc, body) from None

    def submit(self, job: Job, body: Any, ids: list[int], params: SamplingParams, param: str, prefix: str = "",
               **chat: Any) -> None:
        try:
            job.submit(ids, params, body.ignore_eos, prefix, **chat)
        except PromptError as exc:
            raise prompt_error(exc, body) from None
        except QueueFullError as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full") from None
        except EngineStoppedError as exc:
            raise APIError(503, str(exc), "server_error", code="shutting_down") from None
        except RequestError as exc:  # a field, or the prompt itself
            if exc.param is not None:
                raise field_error(exc, body) from None
            raise APIError(400, str(exc), param=param) from None

    @staticmethod
    async def off_loop(fn: Any, *args: Any) -> Any:
        """Run tokenization (or another CPU-bound step) in a worker thread, not on the event loop."""
        return await asyncio.to_thread(fn, *args)

    # ---- waiting for results ------------------------------------------------------------------------------------
    async def collect(self, job: Job, request: Request) -> None:
        """Wait until every choice finished; cancel them if the client goes away."""
        poll = self.config.disconnect_poll
        next_check = time.monotonic() + poll
        try:
            while job.pending:
                try:
                    index, out = await asyncio.wait_for(job.queue.get(), timeout=poll)
                    job.apply(index, out)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + poll
                    if await request.is_disconnected():
                        log.info("client went away; cancelling %d request(s)", job.pending)
                        job.abort_unfinished()
                        return
        finally:
            if job.pending:
                job.abort_unfinished()

    async def events(self, job: Job, chunk_of, usage_chunk) -> AsyncIterator[str]:
        """SSE stream: one chunk per output with new text or a finish, then usage (if asked), then [DONE]."""
        try:
            while job.pending:
                index, out = await job.queue.get()
                choice = job.apply(index, out)
                if choice.finish_reason == ERROR:
                    yield _sse(engine_failure(choice.error, choice.unavailable).body().model_dump_json())
                    continue
                chunk = chunk_of(choice, out)
                if chunk is not None:
                    yield _sse(chunk)
            if usage_chunk is not None:
                yield _sse(usage_chunk())
            yield _sse("[DONE]")
        finally:  # normal end, or the client closed the stream (the generator is cancelled)
            if job.pending:
                log.info("stream closed early; cancelling %d request(s)", job.pending)
                job.abort_unfinished()

    # ---- endpoints --------------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        adapter = self.check_model(body.model)
        prompts = await self.off_loop(self.prompts.completion, body)
        for ids in prompts:
            self.prompts.check_ids(ids, "prompt")
        job, rid = Job(self.engine, adapter), f"cmpl-{uuid.uuid4().hex}"
        scored = body.logprobs is not None
        # Echo scores the prompt (lm-eval's log-likelihoods); max_tokens 0 asks for nothing else.
        max_tokens = body.requested_max_tokens()
        prompt_logprobs = (body.logprobs or 0) if body.echo and (scored or max_tokens == 0) else None
        try:
            for ids in prompts:
                prefix = self.tokenizer.decode(ids) if body.echo else ""
                for _ in range(body.n):
                    params = self.sampling(body, max_tokens, len(job.choices), logprobs=scored,
                                           top_logprobs=body.logprobs or 0,
                                           prompt_logprobs=prompt_logprobs)
                    self.submit(job, body, ids, params, "prompt", prefix)
        except APIError:
            job.abort_unfinished()
            raise
        created, name = int(time.time()), adapter or self.config.model_name
        names = TokenNames(self.tokenizer, body.return_tokens_as_token_ids)

        def logprobs_of(choice: Choice, streamed: bool) -> CompletionLogprobs | None:
            return completion_choice_logprobs(choice, names, streamed) if scored else None

        def chunk_of(choice: Choice, out: RequestOutput) -> str | None:
            if not (out.text or out.finished):
                return None
            text = out.text
            if choice.echo_pending:
                choice.echo_pending, text = False, choice.prefix + text
            ch = CompletionChoice(index=choice.index, text=text, finish_reason=choice.finish_reason,
                                  logprobs=logprobs_of(choice, streamed=True))
            return CompletionResponse(id=rid, created=created, model=name, choices=[ch]).model_dump_json()

        def full() -> CompletionResponse:
            choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                        logprobs=logprobs_of(c, streamed=False)) for c in job.choices]
            return CompletionResponse(id=rid, created=created, model=name, choices=choices, usage=job.usage(body.n))

        usage_chunk = lambda: CompletionResponse(id=rid, created=created, model=name, choices=[],  # noqa: E731
                                                 usage=job.usage(body.n)).model_dump_json()
        return await self.reply(job, body, request, chunk_of, usage_chunk, full)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        adapter = self.check_model(body.model)
        options = self.prompts.chat_options(body)
        grammar = self.structured(body, options)
        prompt = await self.off_loop(self.prompts.chat, body.messages, options)
        ids = prompt.ids
        self.prompts.check_ids(ids, "messages")
        calls = None if prompt.call_grammar is None else self.compiled(self.grammars.lark, prompt.call_grammar,
                                                                       "tools")
        requested = body.requested_max_tokens()
        max_tokens = requested if requested is not None else \
            max(1, min(self.config.default_max_tokens, self.max_context - len(ids)))
        job, rid = Job(self.engine, adapter), f"chatcmpl-{uuid.uuid4().hex}"
        fmt = self.config.chat_format
        try:
            for _ in range(body.n):
                params = self.sampling(body, max_tokens, len(job.choices), logprobs=body.logprobs,
                                       top_logprobs=body.top_logprobs or 0)
                parser, reply = fmt.parser(options), ChatReply()
                reply.add(parser.feed(prompt.forced))  # the forced text opens a call: nothing final yet
                constraint = later = None
                if grammar is not None:  # the answer's format
                    constraint = self.grammar_state(grammar, fmt.answer_after(options))
                elif calls is not None:  # a forced call's arguments: after the forced text, now or after reasoning
                    state = self.grammar_state(calls, None)
                    constraint, later = (state, None) if prompt.deferred is None else (None, state)
                self.submit(job, body, ids, params, "messages", parser=parser, reply=reply,
                            continuation=prompt.deferred, images=prompt.images, constraint=constraint,
                            continuation_constraint=later)
        except APIError:
            job.abort_unfinished()
            raise
        created, name = int(time.time()), adapter or self.config.model_name
        started: set[int] = set()
        names = TokenNames(self.tokenizer, body.return_tokens_as_token_ids)

        def logprobs_of(choice: Choice, streamed: bool) -> ChatLogprobs | None:
            return chat_choice_logprobs(choice, names, streamed) if body.logprobs else None

        def chunk_of(choice: Choice, out: RequestOutput) -> str | None:
            if choice.delta is None and not choice.done:
                return None
            delta = choice.delta or DeltaMessage()
            if choice.index not in started:
                started.add(choice.index)
                delta.role = "assistant"
            ch = ChatChunkChoice(index=choice.index, delta=delta, finish_reason=choice.finish_reason,
                                 logprobs=logprobs_of(choice, streamed=True))
            return ChatCompletionChunk(id=rid, created=created, model=name, choices=[ch]).model_dump_json()

        def full() -> ChatCompletionResponse:
            choices = [ChatChoice(index=c.index, message=c.reply.message(), finish_reason=c.finish_reason,
                                  logprobs=logprobs_of(c, streamed=False)) for c in job.choices]
            return ChatCompletionResponse(id=rid, created=created, model=name, choices=choices,
                                          usage=job.usage(body.n))

        usage_chunk = lambda: ChatCompletionChunk(id=rid, created=created, model=name, choices=[],  # noqa: E731
                                                  usage=job.usage(body.n)).model_dump_json()
        return await self.reply(job, body, request, chunk_of, usage_chunk, full)

    def structured(self, body: ChatCompletionRequest, options: ChatOptions) -> str | None:
        """The grammar the request's response_format asks for (None: free text); a 400 naming the field for one
        that cannot be served."""
        if body.response_format is None or body.response_format.type == "text":
            return None
        if options.tools_on and options.tool_choice in ("required", "named"):
            raise APIError(400, "response_format: a JSON reply and a forced tool call exclude each other "
                                "(tool_choice required / named)", param="response_format")
        return self.compiled(self.grammars.grammar, body.response_format)

    def grammar_state(self, grammar: str, after_token: int | None) -> Grammar:
        return self.compiled(self.grammars.start, grammar, after_token)

    @staticmethod
    def compiled(step: Any, *args: Any) -> Any:
        """A grammar step (serve/grammar.py) whose RequestError is the request's 400, naming the field."""
        try:
            return step(*args)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None

    async def reply(self, job: Job, body: Any, request: Request, chunk_of: Any, usage_chunk: Any,
                    full: Any) -> Any:
        """Stream the job as server-sent events, or wait for it and return the full response."""
        if body.stream:
            return StreamingResponse(self.events(job, chunk_of, usage_chunk if body.include_usage() else None),
                                     media_type="text/event-stream")
        await self.collect(job, request)
        if (err := job.failure()) is not None:
            raise err
        return full()

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        image_tokens = 0
        if body.messages is not None:
            prompt = await self.off_loop(self.prompts.chat, body.messages, ChatOptions(self.config.thinking_default))
            ids, image_tokens = prompt.ids, sum(p.image.num_tokens for p in prompt.images)
        else:
            ids = await self.off_loop(self.prompts.encode, body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_context,
                                image_tokens=image_tokens)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in body.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise APIError(400, f"token id {clip(bad)} is outside the tokenizer's vocabulary (0..{size - 1})",
                           param="tokens", code="invalid_token")
        return DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens))

    def tokenizer_info(self) -> TokenizerInfo:
        cfg = self.engine.cfg
        name = lambda token_id: self.tokenizer.id_to_token(token_id)  # noqa: E731
        return TokenizerInfo(eos_token=name(cfg.eos_token_id), bos_token=name(cfg.bos_token_id),
                             pad_token=name(cfg.pad_token_id), model_max_length=self.max_context,
                             vocab_size=cfg.vocab_size)


# ---------------------------------------------------------------------------------------------------------------------
# The FastAPI application


def build_app(engine: LLMEngine, tokenizer: Tokenizer, config: ServerConfig, *, manage_engine: bool = True) -> FastAPI:
    """The app; with manage_engine it starts the engine thread at startup and shuts the engine down at exit.

    Guards, outermost first: the body limit, the API key (when configured), then the last-resort error handler."""
    server = OpenflashServer(engine, tokenizer, config)
    registry = prom.metrics_registry(engine, config.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, config.drain_timeout)

    # With an API key the schema and its pages are not served at all (a browser page cannot send the key).
    docs = {} if not config.api_key else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="openflash", lifespan=lifespan, **docs)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, await request.body()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error(exc.status_code, str(exc.detail)).response()

    # Added last = outermost. ErrorGuard sits inside the others so that their refusals never reach it.
    app.add_middleware(ErrorGuard)
    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, idle_timeout=config.body_timeout)
    app.add_middleware(RequestId)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[server.card(None)] + [server.card(a) for a in engine.adapter_names])

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> ModelCard:
        return server.card(server.check_model(name))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if (problem := engine.problem()) is not None:  # the details (file paths) go to the log only
            log.error("health: degraded: %s", problem)
            return JSONResponse({"status": "degraded", "reason": "an Engram table cannot be read"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prom.exposition(registry), media_type=prom.CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return server.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> TokenizerInfo:
        return server.tokenizer_info()

    return app

