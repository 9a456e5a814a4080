"""llama.cpp as a decode peer: one GGUF file, timed by llama.cpp's CPU library and by us, in the same process.

`causal-lm bench llama-cpp` writes a Llama-shaped model (random weights of `--config`'s shape, or a trained workdir)
as GGUF files in llama.cpp's own types (F32, Q8_0, Q4_0, Q4_1: the `--types`), or takes `--gguf FILE`. For each
file, the same prompt (token ids, no text) is decoded greedily by both sides:
- llama.cpp: `llama_decode` over the prompt in one batch, then one token at a time, through the C API of the
  `llama-cpp-cffi` wheel's CPU library (its AVX2 build), `--threads` threads (default: every core);
- us: `load_gguf(path, dequantize=False)` (Q8_0 kept as int8 blocks, Q4_0 / Q4_1 as int4 blocks with their scales
  and minimums, so both sides multiply exactly the file's values) and `generate`, as `bench decode` times it.
Decode tokens/s is (t(1 + n new tokens) - t(1 new token)) / n on both sides, the best of `--reps`; prefill
tokens/s is the prompt's tokens over the first call's time to its first token. The greedy tokens of both are
compared (a random model's near-ties can part them; a trained one's should not).

The wheel is optional and not in the project's dependencies (325 MB: it ships CUDA and Vulkan builds too):
`pip install llama-cpp-cffi cffi attrs` (the wheel omits its `cffi` dependency). Its library asks for a newer
libstdc++ symbol than Debian 12 has, in code the CPU path never calls; it is loaded with lazy binding, so it loads.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from causal_lm.bench.common import environment, fmt, machine_ceilings, ratio, read_bandwidth
from causal_lm.bench.decode import (
    IMPLAUSIBLE_FLOOR,
    _ours_runner,
    _same_program,
    _steps_seconds,
    above_the_floor,
    alternated_calls,
)
from causal_lm.interop.gguf import gguf_tensor_name, load_gguf, permute_qk
from causal_lm.interop.hf_checkpoint import hf_tensors_from_model
from causal_lm.interop.hf_config import hf_config_from_model
from causal_lm.model import build_model
from causal_lm.train import load_for_inference

TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1")
WEIGHTS_OF = {"F32": "float32", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
INSTALL = "pip install --no-deps llama-cpp-cffi && pip install cffi"


class LlamaCppError(RuntimeError):
    """llama.cpp's library is missing, or it refused the file or a call: the CLI prints it as one line, exit 2."""

    exit_status = 2


def library():
    """(lib, ffi) of the wheel's CPU build, or LlamaCppError saying how to install it."""
    spec = importlib.util.find_spec("llama")
    if spec is None or not spec.submodule_search_locations:
        raise LlamaCppError(f"llama.cpp's CPU library is not installed: {INSTALL}")
    folder = list(spec.submodule_search_locations)[0]
    so = [f for f in os.listdir(folder) if f.startswith("_llama_cpp_cpu.") and f.endswith(".so")]
    if not so:
        raise LlamaCppError(f"no CPU build of llama.cpp in {folder} (the llama-cpp-cffi wheel ships one)")
    try:
        import cffi  # noqa: F401  the wheel's undeclared dependency
    except ImportError:
        raise LlamaCppError(f"llama-cpp-cffi needs cffi, which its wheel does not declare: {INSTALL}") from None
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)  # see the module docstring
    try:
        mspec = importlib.util.spec_from_file_location("_llama_cpp_cpu", os.path.join(folder, so[0]))
        module = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        raise LlamaCppError(f"llama.cpp's CPU library did not load: {e}") from None
    finally:
        sys.setdlopenflags(flags)
    return module.lib, module.ffi


_quiet = []


def _silence(lib, ffi) -> None:
    """llama.cpp logs every load to stderr; the table says what matters."""
    if not _quiet:
        _quiet.append(ffi.callback("void(enum ggml_log_level, const char *, void *)", lambda *a: None))
        lib.llama_log_set(_quiet[0], ffi.NULL)


def system_info() -> str:
    lib, ffi = library()
    return ffi.string(lib.llama_print_system_info()).decode().strip()


# ---- writing the file ------------------------------------------------------------------------------------------


def _vocab(n: int) -> tuple[list, list, list]:
    """A SentencePiece-style vocabulary of n tokens that llama.cpp loads (unk, bos, eos, the 256 byte tokens, then
    placeholders): the prompts are token ids, so no text is ever tokenized with it."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    if n < len(tokens) + 1:
        raise ValueError(f"a llama.cpp peer needs a vocabulary of more than {len(tokens)} tokens, got {n}")
    tokens += [f"\u2581t{i}" for i in range(n - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n - 259)  # unknown, control, byte, normal
    return tokens, [0.0] * n, types


def write_gguf(model, path: str, qtype: str) -> str:
    """Write a float Llama-shaped `model` (a Decoder the Llama architecture expresses) as a GGUF file whose 2-D
    weights are `qtype` (F32, Q8_0, Q4_0, Q4_1; norms stay F32), as llama.cpp's converter lays them out."""
    import gguf

    if qtype not in TYPES:
        raise ValueError(f"qtype must be one of {', '.join(TYPES)}, got {qtype!r}")
    c = model.config
    hf = hf_config_from_model(c, "llama")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("causal_lm bench model")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.mlp_dim)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type({"F32": 0, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3}[qtype])
    tokens, scores, types = _vocab(c.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    q = getattr(gguf.GGMLQuantizationType, qtype)
    for name, a in hf_tensors_from_model(model).items():
        a = np.asarray(a, np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_embeddings:
                continue
            gname = "output.weight"
        else:
            try:
                gname = gguf_tensor_name(name)
            except KeyError:
                raise ValueError(f"the Llama layout has no GGUF name for {name}") from None
            if gname.endswith(("attn_q.weight", "attn_k.weight")):
                a = permute_qk(a, c.num_heads if gname.endswith("attn_q.weight") else c.num_kv_heads)
        if a.ndim == 2 and qtype != "F32":
            w.add_tensor(gname, gguf.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- timing llama.cpp ------------------------------------------------------------------------------------------


class LlamaCpp:
    """One GGUF file loaded by llama.cpp: greedy decoding of token-id prompts, timed."""

    def __init__(self, path: str, n_ctx: int, threads: int):
        self.lib, self.ffi = library()
        lib = self.lib
        _silence(lib, self.ffi)
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        if self.model == self.ffi.NULL:
            raise LlamaCppError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.n_ctx, self.threads = n_ctx, threads
        self.ctx = None

    def _fresh_context(self):
        lib = self.lib
        if self.ctx is not None:
            lib.llama_free(self.ctx)
        cp = lib.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        cp.n_batch = cp.n_ubatch = self.n_ctx
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        cp.type_k = cp.type_v = 0  # GGML_TYPE_F32: K/V stored as float32, like our default cache
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if self.ctx == self.ffi.NULL:
            raise LlamaCppError("llama.cpp could not create a context")

    def _decode(self, ids: Sequence[int]) -> int:
        arr = self.ffi.new("llama_token[]", [int(t) for t in ids])
        rc = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            raise LlamaCppError(f"llama_decode returned {rc}")
        logits = self.lib.llama_get_logits_ith(self.ctx, -1)
        return int(np.frombuffer(self.ffi.buffer(logits, 4 * self.n_vocab), np.float32).argmax())

    def generate(self, prompt: Sequence[int], n: int) -> tuple[list, float]:
        """(the n greedy tokens after `prompt`, seconds to the first of them), in a fresh context."""
        self._fresh_context()
        t0 = time.perf_counter()
        tok = self._decode(prompt)
        first = time.perf_counter() - t0
        out = [tok]
        for _ in range(n - 1):
            tok = self._decode([tok])
            out.append(tok)
        return out, first

    def close(self):
        if self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            self.lib.llama_model_free(self.model)
            self.model = None


def _best_pairs(runs, n: int, reps: int) -> list:
    """Per engine, (decode seconds for n steps, best time to the first token, tokens) from run(k) -> (tokens,
    first_s), timed as bench decode times generate: best t(1 + n) - best t(1), the engines' reps alternating
    (`alternated_calls`)."""
    return [
        (_steps_seconds(one, all_, n), min(f for _, f in out), out[-1][0])
        for one, all_, out in alternated_calls(runs, n, reps)
    ]


def bench_llamacpp(
    config,
    *,
    types: Sequence[str] = ("F32", "Q8_0", "Q4_1"),
    gguf: str | None = None,
    workdir: str | None = None,
    context: int = 512,
    new_tokens: int = 64,
    reps: int = 3,
    threads: int | None = None,
    out_dir: str | None = None,
    quick: bool = False,
) -> dict:
    """Decode and prefill tokens/s of llama.cpp and of us on the same GGUF files (see the module docstring).

    Returns the JSON object of `causal-lm bench llama-cpp --json`: machine, llama_cpp (its system info), threads,
    rows [{type, file_bytes, ours_tokens_per_s, llama_cpp_tokens_per_s, ratio, ours_prefill_tokens_per_s,
    llama_cpp_prefill_tokens_per_s, prefill_ratio, floor_fraction_ours, floor_fraction_llama_cpp, mem_bw_bytes_per_s
    (the floors' read bandwidth: the faster of reads just before and just after the two engines' timings,
    which alternate),
    greedy_equal (tokens equal before the first difference), new_tokens}]."""
    types = tuple(types)
    for t in types:
        if t not in TYPES:
            raise ValueError(f"--types: {t!r} is not one of {', '.join(TYPES)}")
    if context < 1 or new_tokens < 2 or reps < 1:
        raise ValueError("need context >= 1, new tokens >= 2 and reps >= 1")
    if gguf is not None and not os.path.isfile(gguf):
        raise FileNotFoundError(2, "no such GGUF file", gguf)
    lib, ffi = library()  # fails here, before any work, when the peer is not installed
    threads = threads or os.cpu_count() or 1
    env = environment()
    machine = machine_ceilings(quick=quick)
    info = system_info()
    files = []
    tmp = None
    if gguf is not None:
        files.append((None, gguf))
    else:
        if workdir is not None:
            model = load_for_inference(workdir)[0]
        else:
            model = build_model(config.model, seed=config.train.seed)
        if model.config.weights != "float32":
            raise ValueError("write the GGUF files from a float model (or pass --gguf FILE)")
        if context + new_tokens + 1 > model.config.max_seq_len:
            raise ValueError(f"context {context} + {new_tokens + 1} new tokens exceeds model.max_seq_len")
        folder = out_dir or (tmp := tempfile.mkdtemp(prefix="causal_lm_llamacpp_"))
        os.makedirs(folder, exist_ok=True)
        for t in types:
            files.append((t, write_gguf(model, os.path.join(folder, f"model-{t}.gguf"), t)))
        del model
    rows = []
    for t, path in files:
        ours, _ = load_gguf(path, dequantize=False)
        c = ours.config
        if t is None:
            t = {"float32": "F32", "int8": "Q8_0", "int4": "Q4_1" if c.weights_minimums else "Q4_0"}[c.weights]
        prompt = np.random.default_rng(0).integers(259, c.vocab_size, (1, context), dtype=np.int32)
        n_ctx = context + new_tokens + 8
        run = _ours_runner(ours, prompt, True, **_same_program(new_tokens))

        def ours_run(k, run=run):
            t0 = time.perf_counter()
            out = run(k)
            return list(out.tokens[0]), time.perf_counter() - t0

        ids = prompt[0].tolist()
        peer = LlamaCpp(path, n_ctx, threads)
        reads = [read_bandwidth(quick=quick)]  # just before and just after the two engines' alternated timings
        try:
            (peer_s, peer_first, peer_tokens), (ours_s, ours_first, ours_tokens) = _best_pairs(
                [lambda k, peer=peer, ids=ids: peer.generate(ids, k), ours_run], new_tokens, reps
            )
        finally:
            peer.close()
        reads.append(read_bandwidth(quick=quick))
        nbytes = int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(ours, nnx.Param))))
        floor_s = new_tokens * nbytes / max(reads)  # one floor for both: the fastest read of the minutes they ran in

        def peer_again(k, path=path, n_ctx=n_ctx, ids=ids):
            again = LlamaCpp(path, n_ctx, threads)
            try:
                return _best_pairs([lambda j: again.generate(ids, j)], new_tokens, k)[0][0]
            finally:
                again.close()

        ours_s, ours_retimed, ours_odd = above_the_floor(
            ours_s, lambda k, f=ours_run: _best_pairs([f], new_tokens, k)[0][0], reps, floor_s, f"{t}, ours"
        )
        peer_s, peer_retimed, peer_odd = above_the_floor(peer_s, peer_again, reps, floor_s, f"{t}, llama.cpp")
        equal = next((i for i, (a, b) in enumerate(zip(ours_tokens, peer_tokens, strict=False)) if a != b), None)
        ours_tps, peer_tps = new_tokens / ours_s, new_tokens / peer_s
        bw = max(reads) / 1e9
        rows.append(
            {
                "type": t,
                "file": path,
                "weight_bytes": nbytes,
                "ours_tokens_per_s": ours_tps,
                "llama_cpp_tokens_per_s": peer_tps,
                "ratio": ratio(ours_tps, peer_tps),
                "ours_prefill_tokens_per_s": context / ours_first,
                "llama_cpp_prefill_tokens_per_s": context / peer_first,
                "prefill_ratio": ratio(peer_first, ours_first),
                "floor_fraction_ours": (ours_tps * nbytes / 1e9 / bw) if bw else None,
                "floor_fraction_llama_cpp": (peer_tps * nbytes / 1e9 / bw) if bw else None,
                "mem_bw_bytes_per_s": max(reads),
                "retimed": ours_retimed or peer_retimed,
                "ours_implausible": ours_odd,
                "llama_cpp_implausible": peer_odd,
                "greedy_equal": len(ours_tokens) if equal is None else equal,
                "new_tokens": len(ours_tokens),
            }
        )
        del ours
    if tmp is not None:
        for _, path in files:
            os.remove(path)
        os.rmdir(tmp)
    return {
        "machine": {**env, **machine},
        "llama_cpp": info,
        "threads": threads,
        "context": context,
        "new_tokens": new_tokens,
        "rows": rows,
    }


def format_llamacpp(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"llama.cpp ({r['llama_cpp']}), {r['threads']} threads",
        f"read bandwidth {m['mem_bw_bytes_per_s'] / 1e9:.1f} GB/s measured at the start; each row's floor at the "
        "faster read measured just before and just after its two timings, which alternate (at GB/s)",
        f"batch 1, context {r['context']}, {r['new_tokens']} greedy tokens; ours: load_gguf(dequantize=False)",
        "",
        "| type | weights MB | ours tok/s | llama.cpp tok/s | ours / llama.cpp | floor % ours | floor % llama.cpp "
        "| at GB/s | prefill ours | prefill llama.cpp | prefill ratio | greedy equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in r["rows"]:
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
        lines.append(
            f"| {w['type']} | {w['weight_bytes'] / 1e6:.1f} | {w['ours_tokens_per_s']:.1f} | "
            f"{w['llama_cpp_tokens_per_s']:.1f} | {fmt(w['ratio'], '.2f')}x | {pct(w['floor_fraction_ours'])}"
            f"{'!' if w.get('ours_implausible') else ''} | {pct(w['floor_fraction_llama_cpp'])}"
            f"{'!' if w.get('llama_cpp_implausible') else ''} | "
            f"{w.get('mem_bw_bytes_per_s', m['mem_bw_bytes_per_s']) / 1e9:.1f} "
            f"| {w['ours_prefill_tokens_per_s']:.0f} | "
            f"{w['llama_cpp_prefill_tokens_per_s']:.0f} | {fmt(w['prefill_ratio'], '.2f')}x | "
            f"{w['greedy_equal']}/{w['new_tokens']} |"
        )
    if any(w.get("ours_implausible") or w.get("llama_cpp_implausible") for w in r["rows"]):
        lines.append(f"\n!: above {IMPLAUSIBLE_FLOOR:.0%} of the floor even when timed again: a timing artifact; rerun")
    return "\n".join(lines)
