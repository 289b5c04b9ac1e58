"""``/metrics``: the server and its engine in Prometheus' text format, read at scrape time.

Gauges come from each replica's serving loop after its last poll (running and queued requests, KV
pages in use, cached and in all per rank, the current layout); counters from what the loops and the
server have counted since they started (steps, switches, generated tokens, prompt tokens taken from
the prefix cache, requests by outcome); ``splash_tokens_per_second`` is the rate over a loop's last
64 steps. Every engine series carries a ``replica`` label (one engine: "0"), so a fleet's replicas
sit side by side and ``sum by`` gives the fleet; histograms of each completed request's time to first token and end-to-end latency, as the
server saw them (from the request's body read to its first token / its last). Rendered with
prometheus-client's exposition format (the ``serve`` extra).
"""
from __future__ import annotations

from splash_rollout.rollout.serving_loop import RATE_STEPS

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
    """Every replica's state (one engine: replica "0") and the server's counters, in the text format."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    states = server.backend.replica_states()

    def per_replica(kind, name: str, doc: str, value_of, *extra: str) -> None:
        """One series per replica (and per value of ``extra`` labels: ``value_of`` then yields
        (labels, value) pairs)."""
        metric = kind(name, doc, ["replica", *extra], registry=registry)
        for state in states:
            replica = str(state["replica"])
            pairs = value_of(state) if extra else [((), value_of(state))]
            for labels, value in pairs:
                child = metric.labels(replica, *labels)
                child.inc(value) if kind is Counter else child.set(value)

    per_replica(Gauge, "splash_requests_running", "Requests the engine runs now", lambda s: s["running"])
    per_replica(Gauge, "splash_requests_waiting", "Requests queued in the engine", lambda s: s["waiting"])
    per_replica(Gauge, "splash_requests_in_flight", "Requests submitted and not ended", lambda s: s["in_flight"])
    for what in ("used", "cached", "total"):
        per_replica(Gauge, f"splash_kv_pages_{what}", f"KV pages {what} per rank",
                    lambda s, what=what: [((str(rank),), pages) for rank, pages in enumerate(s[f"pages_{what}"])],
                    "rank")
    per_replica(Gauge, "splash_layout", "The attention layout the engine runs (1 for the current one)",
                lambda s: [((s["layout"],), 1)], "layout")
    per_replica(Gauge, "splash_tokens_per_second", f"Tokens written per second over the last {RATE_STEPS} steps",
                lambda s: s["tokens_per_second"])
    per_replica(Gauge, "splash_weight_version", "The weight version tokens are sampled under",
                lambda s: s["weight_version"])
    per_replica(Counter, "splash_steps", "Engine steps served by the loop", lambda s: s["total_steps"])
    per_replica(Counter, "splash_switches", "Layout switches", lambda s: s["switches"])
    per_replica(Counter, "splash_generated_tokens", "Tokens handed to finished requests", lambda s: s["tokens_out"])
    per_replica(Counter, "splash_prompt_tokens_computed", "Prompt tokens prefilled (not taken from a cache)",
                lambda s: s["prefill_rows"])
    per_replica(Counter, "splash_prefix_cache_hit_tokens",
                "Prompt tokens taken from the prefix cache instead of computed", lambda s: s["cached_tokens"])
    requests = Counter("splash_http_requests", "HTTP requests by outcome", ["outcome"], registry=registry)
    for outcome, n in server.requests_total.items():
        requests.labels(outcome=outcome).inc(n)
    return generate_latest(registry) + generate_latest(server.latency.registry)
