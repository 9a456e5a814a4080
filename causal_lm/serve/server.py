"""`causal-lm serve`: an OpenAI-compatible HTTP server over the engine.

    app = create_app(runner, tokenizer, model_name="tiny", chat=render)   # a Starlette ASGI app
    serve(app, runner, host="127.0.0.1", port=8000, on_listen=print)      # uvicorn, until SIGINT/SIGTERM

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events
or not), GET /health, GET /metrics (Prometheus text). Responses, usage, finish reasons and error bodies have the
OpenAI API's shapes; any bad request is a 400 (404 for an unknown model or path, 413 for an oversized body)
naming the problem, checked before anything is queued, so everyone else keeps being served.

Stack: Starlette (routing, requests, streaming responses) on uvicorn (the ASGI server, with graceful shutdown):
both small, well-kept and the base of FastAPI; server-sent events are a few lines of text over Starlette's
StreamingResponse, no extra package. The engine runs in its own thread (`EngineRunner`); a request's coroutine
waits on an asyncio queue that the engine thread feeds, so requests never block each other.

Semantics the engine does not give directly, done here:
- stop strings: the text is decoded as tokens arrive and cut before the first stop string (finish_reason "stop",
  the engine request cancelled); a stream holds back the text that could be the start of one.
- `max_tokens: 0` (with `echo`, the way evaluation harnesses score a text): the engine computes one token, which
  is dropped; the prompt's logprobs come from the engine's prompt logprobs.
- a client that disconnects (mid-stream, or while waiting for a whole response) cancels its requests, whose pages
  go back at once.
- SIGINT / SIGTERM: stop accepting connections, cancel what runs (a stream ends with an error event, a waiting
  request gets 503), exit 0.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import signal
import socket
import time
import traceback
import uuid

from causal_lm.serve.engine import MAX_LOGPROBS, EngineError
from causal_lm.serve.runner import EngineRunner, ServerClosing

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    _MISSING = None
except ImportError as e:  # the `serve` extra is not installed
    _MISSING = e

MAX_BODY_BYTES = 16 * 2**20  # the default limit on a request body
MAX_N = 64  # choices one request may ask for (each must also fit in the page pool)
MAX_STOP = 4  # stop strings per request (as the OpenAI API allows)


class ServeError(ValueError):
    """The server cannot start (the serve extra is missing, the port is taken)."""


def check_installed() -> None:
    if _MISSING is not None:
        raise ServeError(
            f"causal-lm serve needs starlette and uvicorn: pip install -e '.[serve]' ({_MISSING})"
        ) from None


class APIError(Exception):
    """A request the server refuses: HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}
        error_type = kind.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}


def _error_response(e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


# ---- request validation --------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _get_int(body, name, default, lo, hi=None, *, allow_none=True):
    v = body.get(name, default)
    if v is None and allow_none:
        return default
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise APIError(400, f"{name} must be an integer {bound}, got {json.dumps(v)}", name)
    return v


def _get_bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"{name} must be true or false, got {json.dumps(v)}", name)
    return v


def _get_float(body, name, default, *, lo=None, lo_open=False, hi=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not _is_number(v) or not math.isfinite(v):
        raise APIError(400, f"{name} must be a finite number, got {_show(v)}", name)
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        left = "(" if lo_open else "["
        raise APIError(400, f"{name} must be in {left}{lo}, {'inf' if hi is None else hi}], got {v}", name)
    return float(v)


def _show(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # json.dumps writes NaN, which is not JSON
    return json.dumps(v)[:80]


def _stop_strings(body) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop must be a string or a list of strings, got {_show(stop)}", "stop")
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise APIError(400, f"stop takes up to {MAX_STOP} non-empty strings, got {len(stop)}", "stop")
    return stop


def _unsupported(body) -> None:
    """Settings the engine does not implement are refused, not silently ignored."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and v != 0:
            raise APIError(400, f"{name} is not supported by this server (only 0)", name)
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
    if body.get("suffix") is not None:
        raise APIError(400, "suffix is not supported by this server", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise APIError(400, "best_of is not supported by this server (leave it out, or equal to n)", "best_of")
    tools = body.get("tools")
    if tools:
        raise APIError(400, "tools are not supported by this server", "tools")


class _Sampling:
    """The settings both endpoints share, checked."""

    def __init__(self, body, *, context: int):
        self.temperature = _get_float(body, "temperature", 1.0, lo=0.0)
        self.top_p = _get_float(body, "top_p", None, lo=0.0, lo_open=True, hi=1.0)
        top_k = body.get("top_k")
        if top_k in (None, -1, 0):  # vLLM's and others' "no top-k"
            self.top_k = None
        else:
            self.top_k = _get_int(body, "top_k", None, 1)
        self.n = _get_int(body, "n", 1, 1, MAX_N)
        seed = body.get("seed")
        if seed is None:
            self.seed = secrets.randbelow(2**31)  # unseeded: another draw each call, as the OpenAI API does
        else:
            self.seed = _get_int(body, "seed", None, 0, 2**32 - self.n)
        self.stop = _stop_strings(body)
        self.stream = _get_bool(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "stream_options must be an object", "stream_options")
        self.include_usage = _get_bool(options, "include_usage")
        self.ignore_eos = _get_bool(body, "ignore_eos")
        self.context = context
        _unsupported(body)

    def engine_args(self, stop_ids) -> dict:
        return dict(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=() if self.ignore_eos else tuple(stop_ids),
            n=self.n,
        )


# ---- one choice's text -----------------------------------------------------------------------------------------
class _Choice:
    """A choice's tokens and text as they arrive: decoded incrementally and cut before the first stop string."""

    def __init__(self, decoder, stops: list, drop_tokens: bool = False):
        self.decode = decoder
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.drop_tokens = drop_tokens  # max_tokens 0: the engine's one token is not part of the answer
        self.text = ""
        self.tokens, self.logprobs, self.tops, self.offsets = [], [], [], []
        self.finish_reason = None
        self.prompt_logprobs = None
        self.sent_chars = 0
        self.sent_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprob: float, top) -> bool:
        """Append one token; True when a stop string ended the choice (the text is cut before it)."""
        if self.drop_tokens:
            return False
        start = len(self.text)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.tops.append(top)
        self.offsets.append(start)
        self.text += self.decode([token])
        if not self.stops:
            return False
        lo = max(0, start - self.longest + 1)
        hits = [p for s in self.stops if (p := self.text.find(s, lo)) >= 0]
        if not hits:
            return False
        cut = min(hits)
        self.text = self.text[:cut]
        keep = sum(1 for o in self.offsets if o < cut)  # tokens whose text starts before the stop string
        del self.tokens[keep:], self.logprobs[keep:], self.tops[keep:], self.offsets[keep:]
        self.finish_reason = "stop"
        return True

    def ready(self) -> tuple:
        """(new text, first new token, end of new tokens) that can be sent now: all once done, else all but a tail
        that could be the start of a stop string."""
        end = len(self.text)
        if not self.done:
            end -= self._held()
            n_tok = sum(1 for o in self.offsets if o < end)
        else:
            n_tok = len(self.tokens)
        text = self.text[self.sent_chars : max(end, self.sent_chars)]
        first = self.sent_tokens
        self.sent_chars = max(end, self.sent_chars)
        self.sent_tokens = max(n_tok, self.sent_tokens)
        return text, first, self.sent_tokens

    def _held(self) -> int:
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held


# ---- the app --------------------------------------------------------------------------------------------------
class _State:
    def __init__(self, runner: EngineRunner, tokenizer, model_name: str, chat, max_body_bytes: int):
        self.runner = runner
        self.engine = runner.engine
        self.tok = tokenizer
        self.model_name = model_name
        self.chat = chat
        self.max_body_bytes = max_body_bytes
        self.context = self.engine.config.max_seq_len
        self.vocab_size = self.engine.config.vocab_size
        stops = getattr(tokenizer, "stop_ids", None)
        eos = getattr(tokenizer, "eos_id", None)
        self.stop_ids = tuple(stops) if stops else ((eos,) if eos is not None else ())
        self.created = int(time.time())
        self.shutting_down = False

    def encode(self, text: str) -> list:
        tok = self.tok
        return tok.encode_prompt(text) if hasattr(tok, "encode_prompt") else tok.encode(text)

    def decoder(self):
        if hasattr(self.tok, "stream_decoder"):
            return self.tok.stream_decoder()
        return lambda ids: self.tok.decode(ids)

    def token_text(self, t: int) -> str:
        return self.tok.decode([int(t)])


async def _read_json(request, state: _State) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise APIError(413, f"the request body is {declared} bytes, over the limit of {state.max_body_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:
            raise APIError(413, f"the request body is over the limit of {state.max_body_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_model(body, state: _State) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {_show(model)}", "model")
    if model != state.model_name:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {state.model_name!r}", "model",
            "model_not_found",
        )  # fmt: skip


def _check_prompt_ids(ids, state: _State, name="prompt") -> list:
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"{name} has token id {bad[0]} outside the vocabulary [0, {state.vocab_size})", name)
    if not ids:
        raise APIError(400, f"{name} is empty: generation needs at least one token", name)
    return ids


def _check_lengths(prompts, max_tokens: int, sampling: _Sampling, state: _State) -> None:
    """Context and memory, before anything is queued: each prompt + max_tokens within the model's context, and the
    n choices of the request within the page pool."""
    engine = state.engine
    run = max(max_tokens, 1)
    for ids in prompts:
        if len(ids) >= state.context:
            raise APIError(
                400, f"the prompt has {len(ids)} tokens: the model's context is {state.context} tokens", "prompt"
            )
        if len(ids) + run > state.context:
            raise APIError(
                400,
                f"max_tokens {max_tokens} + the prompt's {len(ids)} tokens = {len(ids) + max_tokens} exceeds the "
                f"model's context of {state.context} tokens",
                "max_tokens",
            )
    need = sum(engine.pages_needed(len(ids) + run) for ids in prompts) * sampling.n
    if not engine.fits([len(ids) + run for ids in prompts] * sampling.n):  # every layer group's pages at once
        raise APIError(
            400,
            f"n={sampling.n} choices of {len(prompts)} prompt(s) need up to {need} KV-cache pages of "
            f"{engine.page_size} tokens, but the server has {engine.num_pages}: ask for fewer choices or tokens",
            "n",
        )


class _Run:
    """A request's engine requests, seen from the event loop: submit, then read (choice, event, result) items."""

    def __init__(self, state: _State, requests: list, choices: list):
        self.state = state
        self.requests = requests
        self.choices = choices
        self.queue = asyncio.Queue()
        self.ids = []
        self.loop = asyncio.get_running_loop()
        self.finished = set()

    def _sink(self, event, result) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (event, result))
        except RuntimeError:  # the event loop has closed: nobody is waiting
            pass

    async def start(self) -> None:
        try:
            self.ids = await asyncio.wrap_future(self.state.runner.submit(self.requests, self._sink))
        except ServerClosing as e:
            raise APIError(503, str(e)) from None
        except EngineError as e:
            raise APIError(400, str(e)) from None
        self.index = {rid: i for i, rid in enumerate(self.ids)}

    async def updates(self):
        """Yield the index of each choice that changed, until every choice is done."""
        while not all(c.done for c in self.choices):
            event, result = await self.queue.get()
            if event is None:  # the engine thread failed
                raise APIError(500, f"the engine failed: {type(result).__name__}: {result}")
            i = self.index[event.request_id]
            c = self.choices[i]
            if event.finish_reason is not None:
                self.finished.add(event.request_id)
            if c.done:
                continue
            if event.token is not None and c.add(event.token, event.logprob, event.top_logprobs):
                self.state.runner.cancel([event.request_id])  # a stop string ended it
            if result is not None:
                c.prompt_logprobs = result.prompt_logprobs
            if event.finish_reason is not None and not c.done:
                if event.finish_reason == "cancelled":
                    raise APIError(503, "the server is shutting down: the request was cancelled")
                c.finish_reason = event.finish_reason
            yield i

    def cancel(self) -> None:
        live = [rid for rid in self.ids if rid not in self.finished]
        if live:
            self.state.runner.cancel(live)


async def _disconnected(request) -> None:
    """Returns when the client has gone (the ASGI server reports http.disconnect once the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_done_or_gone(run: _Run, request) -> bool:
    """Consume the run's updates; False if the client disconnected first (its requests are then cancelled)."""

    async def consume():
        async for _ in run.updates():
            pass

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # re-raises an APIError
            return True
        return False
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            run.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(prompt_tokens: int, choices) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _stream(run: _Run, chunks, final, state: _State):
    """A StreamingResponse of server-sent events: chunks(i, choice) for each update, final() at the end, [DONE].
    The generator's end (a disconnect cancels it) cancels the run's requests that still run."""

    async def events():
        try:
            async for i in run.updates():
                for obj in chunks(i, run.choices[i]):
                    yield _sse(obj)
            for obj in final():
                yield _sse(obj)
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            run.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- completions ------------------------------------------------------------------------------------------------
def _prompts(body, state: _State) -> list:
    """[(text or None, ids)] of the completions prompt: a string, a list of strings, token ids, or lists of them."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [(p, state.encode(p))]
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return [(None, _check_prompt_ids(p, state))]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return [(x, state.encode(x)) for x in p]
    if isinstance(p, list) and p and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in p):
        return [(None, _check_prompt_ids(x, state)) for x in p]
    raise APIError(
        400, f"prompt must be a string, a list of strings, token ids or lists of token ids, got {_show(p)}", "prompt"
    )


def _completion_logprobs(state: _State, c: _Choice, first: int, end: int, offset0: int, prompt=None) -> dict:
    """The completions API's logprobs object for tokens first..end of a choice (and the prompt's, with echo)."""
    tokens, lps, tops, offsets = [], [], [], []
    if prompt is not None:
        ids, plp = prompt
        at = 0
        for t, lp in zip(ids, plp or [None] * len(ids), strict=True):
            s = state.token_text(t)
            tokens.append(s)
            lps.append(lp)
            tops.append(None)  # the engine scores prompt tokens, without alternatives
            offsets.append(at)
            at += len(s)
    for j in range(first, end):
        tokens.append(state.token_text(c.tokens[j]))
        lps.append(c.logprobs[j])
        top = c.tops[j]
        tops.append({state.token_text(t): lp for t, lp in top} if top is not None else None)
        offsets.append(offset0 + c.offsets[j])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def completions(request):
    state: _State = request.app.state.s
    body = await _read_json(request, state)
    _check_model(body, state)
    sampling = _Sampling(body, context=state.context)
    max_tokens = _get_int(body, "max_tokens", 16, 0)
    echo = _get_bool(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens 0 returns nothing without echo (use it with echo to score the prompt)",
                       "max_tokens")  # fmt: skip
    prompts = _prompts(body, state)
    for _, ids in prompts:
        _check_prompt_ids(ids, state)
    _check_lengths([ids for _, ids in prompts], max_tokens, sampling, state)
    want_prompt_lp = echo and logprobs is not None
    requests = [
        dict(
            prompt_ids=ids,
            max_tokens=max(max_tokens, 1),
            logprobs=logprobs or 0,
            prompt_logprobs=want_prompt_lp,
            **sampling.engine_args(state.stop_ids),
        )
        for _, ids in prompts
    ]
    choices = [
        _Choice(state.decoder(), sampling.stop, drop_tokens=max_tokens == 0) for _ in prompts for _ in range(sampling.n)
    ]
    run = _Run(state, requests, choices)
    await run.start()
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompt_tokens = sum(len(ids) for _, ids in prompts)

    def echo_text(i):
        text, ids = prompts[i // sampling.n]
        return text if text is not None else state.tok.decode(ids)

    def echo_prompt(i, c):
        return (prompts[i // sampling.n][1], c.prompt_logprobs) if want_prompt_lp else None

    def chunk(i, text, lp=None, finish=None):
        return {
            "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}],
        }  # fmt: skip

    if sampling.stream:
        echoed = set()

        def chunks(i, c):
            if want_prompt_lp and not c.done:
                return  # the prompt's logprobs come with the finished request: echo it all at the end
            text, first, end = c.ready()
            prefix = ""
            lp = None
            if echo and i not in echoed and (c.done or text or end > first):
                echoed.add(i)
                prefix = echo_text(i)
                if logprobs is not None:
                    lp = _completion_logprobs(state, c, first, end, len(prefix), echo_prompt(i, c))
            elif logprobs is not None:
                lp = _completion_logprobs(state, c, first, end, len(prefix))
            if text or prefix or end > first or c.done:
                yield chunk(i, prefix + text, lp, c.finish_reason)

        def final():
            if sampling.include_usage:
                yield {
                    "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [], "usage": _usage(prompt_tokens, choices),
                }  # fmt: skip

        return _stream(run, chunks, final, state)

    if not await _until_done_or_gone(run, request):
        return Response(status_code=499)
    out = []
    for i, c in enumerate(choices):
        prefix = echo_text(i) if echo else ""
        lp = None
        if logprobs is not None:
            lp = _completion_logprobs(state, c, 0, len(c.tokens), len(prefix), echo_prompt(i, c))
        out.append({"index": i, "text": prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": out,
            "usage": _usage(prompt_tokens, choices),
        }  # fmt: skip
    )


# ---- chat completions -------------------------------------------------------------------------------------------
def _messages(body) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages must be a non-empty list of messages, got {_show(messages)}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role, got {_show(m)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or text parts, got {_show(content)}",
                           "messages")  # fmt: skip
        out.append({"role": m["role"], "content": content})
    return out


def _chat_logprobs(state: _State, c: _Choice, first: int, end: int) -> dict:
    def entry(t, lp):
        s = state.token_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for j in range(first, end):
        e = entry(c.tokens[j], c.logprobs[j])
        e["top_logprobs"] = [entry(t, lp) for t, lp in (c.tops[j] or ())]
        content.append(e)
    return {"content": content}


async def chat_completions(request):
    state: _State = request.app.state.s
    body = await _read_json(request, state)
    _check_model(body, state)
    messages = _messages(body)
    sampling = _Sampling(body, context=state.context)
    want_logprobs = _get_bool(body, "logprobs")
    top = _get_int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    if top and not want_logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if state.chat is None:
        raise APIError(
            400, f"the model {state.model_name!r} has no chat template: use /v1/completions with a plain prompt",
            "messages",
        )  # fmt: skip
    try:
        ids = state.encode(state.chat(messages))
    except ValueError as e:  # the template refused the messages (roles out of order, ...)
        raise APIError(400, str(e), "messages") from None
    _check_prompt_ids(ids, state, "messages")
    limit = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if limit is None:
        limit, name = body.get("max_tokens"), "max_tokens"
    if limit is None:
        max_tokens = max(state.context - len(ids), 1)  # as long as the context allows
    else:
        max_tokens = _get_int({name: limit}, name, None, 1)
    _check_lengths([ids], max_tokens, sampling, state)
    requests = [dict(prompt_ids=ids, max_tokens=max_tokens, logprobs=top, **sampling.engine_args(state.stop_ids))]
    choices = [_Choice(state.decoder(), sampling.stop) for _ in range(sampling.n)]
    run = _Run(state, requests, choices)
    await run.start()
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(i, delta, lp=None, finish=None):
        return {
            "id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
            "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        }  # fmt: skip

    if sampling.stream:
        started = set()

        def chunks(i, c):
            if i not in started:
                started.add(i)
                yield chunk(i, {"role": "assistant", "content": ""})
            text, first, end = c.ready()
            lp = _chat_logprobs(state, c, first, end) if want_logprobs and end > first else None
            if text or end > first:
                yield chunk(i, {"content": text}, lp)
            if c.done:
                yield chunk(i, {}, None, c.finish_reason)

        def final():
            if sampling.include_usage:
                yield {
                    "id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                    "choices": [], "usage": _usage(len(ids), choices),
                }  # fmt: skip

        return _stream(run, chunks, final, state)

    if not await _until_done_or_gone(run, request):
        return Response(status_code=499)
    out = [
        {
            "index": i,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(state, c, 0, len(c.tokens)) if want_logprobs else None,
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(choices)
    ]
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": out,
            "usage": _usage(len(ids), choices),
        }  # fmt: skip
    )


# ---- models, health, metrics ------------------------------------------------------------------------------------
async def models(request):
    state: _State = request.app.state.s
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "causal_lm",
                    "max_model_len": state.context,
                    "vocab_size": state.vocab_size,
                }  # fmt: skip
            ],
        }
    )


async def health(request):
    state: _State = request.app.state.s
    if state.runner.error is not None:
        return JSONResponse({"status": "error", "error": str(state.runner.error)}, status_code=500)
    if not state.runner.alive:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})


def metrics_text(runner: EngineRunner) -> str:
    """The Prometheus text format (version 0.0.4) of the engine's state and the server's counters."""
    with runner.lock:
        s = dict(runner.snapshot)
        tokens = runner.tokens_generated
        finished = dict(runner.finished)
        hists = [
            ("causal_lm_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
             runner.ttft.cumulative(), runner.ttft.sum, runner.ttft.count),
            ("causal_lm_time_per_output_token_seconds", "Time between two tokens of a request.",
             runner.tpot.cumulative(), runner.tpot.sum, runner.tpot.count),
        ]  # fmt: skip
    lines = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    metric("causal_lm_requests_running", "gauge", "Requests in the running batch.", [("", s["running"])])
    metric("causal_lm_requests_waiting", "gauge", "Requests queued for a row or pages.", [("", s["waiting"])])
    metric("causal_lm_pages_total", "gauge", "KV-cache pages in the pool.", [("", s["pages_total"])])
    metric("causal_lm_pages_used", "gauge", "Pages held by running requests.", [("", s["pages_used"])])
    metric("causal_lm_pages_cached", "gauge", "Pages held by no request, kept for the prefix cache (reusable).",
           [("", s["pages_cached"])])  # fmt: skip
    metric("causal_lm_pages_free", "gauge", "Pages free (not counting cached ones).", [("", s["pages_free"])])
    metric("causal_lm_prefix_cache_hit_pages_total", "counter", "Prompt pages found in the prefix cache.",
           [("", s["prefix_hit_pages"])])  # fmt: skip
    metric("causal_lm_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
           [("", s["prefix_hit_tokens"])])  # fmt: skip
    metric("causal_lm_preemptions_total", "counter", "Running requests preempted for pages.", [("", s["preemptions"])])
    metric("causal_lm_generation_tokens_total", "counter", "Tokens generated.", [("", tokens)])
    metric("causal_lm_requests_finished_total", "counter", "Requests finished, by reason.",
           [(f'{{reason="{r}"}}', finished.get(r, 0)) for r in ("stop", "length", "cancelled")])  # fmt: skip
    metric("causal_lm_engine_steps_total", "counter", "Engine steps run.", [("", s["steps"])])
    metric("causal_lm_programs_compiled_total", "counter", "Engine step programs compiled (one per new shape).",
           [("", s["programs_compiled"])])  # fmt: skip
    for name, help_text, buckets, total, count in hists:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} histogram")
        for bound, c in buckets:
            le = "+Inf" if math.isinf(bound) else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {c}')
        lines.append(f"{name}_sum {total}")
        lines.append(f"{name}_count {count}")
    return "\n".join(lines) + "\n"


async def metrics(request):
    return PlainTextResponse(metrics_text(request.app.state.s.runner), media_type="text/plain; version=0.0.4")


def _guard(endpoint):
    """Errors as OpenAI error bodies: APIError as itself, anything else (a bug) as a 500 that names it."""

    async def handler(request):
        try:
            return await endpoint(request)
        except APIError as e:
            return _error_response(e)
        except ClientDisconnect:  # gone before its body was read: nothing was queued
            return Response(status_code=499)
        except Exception as e:  # a bug: the server keeps serving everyone else
            traceback.print_exc()
            return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    return handler


def create_app(runner: EngineRunner, tokenizer, *, model_name: str, chat=None, max_body_bytes: int = MAX_BODY_BYTES):
    """The ASGI app. chat: messages -> prompt text (the model's chat template), or None when it has none."""
    check_installed()

    async def http_error(request, exc):
        status = exc.status_code
        path = f"{request.method} {request.url.path}"
        message = {404: f"no such endpoint: {path}", 405: f"method not allowed: {path}"}.get(status, str(exc.detail))
        return _error_response(APIError(status, message))

    routes = [
        Route("/v1/models", _guard(models), methods=["GET"]),
        Route("/v1/completions", _guard(completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(chat_completions), methods=["POST"]),
        Route("/health", _guard(health), methods=["GET"]),
        Route("/metrics", _guard(metrics), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.s = _State(runner, tokenizer, model_name, chat, max_body_bytes)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one, chosen by the system)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, runner: EngineRunner, sock: socket.socket) -> None:
    """Serve `app` on the bound socket until SIGINT or SIGTERM, then stop accepting, cancel what runs and return."""
    check_installed()

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Graceful: the running requests are cancelled (streams end with an error event, waiting requests get
            # 503), so the connections close and uvicorn returns; a second SIGINT forces the exit. Unlike uvicorn,
            # the signal is not raised again afterwards: the command exits 0.
            runner.close(timeout=0)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=10, http="h11")
    _Server(config).run(sockets=[sock])
    runner.close(timeout=10)
