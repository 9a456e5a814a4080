"""`causal-lm bench serve --server URL`: a bounded load test of a running `causal-lm serve` (or any OpenAI-compatible
server with our /metrics), from this machine.

`clients` threads each send /v1/completions requests one after another (every other one streaming, when `stream`
is "both") until `requests` requests have been sent in all or `duration` seconds have passed. Prompts are random
token ids (lengths uniform in prompt_range), max_tokens uniform in new_range, greedy, `ignore_eos` so each request
generates what it asks for. Standard library only (http.client), so the client costs no dependency.

Reported: requests/s and output tokens/s over the wall time, time to first token p50/p99 (streaming requests: from
sending to the first text chunk), inter-token latency p50/p99 (streaming: between consecutive chunks), request
latency p50/p99, errors (anything but a 200 with the asked-for tokens), and the server's KV pages before and after
(read from /metrics: every page is back, free or cached, once the load is over).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse

import numpy as np


def _connection(url: str, timeout: float):
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout)


def _get(url: str, path: str, timeout: float = 30.0) -> tuple:
    conn = _connection(url, timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def server_metrics(url: str) -> dict:
    """The server's /metrics samples without labels (name -> value)."""
    status, text = _get(url, "/metrics")
    if status != 200:
        raise ValueError(f"{url}/metrics answered {status}: is this a causal-lm serve server?")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def _model(url: str) -> dict:
    try:
        status, text = _get(url, "/v1/models")
    except OSError as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    if status != 200:
        raise ValueError(f"{url}/v1/models answered {status}")
    return json.loads(text)["data"][0]


def one_request(url: str, body: dict, timeout: float) -> dict:
    """Send one completion; {"ok", "tokens", "latency", "ttft", "gaps"} (times in seconds)."""
    conn = _connection(url, timeout)
    t0 = time.perf_counter()
    out = {
        "stream": bool(body.get("stream")),
        "ok": False,
        "tokens": 0,
        "latency": None,
        "ttft": None,
        "gaps": [],
        "error": None,
    }
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            return out
        if not body.get("stream"):
            data = json.loads(r.read())
            out["tokens"] = data["usage"]["completion_tokens"]
        else:
            last = None
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    out["error"] = chunk["error"].get("message")
                    return out
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        out["ttft"] = now - t0
                    else:
                        out["gaps"].append(now - last)
                    last = now
        out["latency"] = time.perf_counter() - t0
        out["ok"] = out["tokens"] == body["max_tokens"]
        if not out["ok"]:
            out["error"] = f"{out['tokens']} tokens, asked for {body['max_tokens']}"
        return out
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        conn.close()


def _pct(values, q):
    return float(np.percentile(values, q)) if values else None


def bench_server(
    url: str,
    *,
    clients: int = 8,
    requests: int | None = 64,
    duration: float | None = None,
    prompt_range: tuple = (16, 64),
    new_range: tuple = (16, 64),
    stream: str = "both",
    seed: int = 0,
    timeout: float = 300.0,
) -> dict:
    """The load test (see the module docstring). requests and/or duration bound it (at least one)."""
    if requests is None and duration is None:
        raise ValueError("bound the load test: give --requests M and/or --duration T")
    if clients < 1 or (requests is not None and requests < 1) or (duration is not None and duration <= 0):
        raise ValueError("--clients and --requests must be >= 1 and --duration > 0")
    if stream not in ("both", "yes", "no"):
        raise ValueError(f"--stream takes both, yes or no, got {stream!r}")
    url = url.rstrip("/")
    model = _model(url)
    vocab, context = int(model.get("vocab_size", 256)), int(model.get("max_model_len", 2048))
    if prompt_range[1] + new_range[1] > context:
        raise ValueError(
            f"prompts up to {prompt_range[1]} + {new_range[1]} new tokens exceed the model's context of {context}"
        )
    before = server_metrics(url)
    rng = np.random.default_rng(seed)
    lock = threading.Lock()
    sent = [0]
    results = []
    t_start = time.perf_counter()

    def next_body():
        with lock:
            if requests is not None and sent[0] >= requests:
                return None
            if duration is not None and time.perf_counter() - t_start >= duration:
                return None
            i = sent[0]
            sent[0] += 1
            prompt = rng.integers(0, vocab, int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist()
            n = int(rng.integers(new_range[0], new_range[1] + 1))
        streaming = stream == "yes" or (stream == "both" and i % 2 == 1)
        body = dict(model=model["id"], prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, stream=streaming)
        if streaming:
            body["stream_options"] = {"include_usage": True}
        return body

    def client():
        while (body := next_body()) is not None:
            r = one_request(url, body, timeout)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    after = server_metrics(url)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    latency = [r["latency"] for r in ok]
    errors = [r["error"] for r in results if not r["ok"]]
    return {
        "benchmark": "serve --server",
        "url": url,
        "model": model["id"],
        "clients": clients,
        "requests": len(results),
        "streaming_requests": sum(1 for r in results if r["stream"]),
        "errors": len(errors),
        "first_errors": errors[:3],
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p99_s": _pct(gaps, 99),
        "latency_p50_s": _pct(latency, 50),
        "latency_p99_s": _pct(latency, 99),
        "pages_total": int(after.get("causal_lm_pages_total", 0)),
        "pages_used_before": int(before.get("causal_lm_pages_used", 0)),
        "pages_used_after": int(after.get("causal_lm_pages_used", 0)),
        "programs_compiled": int(after.get("causal_lm_programs_compiled_total", 0))
        - int(before.get("causal_lm_programs_compiled_total", 0)),
        "prefix_hit_pages": int(after.get("causal_lm_prefix_cache_hit_pages_total", 0))
        - int(before.get("causal_lm_prefix_cache_hit_pages_total", 0)),
    }


def format_server(r: dict) -> str:
    def f(x, spec="8.3f"):
        return "-" if x is None else format(x, spec)

    return "\n".join(
        [
            f"serve --server {r['url']} ({r['model']}): {r['clients']} clients, {r['requests']} requests "
            f"({r['streaming_requests']} streaming) in {r['wall_s']:.1f}s",
            f"requests/s {r['requests_per_s']:.2f}, output tokens/s {r['output_tokens_per_s']:.1f}, errors "
            f"{r['errors']}" + (f" ({'; '.join(map(str, r['first_errors']))})" if r["errors"] else ""),
            f"TTFT p50 {f(r['ttft_p50_s'])}s p99 {f(r['ttft_p99_s'])}s; inter-token p50 {f(r['itl_p50_s'], '.4f')}s "
            f"p99 {f(r['itl_p99_s'], '.4f')}s; latency p50 {f(r['latency_p50_s'])}s p99 {f(r['latency_p99_s'])}s",
            f"pages in use after: {r['pages_used_after']} of {r['pages_total']} "
            f"({'all back' if r['pages_used_after'] == 0 else 'NOT all back'}); programs compiled during the run: "
            f"{r['programs_compiled']} (each stalls the server once: run the load test again for warm figures)",
        ]
    )
