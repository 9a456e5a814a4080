"""`causal-lm serve`: the real server as a subprocess on 127.0.0.1 (a free port), driven by the official `openai`
client and raw HTTP: completions and chat, streaming or not, n choices, logprobs, stop strings, echo scoring,
32 concurrent clients, every bad input, disconnects, the load test, a --hf folder, and SIGTERM.

One server for the module (a tiny random model with a byte-level BPE tokenizer and a ChatML template, saved as a
workdir); the SIGTERM test stops it, so it runs last.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra is not installed")
httpx = pytest.importorskip("httpx")

import jax  # noqa: E402
from chat_tokenizers import CHATML, CHATML_SPECIALS, train_bpe  # noqa: E402

from causal_lm.bench.load import bench_server, server_metrics  # noqa: E402
from causal_lm.config import load_config  # noqa: E402
from causal_lm.data.tokenizer import HFTokenizer  # noqa: E402
from causal_lm.decode import generate  # noqa: E402
from causal_lm.interop.chat import apply_chat_template  # noqa: E402
from causal_lm.model import build_model  # noqa: E402
from causal_lm.model.functional import forward  # noqa: E402
from causal_lm.train import save_for_inference  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT = 256
MAX_BODY = 65536
NAME = "tiny"


class Server:
    def __init__(self, proc, url, log):
        self.proc, self.url, self.log = proc, url, log

    def stderr(self) -> str:
        with open(self.log) as f:
            return f.read()[-3000:]


def spawn(args, log) -> tuple:
    """`causal-lm serve ARGS --port 0` as a child (not waited for)."""
    err = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "causal_lm.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=ROOT,
    )
    return proc, log


def ready(spawned) -> Server:
    """The spawned server, once it prints where it listens."""
    proc, log = spawned
    watchdog = threading.Timer(300, proc.kill)  # a server that never starts fails the test instead of hanging it
    watchdog.start()
    line = proc.stdout.readline()
    watchdog.cancel()
    assert " on http://" in line, (line, open(log).read()[-3000:])
    return Server(proc, line.rsplit(" on ", 1)[1].strip(), log)


def start_server(args, log) -> Server:
    return ready(spawn(args, log))


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, tokenizer, workdir): a tiny random model whose tokenizer has a chat template, saved as a workdir."""
    bpe = train_bpe(CHATML_SPECIALS, 300)
    tok = HFTokenizer(bpe.to_str(), stop_ids=[bpe.token_to_id("<|im_end|>")], chat_template=CHATML)
    config = load_config("tiny", ["model.vocab_size=300", f"model.max_seq_len={CONTEXT}"])
    model = build_model(config.model, seed=0)
    workdir = str(tmp_path_factory.mktemp("serve") / NAME)
    save_for_inference(workdir, model, config, tok)
    return model, tok, workdir


@pytest.fixture(scope="module")
def cli_text(setup, tmp_path_factory):
    """`causal-lm generate` of the prompt "Paris is" (greedy), running (a child) while the server starts."""
    _, _, workdir = setup
    proc = subprocess.Popen(
        [sys.executable, "-m", "causal_lm.cli", "generate", "--workdir", workdir, "--prompt", "Paris is",
         "--max-new-tokens", "12", "--no-stream"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    return proc


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    _, _, workdir = setup
    log = str(tmp_path_factory.mktemp("log") / "server.err")
    args = ["--workdir", workdir, "--model-name", NAME, "--max-seqs", "8", "--kv-memory", "2MiB"]
    s = start_server([*args, "--max-step-tokens", "64", "--max-body-bytes", str(MAX_BODY)], log)
    yield s
    stop(s)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model=NAME, prompt=prompt, **kw)


def reference(model, tok, ids, n):
    """Greedy tokens of `generate` (the engine's guarantee, and `causal-lm generate`'s tokens) as text."""
    out = generate(model, [ids], max_new_tokens=n, stop_tokens=tok.stop_ids).tokens[0]
    return tok.decode(out)


# ---- the openai client ------------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_greedy_completion_equals_causal_lm_generate(client, cli_text):
    out, err = cli_text.communicate(timeout=300)
    assert cli_text.returncode == 0, err
    expected = out.rstrip("\n").removeprefix("Paris is")
    r = complete(client, "Paris is", max_tokens=12)
    assert r.choices[0].text == expected and len(expected) > 0
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12


def test_streaming_and_chat_equal_generate(setup, client):
    model, tok, _ = setup
    whole = complete(client, "The quick brown fox", max_tokens=10).choices[0].text
    chunks = list(complete(client, "The quick brown fox", max_tokens=10, stream=True,
                           stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"
    assert whole == reference(model, tok, tok.encode_prompt("The quick brown fox"), 10)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode_prompt(apply_chat_template(tok, messages))
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=9, temperature=0)
    assert chat.choices[0].message.content == reference(model, tok, ids, 9)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=9, temperature=0,
                                            stream=True)  # fmt: skip
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_n_choices_are_the_seeded_single_requests(client):
    """n=2 shares the prompt: choice i draws what a single request with seed + i draws."""
    kw = dict(max_tokens=8, temperature=1.5, seed=7)
    both = complete(client, "Numbers like", n=2, **kw).choices
    alone = [complete(client, "Numbers like", **dict(kw, seed=7 + i)).choices[0].text for i in range(2)]
    assert [c.index for c in both] == [0, 1]
    assert [c.text for c in both] == alone
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], n=2, **kw)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 16


def test_logprobs(setup, client):
    model, tok, _ = setup
    ids = tok.encode_prompt("Language models")
    r = complete(client, ids, max_tokens=6, logprobs=3).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.text and lp.text_offset[0] == 0
    # the greedy token is the most likely one, with its own log-probability
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)
    # the first generated token's logprob is the model's log_softmax at the prompt's last position
    logp = jax.nn.log_softmax(forward(model, np.asarray([ids]))[0][0, -1])
    assert lp.token_logprobs[0] == pytest.approx(float(logp.max()), abs=1e-5)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_stop_strings_cut_the_text(client):
    whole = complete(client, "Paris is", max_tokens=20).choices[0].text
    stop = next(whole[k : k + 3] for k in range(1, len(whole)) if whole.find(whole[k : k + 3]) > 0)
    cut = whole.find(stop)
    assert 0 < cut and len(whole) > cut + len(stop)
    r = complete(client, "Paris is", max_tokens=20, stop=[stop, "never in the text \u2603"])
    assert r.choices[0].text == whole[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 20
    streamed = list(complete(client, "Paris is", max_tokens=20, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    chat_whole = (
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0
        )
        .choices[0]
        .message.content
    )
    chat_stop = chat_whole[1:3]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0, stop=chat_stop
    )
    assert chat.choices[0].message.content == chat_whole[: chat_whole.find(chat_stop)]


def test_echo_scores_the_prompt_exactly(setup, client):
    """echo + logprobs + max_tokens 0 (how evaluation harnesses score a text): each prompt token's logprob is the
    log_softmax of the recomputed logits at the position before it."""
    model, tok, _ = setup
    ids = tok.encode_prompt("What is the capital of France? Paris is the capital.")
    r = complete(client, ids, max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text == tok.decode(ids) and r.usage.completion_tokens == 0
    logp = np.asarray(jax.nn.log_softmax(forward(model, np.asarray([ids]))[0][0], axis=-1))
    expected = [logp[i - 1, ids[i]] for i in range(1, len(ids))]
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids)
    np.testing.assert_allclose(c.logprobs.token_logprobs[1:], expected, atol=1e-5, rtol=0)
    # echo with generated tokens: the prompt's text, then the completion's
    gen = complete(client, ids, max_tokens=3, echo=True, logprobs=1).choices[0]
    assert gen.text.startswith(tok.decode(ids)) and len(gen.logprobs.tokens) == len(ids) + 3


def test_32_concurrent_clients_each_get_their_tokens_alone(client):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 300, int(rng.integers(2, 40))).tolist() for _ in range(32)]
    alone = [complete(client, p, max_tokens=8).choices[0].text for p in prompts]
    assert len(set(alone)) > 8  # the prompts give different texts: rows mixed up would show

    def one(i):
        if i % 2:
            return "".join(c.choices[0].text for c in complete(client, prompts[i], max_tokens=8, stream=True))
        return complete(client, prompts[i], max_tokens=8).choices[0].text

    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(one, range(32)))
    assert together == alone


# ---- bad input ----------------------------------------------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = list(range(3, 3 + CONTEXT))  # a prompt as long as the context
BAD = [
    ("malformed-json", C, b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("not-an-object", C, b"[1, 2]", 400, "must be a JSON object"),
    ("wrong-type", C, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens must be an integer"),
    ("prompt-type", C, {"prompt": {"a": 1}}, 400, "prompt must be"),
    ("unknown-model", C, {"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
    ("prompt-too-long", C, {"prompt": LONG, "max_tokens": 1}, 400, "context is 256 tokens"),
    ("max-tokens-negative", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be an integer >= 0"),
    ("max-tokens-beyond-context", C, {"prompt": "hi", "max_tokens": CONTEXT}, 400, "exceeds the model's context"),
    ("temperature-nan", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature must be a finite number"),
    ("temperature-negative", C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature must be in"),
    ("top-p-zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0.0, 1.0]"),
    ("top-p-above-one", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0.0, 1.0]"),
    ("token-outside-vocab", C, {"prompt": [5, 300]}, 400, "token id 300 outside the vocabulary [0, 300)"),
    ("n-too-large-for-memory", C, {"prompt": "hi", "n": 64, "max_tokens": 200}, 400, "KV-cache pages"),
    ("n-zero", C, {"prompt": "hi", "n": 0}, 400, "n must be an integer in [1, 64]"),
    ("logprobs-too-many", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs must be an integer in [0, 20]"),
    ("stop-type", C, {"prompt": "hi", "stop": 5}, 400, "stop must be a string"),
    ("penalty", C, {"prompt": "hi", "presence_penalty": 1}, 400, "not supported"),
    ("oversized-body", C, {"prompt": "x" * MAX_BODY}, 413, "over the limit"),
    ("chat-messages", CHAT, {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("chat-content", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content must be"),
    ("chat-unknown-model", CHAT, {"model": "x", "messages": [{"role": "user", "content": "hi"}]}, 404, "serves"),
    ("no-such-endpoint", "/v1/embeddings", {"input": "hi"}, 404, "no such endpoint"),
]


@pytest.mark.parametrize("name,path,body,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_error_and_the_server_keeps_serving(server, client, name, path, body, status, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert complete(client, "Paris is", max_tokens=2).choices[0].finish_reason == "length"


def test_the_openai_client_raises_the_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], temperature=-1)


# ---- disconnects, load, other formats ------------------------------------------------------------------------------
def _wait_for(url, condition, what):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = server_metrics(url)
        if condition(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"{what}: {m}")


CANCELLED = 'causal_lm_requests_finished_total{reason="cancelled"}'


def _cancelled(url) -> int:
    text = httpx.get(url + "/metrics").text
    return int(float(next(line.split()[-1] for line in text.splitlines() if line.startswith(CANCELLED))))


def test_disconnect_cancels_the_request_and_frees_its_pages(server):
    url = server.url
    body = {"prompt": "Hello", "max_tokens": CONTEXT - 8, "temperature": 0, "ignore_eos": True}
    before = _cancelled(url)
    with httpx.stream("POST", url + C, json=dict(body, stream=True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk read: the request runs; leaving the block closes the connection
    _wait_for(url, lambda m: m["causal_lm_pages_used"] == 0 and m["causal_lm_requests_running"] == 0, "pages held")
    assert _cancelled(url) == before + 1
    # not streaming: a client that gives up waiting for the whole response cancels too (closed once it runs)
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {C} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        _wait_for(url, lambda m: m["causal_lm_requests_running"] == 1, "the request never ran")
    _wait_for(url, lambda m: m["causal_lm_pages_used"] == 0 and m["causal_lm_requests_running"] == 0, "pages held")
    assert _cancelled(url) == before + 2
    m = server_metrics(url)
    assert m["causal_lm_pages_free"] + m["causal_lm_pages_cached"] == m["causal_lm_pages_total"]


def test_load_test_against_the_server(server):
    r = bench_server(server.url, clients=4, requests=12, prompt_range=(4, 24), new_range=(4, 12))
    assert r["errors"] == 0, r["first_errors"]
    assert r["requests"] == 12 and r["streaming_requests"] == 6 and r["pages_used_after"] == 0
    assert r["output_tokens"] >= 12 * 4 and r["ttft_p50_s"] is not None


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(path, model, bpe) -> str:
    """The model as a float32 llama GGUF file, the way llama.cpp's converter lays it out (q/k rows permuted), with
    the tokenizer's vocabulary, merges and chat template (tests/test_gguf.py checks such files against
    transformers)."""
    import gguf
    from chat_tokenizers import bpe_vocab_and_merges

    from causal_lm.interop.gguf import permute_qk
    from causal_lm.interop.hf_checkpoint import hf_tensors_from_model

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.mlp_dim)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    tokens, merges = bpe_vocab_and_merges(bpe)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in CHATML_SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)
    for name, a in hf_tensors_from_model(model).items():
        a = np.asarray(a, np.float32)
        if name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif name == "model.norm.weight":
            name = "output_norm.weight"
        elif name == "lm_head.weight":
            name = "output.weight"
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            hf = next(h for h in GGUF_NAMES if rest.startswith(h))
            rest = GGUF_NAMES[hf] + rest[len(hf) :]
            if rest.startswith(("attn_q.", "attn_k.")):
                a = permute_qk(a, c.num_heads if rest.startswith("attn_q") else c.num_kv_heads)
            name = f"blk.{i}.{rest}"
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_serves_a_hugging_face_folder_and_a_gguf_file(setup, client, tmp_path):
    """--hf and --gguf: the same weights as a Hugging Face folder and as a GGUF file give the same greedy text
    (completion and chat) as the workdir."""
    pytest.importorskip("safetensors", reason="the interop extra is not installed")
    pytest.importorskip("gguf", reason="the interop extra is not installed")
    from causal_lm import save_hf

    model, tok, _ = setup
    hf_dir = save_hf(model, tok, str(tmp_path / "hf"))
    gguf_file = write_gguf(tmp_path / "tiny.gguf", model, train_bpe(CHATML_SPECIALS, 300))
    engine = ["--max-seqs", "2", "--kv-memory", "1MiB"]
    spawned = [spawn([flag, path, *engine], str(tmp_path / f"{flag[2:]}.err"))
               for flag, path in (("--hf", hf_dir), ("--gguf", gguf_file))]  # fmt: skip
    servers = []
    try:
        servers = [ready(s) for s in spawned]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        want = complete(client, "Paris is", max_tokens=8, logprobs=2).choices[0]
        want_chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
        for server, name in zip(servers, ("hf", "tiny.gguf"), strict=True):
            other = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
            assert other.models.list().data[0].id == name
            got = other.completions.create(model=name, prompt="Paris is", max_tokens=8, temperature=0, logprobs=2)
            assert got.choices[0].text == want.text
            # the same tokens, prompt and weights: the log-probabilities too (the text alone would not show a
            # prompt encoded differently, for this random model mostly repeats the last token)
            np.testing.assert_allclose(got.choices[0].logprobs.token_logprobs, want.logprobs.token_logprobs, atol=1e-5)
            chat = other.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0)
            assert chat.choices[0].message.content == want_chat.choices[0].message.content
    finally:
        for proc, _ in spawned:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc, _ in spawned]
    assert codes == [0, 0], [open(log).read()[-2000:] for _, log in spawned]


def test_sigterm_during_a_stream_exits_0(server):
    """Last: it stops the module's server. The stream in flight ends with an error event; the process exits 0."""
    got = []

    def read():
        body = {"prompt": "Hello", "max_tokens": CONTEXT - 8, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + C, json=body, timeout=60) as r:
            for line in r.iter_lines():
                got.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(g.startswith("data: ") for g in got) and time.monotonic() < deadline:
        time.sleep(0.01)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.stderr()
    reader.join(timeout=30)
    events = [g[6:] for g in got if g.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]


def test_command_line_errors_are_one_line(setup, tmp_path, capsys):
    """A missing workdir, a taken port (found before the model loads) and a bad engine setting: one error line
    each, exit status 2, no server started."""
    from causal_lm.cli import main

    _, _, workdir = setup
    assert main(["serve", "--workdir", str(tmp_path / "nothing")]) == 2
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        assert main(["serve", "--workdir", workdir, "--port", str(taken.getsockname()[1])]) == 2
    finally:
        taken.close()
    assert main(["serve", "--workdir", workdir, "--port", "0", "--kv-memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 3, err
    assert "cannot listen on 127.0.0.1" in lines[1] and "kv_memory must be a size" in lines[2], err


def test_engine_forgets_only_finished_requests(setup):
    """Engine.forget (what keeps a long-running server's memory bounded) refuses a request still queued."""
    from causal_lm.serve import Engine, EngineError

    model, _, _ = setup
    engine = Engine(model, max_seqs=2, num_pages=8, max_step_tokens=8)
    rid = engine.submit([1, 2, 3], max_tokens=2)
    with pytest.raises(EngineError, match="has not finished"):
        engine.forget(rid)
    engine.cancel(rid)
    engine.forget(rid)
    with pytest.raises(EngineError, match="no request"):
        engine.result(rid)
