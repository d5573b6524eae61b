"""The FastAPI app: OpenAI-compatible endpoints over the scheduler.

    POST /v1/chat/completions   chat template applied; streaming as OpenAI does it (SSE)
    POST /v1/completions        text or token-id prompt
    GET  /v1/models, /health, /metrics (Prometheus text)

Every non-streamed response carries `usage` and a `speculative` object (tau, drafted and accepted
tokens, acceptance per depth, fallback switches); a stream carries both in its last chunk.
With `api_key`, every route but /health needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import Engine
from ..decode.fallback import DriftMonitor
from ..decode.tree import TreeShape
from ..decode.lookup import LookupSettings
from ..errors import AnchorspecError
from ..metrics import GenerationStats
from . import protocol
from .metrics import ServerMetrics
from .protocol import APIError, ChatRequest, CompletionRequest
from .scheduler import Handle, Scheduler

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: far above any prompt that fits a small model's context


class TextStream:
    """Incremental detokenization: decode everything so far, emit what is new. A trailing
    replacement character means a multi-byte character is still incomplete, so it is held back."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta, self.sent = text[len(self.sent):], text
        return delta


def speculative_summary(stats: GenerationStats, switches: int) -> dict:
    """`enabled`: this request verified at least one draft, a drafter's or a copied chain (a request the drift
    fallback kept plain did not, even with a drafter loaded; a plain server's never do); `tau` is None then, as
    for plain decoding."""
    speculated = stats.verify_steps > 0
    return {"enabled": speculated, "tau": round(stats.tau, 4) if speculated else None,
            "verify_steps": stats.verify_steps,
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "acceptance_per_depth": [round(x, 4) for x in stats.acceptance_per_depth],
            "fallback_switches": switches}


def usage(stats: GenerationStats, completion_tokens: int) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": stats.prompt_tokens + completion_tokens}


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
               max_tokens_limit: int | None = None, monitor: DriftMonitor | None = None,
               shape: TreeShape | None = None, max_running: int = 16,
               lookup: LookupSettings | None = None, shapes: tuple[TreeShape, ...] | None = None) -> FastAPI:
    """`shape`: the draft shape (None: the default tree); `shapes`: the shapes each round chooses among by its row
    count, `shape` among them (Scheduler; None: `shape` alone)."""
    target = engine.target
    context = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
    limit = max_tokens_limit or min(context, 1 << 16)
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, metrics, monitor, shape, max_running=max_running, lookup=lookup, shapes=shapes)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        await asyncio.to_thread(scheduler.ready.wait)  # calibration runs before the first request
        yield
        scheduler.stop()

    app = FastAPI(title="anchorspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    # --- errors: always OpenAI's shape ----------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.to_dict(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), type="invalid_request_error",
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.to_dict(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        err = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(err.to_dict(), status_code=500)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None

    # --- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "running": scheduler.running_count}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "anchorspec"}]}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        authorize(request)
        req = protocol.parse(ChatRequest, await read_json(request))
        protocol.check_model(req, model_name)
        try:
            ids = engine.encode_chat(protocol.message_dicts(req))
        except AnchorspecError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return await run(request, protocol.make_job(req, ids, context, limit), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = protocol.parse(CompletionRequest, await read_json(request))
        protocol.check_model(req, model_name)
        prompt = protocol.single_prompt(req)
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
            ids = engine.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
        if any(not 0 <= t < target.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must lie in 0..{target.vocab_size - 1}", param="prompt")
        return await run(request, protocol.make_job(req, ids, context, limit), chat=False)

    async def run(request: Request, job: protocol.Job, chat: bool):
        try:
            handle = scheduler.submit(job.prompt_ids, job.max_tokens, job.temperature, job.top_p, job.seed)
        except AnchorspecError as exc:
            raise APIError(400, str(exc)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if job.stream:
            return StreamingResponse(stream(handle, rid, chat, job.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, handle, rid, chat)

    def envelope(rid: str, chat: bool, choices: list, chunk: bool = False, **extra) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": choices, **extra}

    async def collect(request: Request, handle: Handle, rid: str, chat: bool):
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(handle.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # nobody to answer: free the sequence now
                        handle.cancel()
                        return Response(status_code=499)
                    continue
                if kind == "error":
                    raise APIError(500, payload, type="server_error")
                if kind == "done":
                    break
            res = payload
            text = engine.tokenizer.decode(res.token_ids, skip_special_tokens=True) if engine.tokenizer else ""
            choice = {"index": 0, "finish_reason": res.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return envelope(rid, chat, [choice], usage=usage(res.stats, len(res.token_ids)),
                            speculative=speculative_summary(res.stats, handle.switches))
        finally:
            handle.cancel()  # no-op once finished; frees the sequence if this task was cancelled

    async def stream(handle: Handle, rid: str, chat: bool, include_usage: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(delta: str | None, finish=None, role=False, **extra) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return sse(envelope(rid, chat, [choice], chunk=True, **extra))

        text = TextStream(engine.tokenizer)
        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                kind, payload = await handle.queue.get()
                if kind == "tokens":
                    delta = text.push(payload) if engine.tokenizer else ""
                    if delta:
                        yield chunk(delta)
                elif kind == "error":
                    yield sse(APIError(500, payload, type="server_error").to_dict())
                    break
                else:
                    res = payload
                    spec = speculative_summary(res.stats, handle.switches)
                    tail = text.finish() if engine.tokenizer else ""
                    if tail:
                        yield chunk(tail)
                    yield chunk(None, finish=res.finish_reason, speculative=spec)
                    if include_usage:
                        yield sse(envelope(rid, chat, [], chunk=True, usage=usage(res.stats, len(res.token_ids)),
                                           speculative=spec))
                    break
            yield "data: [DONE]\n\n"
        finally:
            handle.cancel()  # client gone mid-stream (or done): free the sequence at once

    return app
