"""OpenAI-compatible HTTP face of the frontend (aiohttp, on the gRPC server's event loop).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (SSE when `stream` is true,
with `stream_options.include_usage`), `GET /v1/models`, `POST /tokenize`, `POST /detokenize`
and `GET /health`.

One pipeline: a body becomes a `GenerateRequest` (`openai_wire`; one per prompt of a
`/v1/completions` batch, run together and merged) and runs through the gRPC servicer's own
`Generate` / `Stream` with an `HttpCallContext` standing in for the gRPC call context, so validation, request IDs, tokenization, fan-out, Utility ABORT (by the
`X-Request-Id` the client sent, or the one the reply's `id` carries), metrics and request
logs are those of gRPC. A servicer abort becomes OpenAI's error object with the matching HTTP
status (`openai_wire.http_error`); an error after an SSE stream has started is sent as a
last `data: {"error": ...}` event before `data: [DONE]`.

Security is the gRPC port's: the same TLS (and mTLS) files and bearer tokens; `/health` is
exempt from tokens as grpc.health.v1 is (probes cannot send one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import structlog
from aiohttp import web

from tandem.frontend import openai_wire
from tandem.frontend.request_builder import RequestBuilder
from tandem.frontend.server import FrontendServicer
from tandem.frontend.tokenize_pool import TokenizerBusy
from tandem.proto_wire import InvalidRequest, check_prompt_token_ids
from tandem.security import SecurityOptions, bearer_denial

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024  # as the gRPC port's message limit
AUTH_EXEMPT_PATHS = frozenset({"/health"})


class HttpCallContext:
    """The part of `grpc.aio.ServicerContext` the Frontend servicer uses, for one HTTP request.

    `abort` records the status and raises `grpc.aio.AbortError`, as gRPC's does, so the
    servicer's control flow and its outcome accounting (`request_scope.grpc_outcome` reads
    `code()`) are unchanged. HTTP requests carry no deadline. `span_name` and `span_attributes`
    name the request's span after the HTTP route (`POST /v1/chat/completions`) rather than the
    servicer method it runs; its `traceparent` header is read like gRPC metadata."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._metadata = tuple((k.lower(), v) for k, v in request.headers.items())
        self.span_name = f"{request.method} {request.path}"
        self.span_attributes = {"http.request.method": request.method, "http.route": request.path}
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing_metadata: tuple = ()

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def auth_context(self) -> dict:
        return {}

    def peer(self) -> str:
        return f"http:{self._request.remote}"


def _error(code: grpc.StatusCode, message: str, headers: dict | None = None) -> web.Response:
    status, body = openai_wire.http_error(code, message)
    return web.json_response(body, status=status, headers=headers)


def _context_error(ctx: HttpCallContext) -> web.Response:
    headers = {k: v for k, v in ctx.trailing_metadata if k == "retry-after"} or None
    return _error(ctx.code() or grpc.StatusCode.UNKNOWN, ctx.details(), headers)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _all_or_first_refusal(coros: list) -> list | web.Response:
    """Runs `coros` together: their results in order, or the first `web.Response` one returns (a
    refusal), the others cancelled then. One runs on its own, without a task."""
    if len(coros) == 1:
        result = await coros[0]
        return result if isinstance(result, web.Response) else [result]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        for done in asyncio.as_completed(tasks):
            result = await done
            if isinstance(result, web.Response):
                return result
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first_message(messages, ctx: HttpCallContext):
    """A stream's first message, or the error response of a request refused before it."""
    try:
        return await messages.__anext__()
    except grpc.aio.AbortError:
        return _context_error(ctx)


async def _interleave(streams: list, firsts: list):
    """`(i, message)` of every stream as messages come, each stream's `firsts[i]` (read already)
    first; a stream's `grpc.aio.AbortError` ends them all and is raised. One stream is read
    directly."""
    if len(streams) == 1:
        yield 0, firsts[0]
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()
    for i, first in enumerate(firsts):
        queue.put_nowait((i, first, None))

    async def pump(i: int) -> None:
        try:
            async for msg in streams[i]:
                await queue.put((i, msg, None))
        except grpc.aio.AbortError as exc:
            await queue.put((i, None, exc))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        while running:
            i, msg, error = await queue.get()
            if error is not None:
                raise error
            if msg is None:
                running -= 1
            else:
                yield i, msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIHttpApp:
    """The aiohttp application over one `FrontendServicer`."""

    def __init__(self, servicer: FrontendServicer, security: SecurityOptions) -> None:
        self.servicer = servicer
        self.tokens = security.tokens + security.admin_tokens  # an admin token is also a client token
        self.created = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/health", self.health),
        ])

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path not in AUTH_EXEMPT_PATHS:
            denial = bearer_denial(self.tokens, ((k.lower(), v) for k, v in request.headers.items()))
            if denial is not None:
                log.warning("auth_rejected", method=f"HTTP {request.path}", peer=request.remote, code=denial.name)
                text = "missing bearer token" if denial == grpc.StatusCode.UNAUTHENTICATED else "invalid bearer token"
                return _error(denial, text)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own answers (404, 405, 413) in OpenAI's shape
            status, body = exc.status, {"error": {"message": exc.reason, "type": "invalid_request_error",
                                                  "param": None, "code": None}}
            return web.json_response(body, status=status)

    def _not_ready(self) -> web.Response | None:
        if self.servicer.builder is None:
            return _error(grpc.StatusCode.UNAVAILABLE, "frontend is starting")
        return None

    @staticmethod
    async def _json(request: web.Request):
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest("body", f"not valid JSON ({exc})") from None

    # -- generation ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._json(request)
            reqs = [openai_wire.chat_request(body)] if chat else openai_wire.completion_requests(body)
        except InvalidRequest as exc:
            return _error(grpc.StatusCode[exc.status], str(exc))
        request_id = request.headers.get("X-Request-Id")
        if request_id:
            for i, req in enumerate(reqs):  # a batch's prompts are requests of their own: `<id>-<i>`
                req.request_id = request_id if len(reqs) == 1 else f"{request_id}-{i}"
        created = int(time.time())
        if body.get("stream"):
            return await self._stream(request, reqs, body, chat, created)
        replies = await _all_or_first_refusal([self._reply(request, req, body, chat, created) for req in reqs])
        if isinstance(replies, web.Response):
            return replies
        if chat:
            return web.json_response(replies[0][0])
        n = RequestBuilder.num_choices(reqs[0])
        usage = openai_wire.total_usage(u for _, u in replies)
        return web.json_response(openai_wire.merge_completion_bodies([b for b, _ in replies], n, usage))

    async def _reply(self, request: web.Request, req, body: dict, chat: bool, created: int):
        """One request's whole reply as OpenAI's JSON and its usage, or the error response that
        refused it."""
        ctx = HttpCallContext(request)
        try:
            msg = await self.servicer.Generate(req, ctx)
        except grpc.aio.AbortError:
            return _context_error(ctx)
        if chat:
            return openai_wire.chat_response(msg, created), msg.usage
        try:
            echo = await self._echo(body, req, msg)
        except TokenizerBusy as exc:
            return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later", {"Retry-After": "1"})
        return openai_wire.completion_response(msg, created, echo), msg.usage

    async def _echo(self, body: dict, req, msg) -> openai_wire.Echo | None:
        """With `echo`, the prompt's text (the one sent, or the token ids' text) and its first
        token's text, decoded on the tokenizer pool."""
        if not body.get("echo"):
            return None
        ids = list(msg.prompt_token_ids)
        whole = req.prompt and not req.HasField("truncate_prompt_tokens")
        text = req.prompt if whole else await self.servicer.detokenize(ids)
        return openai_wire.Echo.of(body, text, await self.servicer.detokenize(ids[:1]))

    async def _stream(self, request, reqs: list, body: dict, chat: bool, created: int):
        """SSE over the call's requests (several for a batch of prompts), their chunks in the
        order they come; choice indices and the closing usage are the call's."""
        n = RequestBuilder.num_choices(reqs[0])
        translators = [openai_wire.StreamTranslator(chat, "", created, openai_wire.wants_usage_in_stream(body),
                                                    req.sampling.HasField("prompt_logprobs"), i * n)
                       for i, req in enumerate(reqs)]
        contexts = [HttpCallContext(request) for _ in reqs]
        streams = [self.servicer.Stream(req, ctx) for req, ctx in zip(reqs, contexts)]
        try:
            # Every request's first message before the headers: a request refused before generating
            # gets its HTTP status rather than a 200 stream with an error event.
            firsts = await _all_or_first_refusal([_first_message(s, ctx) for s, ctx in zip(streams, contexts)])
            if isinstance(firsts, web.Response):
                return firsts
            for translator in translators:  # one id for the call's chunks: the first request's
                translator.request_id = firsts[0].request_id
                # Every chunk names the served model (the final messages do), also when the body
                # named none or an alias.
                translator.model = self.servicer.builder.served_model_name
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            failed = None
            try:
                # Closed on every way out (a client gone mid-write too): its readers stop before
                # the streams they read are closed below.
                async with contextlib.aclosing(_interleave(streams, firsts)) as messages:
                    async for i, msg in messages:
                        for chunk in translators[i].chunks(msg):
                            await response.write(_sse(chunk))
            except grpc.aio.AbortError:
                failed = next((ctx for ctx in contexts if ctx.code() is not None), contexts[0])
            for translator in translators:  # chunks still held for the prompt logprobs
                for chunk in translator.flush():
                    await response.write(_sse(chunk))
            if failed is not None:
                await response.write(_sse(openai_wire.http_error(failed.code() or grpc.StatusCode.UNKNOWN,
                                                                 failed.details())[1]))
            elif translators[0].include_usage:
                usage = openai_wire.total_usage(t.usage for t in translators if t.usage is not None)
                await response.write(_sse(translators[0].usage_chunk(usage)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for stream in streams:
                await stream.aclose()  # a client gone mid-stream: the servicer ends the engine calls

    # -- everything else -------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        builder = self.servicer.builder
        return web.json_response({"object": "list", "data": [{
            "id": builder.served_model_name, "object": "model", "created": self.created, "owned_by": "tandem",
            "max_model_len": builder.limits.max_model_len,
        }]})

    async def tokenize(self, request: web.Request) -> web.Response:
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        try:
            req = openai_wire.tokenize_request(await self._json(request))
            ids = await self.servicer.tokenize_prompt(req)
        except InvalidRequest as exc:
            return _error(grpc.StatusCode[exc.status], str(exc))
        except TokenizerBusy as exc:
            return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later", {"Retry-After": "1"})
        return web.json_response({"count": len(ids), "max_model_len": self.servicer.builder.limits.max_model_len,
                                  "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        builder = self.servicer.builder
        try:
            ids = openai_wire.detokenize_ids(await self._json(request))
            check_prompt_token_ids("tokens", ids, builder.limits.vocab_size)
            text = await self.servicer.detokenize(ids)
        except InvalidRequest as exc:
            return _error(grpc.StatusCode[exc.status], str(exc))
        except TokenizerBusy as exc:
            return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later", {"Retry-After": "1"})
        return web.json_response({"prompt": text})

    async def health(self, request: web.Request) -> web.Response:
        ready = self.servicer.ready()
        return web.json_response({"status": "SERVING" if ready else "NOT_SERVING"}, status=200 if ready else 503)


async def start_http(servicer: FrontendServicer, host: str, port: int, security: SecurityOptions,
                     reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Listens on `host:port` (TLS when `security` has a server certificate); returns the runner
    (`await runner.cleanup()` stops it) and the bound port. `reuse_port`: several frontend
    workers share the port, as they share the gRPC one."""
    # handler_cancellation: a client that hangs up cancels its handler, which ends its engine calls.
    runner = web.AppRunner(OpenAIHttpApp(servicer, security).app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=security.server_ssl_context(), reuse_port=reuse_port or None)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if site._server is not None and site._server.sockets else port
    return runner, bound
