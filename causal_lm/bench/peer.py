"""The peer: the same model in transformers' LlamaForCausalLM (PyTorch), run on the same weights and inputs.

torch and transformers are optional dependencies (the `interop` extra), so they are imported inside the
functions that use them.
"""

from __future__ import annotations

import numpy as np

from causal_lm.bench.common import time_steps
from causal_lm.config import Config, ModelConfig
from causal_lm.interop.hf_checkpoint import hf_tensors_from_model
from causal_lm.interop.hf_config import hf_config_from_model
from causal_lm.interop.hf_weights import model_from_params


def peer_mismatch(m: ModelConfig) -> str | None:
    """Why LlamaForCausalLM cannot run this model (e.g. partial RoPE, MLA, windows), or None when it can. A model
    the peer cannot mirror is still benchmarked on our side; the peer columns then say "not comparable"."""
    try:
        hf_config_from_model(m, "llama")
    except ValueError as e:
        return str(e)
    return None


def build_peer(m: ModelConfig, params: dict):
    """transformers' LlamaForCausalLM with sdpa attention holding exactly `params` (float32, CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = hf_config_from_model(m, "llama")
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")}
    hf_config = LlamaConfig(**cfg)
    hf_config._attn_implementation = "sdpa"
    peer = LlamaForCausalLM(hf_config).to(torch.float32)
    tensors = hf_tensors_from_model(model_from_params(m, params))
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}
    missing, unexpected = peer.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.tie_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"peer weights do not match: missing {missing}, unexpected {unexpected}")
    if m.tie_embeddings:
        peer.tie_weights()
    return peer


def train_peer(config: Config, params, batch, steps: int, warmup: int) -> dict:
    """The same step in PyTorch: LlamaForCausalLM (sdpa) forward, float32 cross entropy over the same targets,
    backward, global-norm clipping, torch AdamW with our hyperparameters (weight decay on matrices only)."""
    import torch
    import torch.nn.functional as F

    m, t = config.model, config.train
    peer = build_peer(m, params).train()
    decay = [p for n, p in peer.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in peer.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.learning_rate,
        betas=(t.beta1, t.beta2),
        eps=1e-8,
    )
    tokens = torch.from_numpy(np.array(batch["tokens"])).long()
    targets = torch.from_numpy(np.array(batch["targets"])).long()
    losses = []

    def run_step():
        logits = peer(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(peer.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    times = time_steps(run_step, steps, warmup)
    return {
        "step_times_s": times,
        "first_loss": losses[0],
        "threads": torch.get_num_threads(),
        "attn_implementation": peer.config._attn_implementation,
    }


def peer_runner(peer, prompts: np.ndarray, use_cache: bool):
    import torch

    ids = torch.from_numpy(prompts).long()
    mask = torch.ones_like(ids)

    def run(k: int):
        with torch.no_grad():
            out = peer.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=k,
                min_new_tokens=k,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + k

    return run


def peer_forward(peer, prompts: np.ndarray):
    """A callable running the peer's forward pass over prompts [B, T] (the prefill a `generate` call starts with)."""
    import torch

    ids = torch.from_numpy(np.asarray(prompts)).long()

    def run():
        with torch.no_grad():
            return peer(input_ids=ids).logits

    return run
