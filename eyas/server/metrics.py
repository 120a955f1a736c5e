"""Prometheus metrics of a server, under the ``eyas:`` prefix with vLLM's names where vLLM has one.
Every series of a known label set (the model, each finish reason) is exported from the start, at zero.

The engine thread calls ``observe_step`` after every step; ``/metrics`` calls ``render`` with the
loop's snapshot. Counters that mirror engine totals (preemptions, speculation) advance by the
difference from the totals seen last time, so they are exact whatever the scrape rate.

Example: a step verifies 3 drafts for one request and accepts 2, another step 3 and accepts 0:
``spec_decode_num_drafts`` 2, ``spec_decode_num_draft_tokens`` 6, ``spec_decode_num_accepted_tokens``
2, ``spec_decode_num_accepted_tokens_per_pos{position="0"}`` 1, ``{position="1"}`` 1, ``{position="2"}`` 0.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eyas.engine.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0, 640.0)
TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 10.0)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()  # the engine thread writes, /metrics reads
        label = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"eyas:{name}", doc, label + list(extra), registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"eyas:{name}", doc, label, buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"eyas:{name}", doc, label, registry=self.registry)

        self.model_name = model_name
        self.request_success = counter("request_success", "Finished requests, by finish reason", ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of started requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first",
                              TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)")
        self.preemptions = counter("num_preemptions", "Requests preempted (their KV blocks taken back)")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verification steps that carried drafts")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft", ("position",))
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, self.running,
                       self.waiting, self.kv_usage, self.preemptions, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted):
            metric.labels(model_name)  # exported as zeros from the start, as vLLM does
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self._spec_seen = {"num_steps": 0, "num_drafted": 0, "num_accepted": 0, "accepted_per_position": []}
        self._preemptions_seen = 0
        self._tokens_seen: dict[str, int] = {}  # request id -> generated tokens counted so far

    def observe_step(self, outputs: list[RequestOutput], spec: dict) -> None:
        """Token counts and, for finished requests, finish reasons and latencies; speculation totals."""
        with self._lock:
            model = self.model_name
            for out in outputs:
                generated = sum(len(c.token_ids) for c in out.outputs)
                seen = self._tokens_seen.get(out.request_id)
                if seen is None:
                    self.prompt_tokens.labels(model).inc(len(out.prompt_token_ids))
                    seen = 0
                self.generation_tokens.labels(model).inc(generated - seen)
                self._tokens_seen[out.request_id] = generated
                if out.finished:
                    del self._tokens_seen[out.request_id]
                    self._finished(out)
            self._advance(spec)

    def _finished(self, out: RequestOutput) -> None:
        model, m = self.model_name, out.metrics
        for completion in out.outputs:
            self.request_success.labels(model, completion.finish_reason or "abort").inc()
        if m.time_to_first_token is not None:
            self.ttft.labels(model).observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.tpot.labels(model).observe(m.time_per_output_token)
        if m.finish_time is not None:
            self.e2e.labels(model).observe(m.finish_time - m.arrival_time)

    def _advance(self, spec: dict) -> None:
        model, seen = self.model_name, self._spec_seen
        self.spec_drafts.labels(model).inc(spec.get("num_steps", 0) - seen["num_steps"])
        self.spec_draft_tokens.labels(model).inc(spec.get("num_drafted", 0) - seen["num_drafted"])
        self.spec_accepted.labels(model).inc(spec.get("num_accepted", 0) - seen["num_accepted"])
        per_pos = spec.get("accepted_per_position", [])
        for i, total in enumerate(per_pos):
            before = seen["accepted_per_position"][i] if i < len(seen["accepted_per_position"]) else 0
            self.spec_accepted_per_pos.labels(model, str(i)).inc(total - before)
        self._spec_seen = {"num_steps": spec.get("num_steps", 0), "num_drafted": spec.get("num_drafted", 0),
                           "num_accepted": spec.get("num_accepted", 0), "accepted_per_position": list(per_pos)}

    def render(self, snapshot) -> bytes:
        """The Prometheus text exposition, gauges set from the engine loop's snapshot."""
        with self._lock:
            model = self.model_name
            self.running.labels(model).set(snapshot.num_running)
            self.waiting.labels(model).set(snapshot.num_waiting)
            self.kv_usage.labels(model).set(snapshot.kv_usage)
            self.preemptions.labels(model).inc(snapshot.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = snapshot.num_preemptions
            return generate_latest(self.registry)
