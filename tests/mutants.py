"""The curated mutants of the mutation check (launch/mutation.sh, launch/mutation.py).

Each is one realistic bug: `old` (which must occur exactly once in `file`) replaced by `new`, and `tests`, the
narrow selection of pytest node ids that should catch it (each run with -x in a copy of the repository, so a
mutant costs about a minute on a busy 2-core machine). When code moves and a snippet no longer applies, the check
reports it: update the snippet, never drop the mutant. A new capability adds its mutants here. Every catcher runs
without torch (the Hugging Face mutants need safetensors, of the interop extra, which launch/mutation.sh installs).

Not a test module (no test_ prefix): pytest does not collect it.
"""

K = "tests/test_mutation_kills.py::"  # the tests written for issue 21
M = "tests/test_model.py::"
C = "tests/test_cache.py::"
O = "tests/test_optimizers.py::"  # noqa: E741

MUTANTS = [
    # ---- the mask ------------------------------------------------------------------------------------------------
    dict(
        name="mask-hides-own-token",
        file="causal_lm/model/mask.py",
        old="visible & (key_pos[:, None, :] <= query_pos[:, :, None])",
        new="visible & (key_pos[:, None, :] < query_pos[:, :, None])",
        tests=[K + "test_each_query_sees_its_own_position_in_the_mask", K + "test_a_lone_query_attends_to_its_own_key"],
        why="a token cannot see itself (< for <=)",
    ),
    dict(
        name="mask-sees-next-token",
        file="causal_lm/model/mask.py",
        old="visible & (key_pos[:, None, :] <= query_pos[:, :, None])",
        new="visible & (key_pos[:, None, :] <= query_pos[:, :, None] + 1)",
        tests=[M + "test_no_leak_from_the_future[gqa-rope_full]"],
        why="each query sees one future token",
    ),
    dict(
        name="mask-value-inf",
        file="causal_lm/model/kernels.py",
        old="MASK_VALUE = -1e30",
        new='MASK_VALUE = float("-inf")',
        tests=[M + "test_fully_masked_row_is_zero_not_nan"],
        why="-inf as the mask value: a row with no visible key becomes NaN",
    ),
    dict(
        name="window-off-by-one",
        file="causal_lm/model/mask.py",
        old="within = (query_pos[:, :, None] - key_pos[:, None, :]) < window",
        new="within = (query_pos[:, :, None] - key_pos[:, None, :]) <= window",
        tests=["tests/test_sliding_window.py::test_make_mask_window"],
        why="a sliding window of W sees W + 1 keys",
    ),
    # ---- attention maths ---------------------------------------------------------------------------------------
    dict(
        name="score-scale-model-dim",
        file="causal_lm/config.py",
        old="return self.head_dim**-0.5 if self.attn_scale is None",
        new="return self.d_model**-0.5 if self.attn_scale is None",
        tests=[K + "test_first_layer_attention_weights_by_hand"],
        why="scores scaled by 1/sqrt(d_model) instead of 1/sqrt(head_dim)",
    ),
    dict(
        name="gqa-heads-major-mapping",
        file="causal_lm/model/kernels.py",
        old="return q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)",
        new="return q.reshape(B, T, N // K, K, H).transpose(0, 3, 2, 1, 4)",
        tests=["tests/test_kernels.py::test_every_kernel_equals_the_reference[causal-72-gqa]"],
        why="query head n reads KV head n % K instead of n // G (heads-major kernel)",
    ),
    dict(
        name="gqa-reference-mapping",
        file="causal_lm/model/kernels.py",
        old="qg = q.reshape(B, T, K, N // K, H)",
        new="qg = q.reshape(B, T, N // K, K, H).swapaxes(2, 3)",
        tests=[K + "test_first_layer_attention_weights_by_hand"],
        why="the reference kernel's scores pair query head n with KV head n % K",
    ),
    dict(
        name="sink-not-in-denominator",
        file="causal_lm/model/kernels.py",
        old="denom = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - row_max)",
        new="denom = jnp.sum(e, axis=-1, keepdims=True)",
        tests=[M + "test_sink_share_matches_reference"],
        why="the sink logit dropped from the softmax denominator",
    ),
    dict(
        name="blocked-attention-rows",
        file="causal_lm/model/kernels.py",
        old="mask.visible[:, i:e, :e],",
        new="mask.visible[:, : e - i, :e],",
        tests=["tests/test_kernels.py::test_every_kernel_equals_the_reference[causal-72-mha]"],
        why="the blocked kernel masks every query block with the first block's rows",
    ),
    dict(
        name="norm-eps-hard-coded",
        file="causal_lm/model/layers.py",
        old="self.eps = eps",
        new="self.eps = 1e-6",
        tests=[K + "test_first_layer_attention_weights_by_hand"],
        why="RMSNorm ignores model.norm_eps",
    ),
    # ---- RoPE --------------------------------------------------------------------------------------------------
    dict(
        name="rope-sign",
        file="causal_lm/model/rope.py",
        old="return jnp.concatenate([-y[..., half:], y[..., :half]], axis=-1)",
        new="return jnp.concatenate([y[..., half:], -y[..., :half]], axis=-1)",
        tests=[K + "test_rope_turns_a_unit_vector_by_the_known_angle"],
        why="rotate-half with its sign flipped (rotation by minus the angle)",
    ),
    dict(
        name="rope-slice",
        file="causal_lm/model/rope.py",
        old="rot = x[..., :rope_dim].astype(jnp.float32)\n    out = (",
        new="rot = x[..., -rope_dim:].astype(jnp.float32)\n    out = (",
        tests=[K + "test_rope_turns_a_unit_vector_by_the_known_angle"],
        why="partial RoPE rotates the last dims instead of the first",
    ),
    dict(
        name="rope-rotates-v",
        file="causal_lm/model/attention.py",
        old="            k = apply_rope(k, cos, sin)\n        return k, v",
        new="            k, v = apply_rope(k, cos, sin), apply_rope(v, cos, sin)\n        return k, v",
        tests=[K + "test_logits_depend_on_relative_positions_only[gqa-rope]"],
        why="V rotated as well as K (RoPE in the wrong place)",
    ),
    dict(
        name="rope-position-offset",
        file="causal_lm/model/rope.py",
        old="angles = positions.astype(jnp.float32)[..., None]",
        new="angles = (positions + 1).astype(jnp.float32)[..., None]",
        tests=[K + "test_rope_turns_a_unit_vector_by_the_known_angle"],
        why="the rotation tables built for positions off by one",
    ),
    dict(
        name="mla-rope-key-unrotated",
        file="causal_lm/model/mla.py",
        old="rope_key = apply_rope(rope_key[:, :, None, :], cos, sin)[:, :, 0, :]",
        new="rope_key = rope_key[:, :, None, :][:, :, 0, :]",
        tests=[K + "test_logits_depend_on_relative_positions_only[mla]"],
        why="MLA's shared rope key left unrotated while its queries turn",
    ),
    # ---- the KV cache ------------------------------------------------------------------------------------------
    dict(
        name="cache-slot-late",
        file="causal_lm/model/kv_cache.py",
        old="slot = jnp.where(keep, pos, C + t[None, :])",
        new="slot = jnp.where(keep, pos + 1, C + t[None, :])",
        tests=[K + "test_a_cache_filled_to_its_last_slot_equals_recompute"],
        why="a global layer writes each token one slot late (the last slot's token dropped)",
    ),
    dict(
        name="cache-length-counts-padding",
        file="causal_lm/model/kv_cache.py",
        old="new_lengths=self.lengths + n_valid,",
        new="new_lengths=self.lengths + T,",
        tests=[C + "test_ragged_batch_equals_each_prompt_alone", C + "test_ragged_prefill_lengths_are_per_row"],
        why="a row's cached length grows by the padded chunk, not its real tokens",
    ),
    dict(
        name="ring-does-not-wrap",
        file="causal_lm/model/kv_cache.py",
        old="slot = jnp.where(keep, pos % C, C + t[None, :])",
        new="slot = jnp.where(keep, jnp.minimum(pos, C - 1), C + t[None, :])",
        tests=["tests/test_sliding_window.py::test_cache_equals_recompute[local-global]"],
        why="a sliding-window ring clamps at its last slot instead of wrapping",
    ),
    dict(
        name="rollback-keeps-length",
        file="causal_lm/model/kv_cache.py",
        old="return dataclasses.replace(self, groups=groups, lengths=lengths)",
        new="return dataclasses.replace(self, groups=groups, lengths=self.lengths)",
        tests=[C + "test_rollback_then_decode_equals_never_having_seen_the_tokens[gqa-gate-sink]"],
        why="a rollback empties the slots but leaves the rows' lengths",
    ),
    dict(
        name="int8-read-without-scale",
        file="causal_lm/model/kv_cache.py",
        old='return x.astype(jnp.float32) * group.arrays[name + "_scale"][i][..., None]',
        new="return x.astype(jnp.float32)",
        tests=[K + "test_int8_cache_reads_back_what_was_written"],
        why="a quantized cache read back without its per-token scales",
    ),
    # ---- generation and sampling -------------------------------------------------------------------------------
    dict(
        name="recompute-uses-cache",
        file="causal_lm/decode/generate.py",
        old="        graphdef=graphdef,\n        use_cache=use_cache,\n        chunk=chunk,",
        new="        graphdef=graphdef,\n        use_cache=True,\n        chunk=chunk,",
        tests=[K + "test_the_recompute_path_runs_the_model_over_the_whole_sequence"],
        why="generate(use_cache=False) silently decodes through the cache",
    ),
    dict(
        name="top-k-drops-kth",
        file="causal_lm/decode/sampling.py",
        old="scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)",
        new="scaled = jnp.where((top_k > 0) & (scaled <= kth), -jnp.inf, scaled)",
        tests=[C + "test_top_k_keeps_exactly_the_k_most_likely"],
        why="top-k keeps k - 1 tokens",
    ),
    dict(
        name="top-p-drops-crossing-token",
        file="causal_lm/decode/sampling.py",
        old="keep = (before < top_p) | (jnp.arange(V) == 0)",
        new="keep = (before + probs < top_p) | (jnp.arange(V) == 0)",
        tests=[C + "test_top_p_keeps_the_token_that_crosses_the_threshold"],
        why="top-p drops the token whose probability crosses the threshold",
    ),
    dict(
        name="speculative-accepts-non-leading",
        file="causal_lm/decode/speculative.py",
        old="a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)",
        new="a = jnp.sum(ok.astype(jnp.int32), axis=1)",
        tests=[
            "tests/test_speculative.py::test_rows_accept_different_counts",
            "tests/test_speculative.py::test_greedy_speculation_equals_plain_decoding_over_the_grid[gqa-rope_full]",
        ],
        why="speculation counts every agreeing draft, not the leading run",
    ),
    dict(
        name="speculative-acceptance-ratio-inverted",
        file="causal_lm/decode/speculative.py",
        old="u * q_d < p_d",
        new="u * p_d < q_d",
        tests=[
            "tests/test_speculative.py::test_speculative_sampling_has_the_distribution_of_plain_sampling[draft-temperature]"
        ],
        why="a draft token accepted with probability q/p instead of p/q",
    ),
    # ---- training ----------------------------------------------------------------------------------------------
    dict(
        name="decay-mask-everything",
        file="causal_lm/train/state.py",
        old="return not any(_NO_DECAY_NAME.match(str(k)) for k in path)",
        new="return True",
        tests=[O + "test_decay_mask_names_which_parameters_decay"],
        why="weight decay on norm gains, biases and sink logits",
    ),
    dict(
        name="warmup-off-by-one",
        file="causal_lm/train/state.py",
        old="s = jnp.asarray(count, jnp.float32) + 1.0",
        new="s = jnp.asarray(count, jnp.float32)",
        tests=[O + "test_learning_rate_schedule_exact_values"],
        why="the first update gets learning rate 0 (warmup one step late)",
    ),
    dict(
        name="clip-per-element",
        file="causal_lm/train/state.py",
        old='parts.append(optax.clip_by_global_norm(hp["grad_clip"]))',
        new='parts.append(optax.clip(hp["grad_clip"]))',
        tests=[K + "test_gradient_clipping_scales_the_whole_gradient_by_its_global_norm"],
        why="gradients clipped element by element instead of by their global norm",
    ),
    dict(
        name="microbatches-keep-last",
        file="causal_lm/train/step.py",
        old="return (jax.tree.map(jnp.add, g_acc, g), loss_acc + loss",
        new="return (g, loss_acc + loss",
        tests=["tests/test_train.py::test_microbatches_equal_one_big_batch"],
        why="gradient accumulation keeps only the last microbatch's gradient",
    ),
    dict(
        name="non-finite-step-applied",
        file="causal_lm/train/step.py",
        old="params=keep(params, state.params),",
        new="params=params,",
        tests=[O + "test_microbatches_and_non_finite_halt_for_every_optimizer[adamw+z_loss+bf16_state]"],
        why="a non-finite step's update is applied to the parameters",
    ),
    dict(
        name="resume-forgets-rng",
        file="causal_lm/train/loop.py",
        old="state = dataclasses.replace(state, params=params, **train_state)",
        new='state = dataclasses.replace(state, params=params, **{k: v for k, v in train_state.items() if k != "rng"})',
        tests=[K + "test_a_resumed_run_ends_bitwise_where_the_straight_run_did"],
        why="a resumed run restarts its RNG from the seed",
    ),
    dict(
        name="resume-skips-data-state",
        file="causal_lm/train/loop.py",
        old='if meta.get("data_state") is not None:',
        new="if False:",
        tests=[K + "test_a_resumed_run_ends_bitwise_where_the_straight_run_did"],
        why="a resumed run reads its data from the first batch again",
    ),
    dict(
        name="resume-data-from-epoch-start",
        file="causal_lm/data/pipeline.py",
        old='self.epoch, self.index = int(state["epoch"]), int(state["index"])',
        new='self.epoch, self.index = int(state["epoch"]), 0',
        tests=["tests/test_data.py::test_iterator_reshuffles_each_epoch_and_resumes_exactly"],
        why="a resumed data iterator restarts at the beginning of its epoch",
    ),
    # ---- checkpoints and Hugging Face ----------------------------------------------------------------------------
    dict(
        name="restore-skips-shape-check",
        file="causal_lm/train/checkpoint.py",
        old='bad = shape_mismatches(meta.get("param_shapes", {}), param_shapes(abstract_params))',
        new="bad = []",
        tests=["tests/test_checkpoint.py::test_restore_into_another_architecture_names_the_parameters"],
        why="a checkpoint restored into another architecture without our shape check",
    ),
    dict(
        name="hf-o-proj-not-transposed",
        file="causal_lm/interop/hf.py",
        old="lambda w, c: w.T.reshape(N, H, D),",
        new="lambda w, c: w.reshape(N, H, D),",
        tests=[K + "test_hf_layout_written_by_hand_loads_to_the_same_model"],
        why="o_proj loaded without its transpose",
    ),
    dict(
        name="hf-bias-layout",
        file="causal_lm/interop/hf.py",
        old="lambda w, c, heads=heads: w.reshape(heads, H),",
        new="lambda w, c, heads=heads: w.reshape(H, heads).T,",
        tests=[K + "test_hf_layout_written_by_hand_loads_to_the_same_model"],
        why="Qwen2's q/k/v biases loaded head-minor",
    ),
    dict(
        name="splash-window-off-by-one",
        file="causal_lm/model/backends.py",
        old="sm.LocalMask((T, T), window_size=(window - 1, 0)",
        new="sm.LocalMask((T, T), window_size=(window, 0)",
        tests=["tests/test_kernels.py::test_splash_equals_the_reference"],
        why="the splash kernel's local mask sees one key more than the position mask's window",
    ),
    dict(
        name="remat-minimal-saves-nothing",
        file="causal_lm/model/transformer.py",
        old="return jax.checkpoint_policies.save_only_these_names(*SAVED_PROJECTIONS)",
        new="return jax.checkpoint_policies.nothing_saveable",
        tests=["tests/test_model.py::test_remat_policies_give_the_gradients_of_no_remat"],
        why="remat=minimal silently behaves as full (the projections are recomputed, not saved)",
    ),
]
