"""The OpenAI-compatible HTTP server over a RolloutEngine or a fleet: completions, chat, streaming, metrics, RL admin.

The web stack is FastAPI on uvicorn (the ``serve`` extra): the ASGI pair vLLM and SGLang serve
their OpenAI endpoints with, maintained, with server-sent events and graceful shutdown built in.
Every request becomes one ``submit`` per prompt (a group of ``n`` samples) and joins the running
batch at the next step; the handlers await their handles, so thousands of requests can be open at
once on one event loop while the engine's serving loop runs in its own thread. What is served is a
``ServingBackend`` (backend.py): one ``RolloutEngine``, or a ``fleet.Fleet`` whose replicas each
run their own batch -- the handlers cannot tell them apart.

Stop strings are matched on each sample's decoded text as it grows: the first match aborts that
sample at the next step and cuts its text there (finish_reason ``stop``). Text comes from the
engine's tokenizer; ``return_token_ids`` hands back the ids as sampled, which is what a trainer
should score (no re-tokenisation).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from splash_rollout.serve.metrics import RequestLatency
from splash_rollout.serve.protocol import (BadRequest, Sampling, chat_logprobs, check_model, completion_logprobs,
                                           new_id, now, parse_messages, parse_prompts, parse_sampling, to_json_body,
                                           usage)


@dataclass(frozen=True)
class ServeConfig:
    """The ``serve`` group: where the server listens and what it answers."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    """The ``model`` clients name (None: the engine's model: its preset name or checkpoint folder)."""
    max_tokens: int = 16
    """``max_tokens`` of a request that gives none (OpenAI's default for completions)."""
    api_key: str | None = None
    """When set, every /v1 and /admin request must carry ``Authorization: Bearer <api_key>``."""
    drain_timeout_s: float = 30.0
    """On SIGINT / SIGTERM: how long requests in flight may finish before they are aborted."""
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"serve.port: expected an integer in [0, 65535], got {self.port!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"serve.max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"serve.drain_timeout_s: expected >= 0 seconds, got {self.drain_timeout_s!r}")


class TextStream:
    """One sample's text as its tokens arrive, cut at the first stop string.

    Detokenized incrementally: each push decodes only the tokens from ``prefix`` on (the last ones
    already decoded, for the context a tokenizer's spacing needs) and takes what they add beyond the
    text of ``ids[prefix:read]``; a piece that ends inside a multi-byte character waits for the next
    token. With stop strings, the last ``len(longest stop) - 1`` characters are held back until the
    next piece shows they do not begin a stop string. Without stop strings and with no stream
    listening, nothing is decoded until the end (``finish``)."""

    def __init__(self, tokenizer, stop: list[str], incremental: bool) -> None:
        self.tokenizer, self.stop, self.incremental = tokenizer, stop, incremental or bool(stop)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        """The text decoded so far (cut before a stop string once one appeared)."""
        self.stopped = False
        self._sent = 0
        """Characters of ``text`` handed out."""
        self._prefix = self._read = 0
        self._hold = max((len(x) for x in stop), default=1) - 1

    def push(self, ids: list[int], logprobs: list[float]) -> str:
        """The text the new tokens add that can be shown now."""
        if self.stopped:
            return ""
        self.ids += ids
        self.logprobs += logprobs
        if not self.incremental:
            return ""
        self._decode()
        if self.stop:
            start = max(0, self._sent - self._hold)
            found = [i for i in (self.text.find(x, start) for x in self.stop) if i >= 0]
            if found:
                self.text, self.stopped = self.text[:min(found)], True
                return self._hand_out(len(self.text))
            return self._hand_out(len(self.text) - self._hold)
        return self._hand_out(len(self.text))

    def finish(self) -> str:
        """At the sample's end: the text not yet handed out (the held-back tail, a last partial character)."""
        if not self.incremental:
            self.text = self.tokenizer.decode(self.ids)
        elif not self.stopped:
            self._decode(final=True)
        return self._hand_out(len(self.text))

    def _decode(self, final: bool = False) -> None:
        shown = self.tokenizer.decode(self.ids[self._prefix:self._read])
        now = self.tokenizer.decode(self.ids[self._prefix:])
        if (now.endswith("\ufffd") and not final) or len(now) <= len(shown):
            return
        self.text += now[len(shown):]
        self._prefix, self._read = self._read, len(self.ids)

    def _hand_out(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent:upto], upto
        return piece

    def token_texts(self) -> list[str]:
        return [self.tokenizer.decode([t]) for t in self.ids]


class Server:
    """The handlers (FastAPI-free logic): what each endpoint does with a parsed body."""

    def __init__(self, backend, config: ServeConfig) -> None:
        self.backend, self.config = backend, config
        source = backend.config.model.source
        self.model_name = config.served_model_name or (source if isinstance(source, str) else backend.model_config.name)
        self.started = now()
        self.requests_total = {"ok": 0, "bad": 0, "error": 0}
        self.draining = False
        self.latency = RequestLatency()

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    # ---- requests ---------------------------------------------------------------------------------
    async def submit_all(self, prompts: list, sampling: Sampling) -> list:
        """One handle per prompt, each taken into the engine's queue (at the next step boundary) before
        this returns; a prompt the engine refuses aborts the others and names itself."""
        if self.draining:
            raise BadRequest("the server is shutting down", status=503, code="shutting_down")
        handles = []

        def refuse(i: int, e: Exception) -> BadRequest:
            for h in handles:
                h.abort()
            message = str(e).replace("prompts[0]", f"prompt[{i}]" if len(prompts) > 1 else "prompt", 1)
            return BadRequest(message, "prompt")

        for i, prompt in enumerate(prompts):
            try:
                handles.append(self.backend.submit(prompt, sampling.params))  # checks the input; no wait
            except (ValueError, TypeError) as e:
                raise refuse(i, e) from None
        for i, h in enumerate(handles):
            try:
                await h.wait_admitted()
            except ValueError as e:
                raise refuse(i, e) from None
        return handles

    async def _follow(self, handles: list, sampling: Sampling, started: float, on_delta=None) -> list[list[dict]]:
        """Every sample of every handle to its end, texts cut at stop strings (an aborted sample whose
        text stopped reads ``stop``); ``on_delta(choice, text, ids, logprobs, finish)`` sees the pieces.
        The request's latencies, from ``started`` (perf_counter), go to the metrics."""
        n = sampling.params.n
        first_token = [True]
        streams = [[TextStream(self.tokenizer, sampling.stop, incremental=on_delta is not None) for _ in range(n)]
                   for _ in handles]
        finish: list[list[str | None]] = [[None] * n for _ in handles]

        async def follow(i: int, handle) -> None:
            async for d in handle.stream():
                s = streams[i][d.sample]
                if s.stopped:
                    continue
                if first_token[0] and d.token_ids:
                    first_token[0] = False
                    self.latency.first_token(time.perf_counter() - started)
                text = s.push(d.token_ids, d.logprobs)
                if s.stopped:
                    finish[i][d.sample] = "stop"
                    handle.abort_sample(d.sample)
                elif d.finish_reason is not None:
                    finish[i][d.sample] = d.finish_reason
                if finish[i][d.sample] is not None:
                    text += s.finish()
                if on_delta is not None and (text or finish[i][d.sample] or d.token_ids):
                    await on_delta(i * n + d.sample, text, d.token_ids, d.logprobs, finish[i][d.sample])

        await asyncio.gather(*(follow(i, h) for i, h in enumerate(handles)))
        self.latency.finished(time.perf_counter() - started)
        return [[{"stream": streams[i][j], "finish_reason": finish[i][j] or "abort",
                  "prompt_ids": handles[i].prompt_ids} for j in range(n)] for i in range(len(handles))]

    async def completions(self, body: dict) -> dict | AsyncIterator[str]:
        started = time.perf_counter()
        check_model(body, self.model_name)
        sampling = parse_sampling(body, self.config.max_tokens, chat=False)
        handles = await self.submit_all(parse_prompts(body), sampling)
        if sampling.stream:
            return self._stream(handles, sampling, started, chat=False)
        out = await self._follow(handles, sampling, started)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, samples in enumerate(out):
            prompt_tokens += len(samples[0]["prompt_ids"])
            for j, s in enumerate(samples):
                stream = s["stream"]
                completion_tokens += len(stream.ids)
                choice = {"index": i * sampling.params.n + j, "text": stream.text, "finish_reason": s["finish_reason"],
                          "logprobs": completion_logprobs(stream.token_texts(), stream.logprobs)
                          if sampling.logprobs else None}
                if sampling.return_token_ids:
                    choice["token_ids"] = list(stream.ids)
                    choice["prompt_token_ids"] = list(s["prompt_ids"])
                choices.append(choice)
        response = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": self.model_name,
                    "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        if sampling.return_token_ids:
            response["prompt_token_ids"] = [list(samples[0]["prompt_ids"]) for samples in out]
            if len(out) == 1:
                response["prompt_token_ids"] = response["prompt_token_ids"][0]
        return response

    async def chat(self, body: dict) -> dict | AsyncIterator[str]:
        started = time.perf_counter()
        check_model(body, self.model_name)
        sampling = parse_sampling(body, self.config.max_tokens, chat=True)
        messages = parse_messages(body)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
        handles = await self.submit_all([ids], sampling)
        if sampling.stream:
            return self._stream(handles, sampling, started, chat=True)
        out = await self._follow(handles, sampling, started)
        choices = []
        for j, s in enumerate(out[0]):
            stream = s["stream"]
            choice = {"index": j, "message": {"role": "assistant", "content": stream.text},
                      "finish_reason": s["finish_reason"],
                      "logprobs": chat_logprobs(stream.token_texts(), stream.logprobs) if sampling.logprobs else None}
            if sampling.return_token_ids:
                choice["token_ids"] = list(stream.ids)
            choices.append(choice)
        response = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": self.model_name,
                    "choices": choices, "usage": usage(len(ids), sum(len(s["stream"].ids) for s in out[0]))}
        if sampling.return_token_ids:
            response["prompt_token_ids"] = list(ids)
        return response

    async def _stream(self, handles: list, sampling: Sampling, started: float, chat: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of a sample, then ``[DONE]``."""
        queue: asyncio.Queue = asyncio.Queue()
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def on_delta(index, text, ids, logprobs, finish):
            await queue.put((index, text, ids, logprobs, finish))

        async def run():
            try:
                await self._follow(handles, sampling, started, on_delta)
            finally:
                await queue.put(None)

        task = asyncio.ensure_future(run())
        role_sent = set()
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                index, text, ids, logprobs, finish = item
                if chat:
                    delta = {"content": text}
                    if index not in role_sent:
                        delta["role"] = "assistant"
                        role_sent.add(index)
                    choice = {"index": index, "delta": delta, "finish_reason": finish,
                              "logprobs": chat_logprobs([self.tokenizer.decode([t]) for t in ids], logprobs)
                              if sampling.logprobs else None}
                else:
                    choice = {"index": index, "text": text, "finish_reason": finish,
                              "logprobs": completion_logprobs([self.tokenizer.decode([t]) for t in ids], logprobs)
                              if sampling.logprobs else None}
                if sampling.return_token_ids:
                    choice["token_ids"] = list(ids)
                yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': self.model_name, 'choices': [choice]})}\n\n"
            await task  # raises what the engine raised
            yield "data: [DONE]\n\n"
        finally:
            if not task.done():  # the client went away: its samples stop
                for h in handles:
                    h.abort()
                task.cancel()

    # ---- information ------------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started,
                                            "owned_by": "splash_rollout", "max_model_len": self.backend.max_len}]}


def make_app(backend, config: ServeConfig = ServeConfig()):
    """The FastAPI application over ``backend``: a ``RolloutEngine`` or a ``fleet.Fleet``."""
    from splash_rollout.serve.metrics import render_metrics

    server = Server(backend, config)
    app = FastAPI(title="splash_rollout", version="1")
    app.state.server = server

    def refuse(e: BadRequest) -> JSONResponse:
        server.requests_total["bad"] += 1
        return JSONResponse(e.body(), status_code=e.status)

    def authorized(request: Request) -> bool:
        return config.api_key is None or request.headers.get("authorization") == f"Bearer {config.api_key}"

    async def handle(request: Request, work) -> Any:
        if not authorized(request):
            return refuse(BadRequest("missing or wrong API key (Authorization: Bearer ...)", status=401,
                                     code="invalid_api_key"))
        try:
            body = to_json_body(await request.body())
            result = await work(body)
        except BadRequest as e:
            return refuse(e)
        except Exception as e:  # noqa: BLE001 - the engine failed: a 500 with its message
            server.requests_total["error"] += 1
            return JSONResponse(BadRequest(f"{type(e).__name__}: {e}", status=500).body(), status_code=500)
        server.requests_total["ok"] += 1
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, server.completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, server.chat)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        broken = backend.serving_error
        if broken:
            return JSONResponse({"status": "error", "error": str(broken)}, status_code=503)
        return {"status": "draining" if server.draining else "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await asyncio.to_thread(render_metrics, server), media_type="text/plain; version=0.0.4")

    @app.get("/timeline")
    async def timeline():
        return await asyncio.to_thread(backend.serving_timeline)

    @app.post("/admin/update_weights")
    async def update_weights(request: Request):
        async def work(body):
            path = body.get("path")
            if not isinstance(path, str) or not path:
                raise BadRequest("path: expected a checkpoint folder (config.json + safetensors)", "path")
            version = body.get("version", backend.weight_version + 1)
            if not isinstance(version, int) or isinstance(version, bool):
                raise BadRequest(f"version: expected an integer, got {version!r}", "version")
            try:
                await asyncio.to_thread(_push_checkpoint, backend, path, version)
            except (ValueError, TypeError, FileNotFoundError) as e:
                raise BadRequest(f"update_weights: {e}", "path") from None
            return {"version": backend.weight_version}
        return await handle(request, work)

    def set_asleep(call, asleep: bool, conflict: str):
        """``backend.sleep`` / ``wake_up`` in a thread; its refusal is a 409 ``conflict``."""
        async def work(body):
            try:
                await asyncio.to_thread(call)
            except RuntimeError as e:
                raise BadRequest(str(e), status=409, code=conflict) from None
            return {"asleep": asleep}
        return work

    @app.post("/admin/sleep")
    async def sleep(request: Request):
        return await handle(request, set_asleep(backend.sleep, True, "busy"))

    @app.post("/admin/wake_up")
    async def wake_up(request: Request):
        return await handle(request, set_asleep(backend.wake_up, False, "awake"))

    @app.post("/admin/abort_all")
    async def abort_all(request: Request):
        async def work(body):
            return {"aborted": await asyncio.to_thread(backend.abort_submitted)}
        return await handle(request, work)

    return app


def _push_checkpoint(backend, path: str, version: int) -> None:
    """A checkpoint folder's tensors pushed into the engine (every replica) as ``version`` (all or
    nothing: a bad folder changes no weight)."""
    from splash_rollout.models.weights import read_checkpoint

    backend.update_weights(read_checkpoint(path, backend.model_config), version=version)


async def drain(server: Server, timeout_s: float) -> None:
    """Refuse new requests, let those in flight finish for ``timeout_s``, then abort the rest."""
    server.draining = True
    backend = server.backend
    deadline = time.monotonic() + timeout_s
    while backend.requests_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if backend.requests_in_flight:
        await asyncio.to_thread(backend.abort_submitted)
