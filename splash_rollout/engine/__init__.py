"""engine layer of splash_rollout.

``page_manager`` (page ids, reservations) → ``kv_pool`` (paged latent KV per layer) →
``attention/`` (backends over paged KV; ``torch`` batched, ``torch_ref`` the reference) → ``executors/`` (how one
attention layer runs under a layout; ``single`` is the single-rank oracle) → ``model_runner`` (the
layer loop) → ``sampler`` → ``scheduler`` (admission, chunked prefill, continuous batching) →
``block_table`` (a rank's page tables on its device) → ``forward_batch`` → ``step_control`` (the
driver's per-step message) → ``layout_driver`` (the driver's layout choice) → ``switch_step`` →
``engine`` (one engine for any T: the step loop, the same on every rank).
"""
