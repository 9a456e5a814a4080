"""Benchmarks: training and decoding speed next to the PyTorch stack people would use instead, and against the
machine's own measured ceilings, all in one process run.

    machine_ceilings()    matmul FLOP/s (a large float32 matmul through JAX) and memory read bandwidth (a jitted
                          reduction over a 256 MiB array): the peaks MFU and the decode floor are measured against
    bench_train(config)   tokens/s, median step time after warm-up, MFU, first-step compile time, compile time at 2
                          and 12 layers; the peer: the same step in transformers' LlamaForCausalLM (sdpa attention,
                          torch AdamW, the same weights and batch)
    bench_decode(config)  `generate` tokens/s with the KV cache and with recompute at context lengths x batch
                          sizes, bytes read per generated token and the share of the bandwidth floor reached; the
                          peer: transformers' `generate` with and without its cache; the first token of a
                          fresh process, compiling and with the persistent compilation cache (first_call_latency)

How things are timed (both sides alike):
  - train: `warmup` steps, then `steps` steps each timed to completion; the median is the step time. Compile
    time is lowering + compiling the first step (ahead of time, so it is not mixed with running it).
  - decode: a generated token's time is measured as t(1 + n new tokens) - t(1 new token), the best of `reps`
    calls each, so the prompt's prefill (and the first token) cancel out and only the n decode steps remain.
    Prompts are `context` random tokens; every row is as long as the others.
  - the peer runs with torch's default intra-op threads (one per core), in float32, in train mode without dropout.

Ratios are ours / peer: above 1 means faster than the peer. MFU uses the explicit FLOP count of
`causal_lm.train.metrics` (causal attention counted at half of full attention) against the measured matmul peak,
for both sides. Decode's bandwidth floor: a decode step must read every weight once and each row's K/V for its
context, so (weight bytes + batch x context x K/V bytes per token) / batch bytes per generated token at the
measured read bandwidth is the fastest it can be; small models whose weights fit in the last-level cache can beat
it (fraction > 1).

    bench_serve(config)   the serving engine on a fixed workload (output tokens/s, time to first token and per
                          token, pages): against `generate` one request at a time and in fixed batches of 8, and
                          transformers' own continuous batching on the same weights (serve.py)

Modules: common.py (ceilings, environment, timing, tables), peer.py (the PyTorch side), train.py, decode.py,
first_call.py (fresh-process latency), serve.py (serving). They
use only the package's public functions.
"""

from causal_lm.bench.common import NOT_INSTALLED, environment, machine_ceilings, peer_status
from causal_lm.bench.decode import bench_decode, decode_bytes_per_token, decode_loop_comparison, format_decode
from causal_lm.bench.first_call import first_call_latency
from causal_lm.bench.serve import bench_serve, format_serve
from causal_lm.bench.train import bench_train, compile_seconds, format_train

__all__ = [
    "NOT_INSTALLED",
    "environment",
    "machine_ceilings",
    "peer_status",
    "bench_decode",
    "decode_bytes_per_token",
    "decode_loop_comparison",
    "format_decode",
    "first_call_latency",
    "bench_serve",
    "format_serve",
    "bench_train",
    "compile_seconds",
    "format_train",
]
