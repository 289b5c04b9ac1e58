"""``/metrics``: the server and its engine in Prometheus' text format, read at scrape time.

Gauges come from the serving loop's view after its last poll (running and queued requests, KV pages
in use, cached and in all per rank, the current layout); counters from what the loop and the server
have counted since they started (steps, switches, generated tokens, prompt tokens taken from the
prefix cache, requests by outcome); ``splash_tokens_per_second`` is the rate over the loop's last
64 steps; histograms of each completed request's time to first token and end-to-end latency, as the
server saw them (from the request's body read to its first token / its last). Rendered with
prometheus-client's exposition format (the ``serve`` extra).
"""
from __future__ import annotations

RECENT_STEPS = 64
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RequestLatency:
    """Per-request latency histograms kept for the server's life (the rest of ``/metrics`` is read
    from the engine at scrape time)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        self._ttft = Histogram("splash_time_to_first_token_seconds", "Request received to its first token",
                               buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._e2e = Histogram("splash_e2e_request_latency_seconds", "Request received to its last token",
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def finished(self, seconds: float) -> None:
        self._e2e.observe(seconds)


def render_metrics(server) -> bytes:
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    engine, loop = server.engine, server.engine._loop
    state = loop.log.state if loop is not None else {}
    steps = loop.log.steps if loop is not None else []

    def gauge(name: str, doc: str, value: float, **labels) -> None:
        g = Gauge(name, doc, list(labels), registry=registry)
        (g.labels(**labels) if labels else g).set(value)

    def counter(name: str, doc: str, value: float) -> None:
        Counter(name, doc, registry=registry).inc(value)

    gauge("splash_requests_running", "Requests the engine runs now", state.get("running", 0))
    gauge("splash_requests_waiting", "Requests queued in the engine", state.get("waiting", 0))
    gauge("splash_requests_in_flight", "Requests submitted and not ended", loop.in_flight if loop is not None else 0)
    for what in ("used", "cached", "total"):
        g = Gauge(f"splash_kv_pages_{what}", f"KV pages {what} per rank", ["rank"], registry=registry)
        for rank, pages in enumerate(state.get(f"pages_{what}", [])):
            g.labels(rank=str(rank)).set(pages)
    layout = Gauge("splash_layout", "The attention layout the engine runs (1 for the current one)", ["layout"],
                   registry=registry)
    layout.labels(layout=state.get("layout", engine.config.parallel.layout)).set(1)
    recent = steps[-RECENT_STEPS:]
    seconds = sum(s["seconds"] for s in recent)
    gauge("splash_tokens_per_second", f"Tokens written per second over the last {RECENT_STEPS} steps",
          sum(s["tokens_written"] for s in recent) / seconds if seconds > 0 else 0.0)
    gauge("splash_weight_version", "The weight version tokens are sampled under", engine.weight_version)
    totals = loop.log.totals if loop is not None else {}
    counter("splash_steps", "Engine steps served by the loop", loop.log.total_steps if loop is not None else 0)
    counter("splash_switches", "Layout switches", totals.get("switches", 0))
    counter("splash_generated_tokens", "Tokens handed to finished requests", loop.tokens_out if loop is not None else 0)
    counter("splash_prompt_tokens_computed", "Prompt tokens prefilled (not taken from a cache)",
            totals.get("prefill_rows", 0))
    counter("splash_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache instead of computed",
            totals.get("cached_tokens", 0))
    requests = Counter("splash_http_requests", "HTTP requests by outcome", ["outcome"], registry=registry)
    for outcome, n in server.requests_total.items():
        requests.labels(outcome=outcome).inc(n)
    return generate_latest(registry) + generate_latest(server.latency.registry)
