"""engine layer of splash_rollout (see DESIGN.md §2, §4).

``page_manager`` (page ids, reservations) → ``kv_pool`` (paged latent KV per layer) →
``attention/`` (backends over paged KV; ``torch_ref`` is the reference) → ``executors/`` (how one
attention layer runs under a layout; ``single`` is the single-rank oracle) → ``model_runner`` (the
layer loop) → ``sampler`` → ``scheduler`` (admission, chunked prefill, continuous batching) →
``engine`` (the step loop: schedule → run → postprocess).
"""
