"""Prometheus exposition for ``GET /metrics``: the scheduler's running totals, read at scrape time
by a collector (so the engine thread never touches prometheus-client), plus HTTP request counts.
One registry per app, so several servers in one process (tests) do not collide."""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qk.scheduler import Scheduler

__all__ = ["Metrics"]


class Metrics(Collector):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self._requests[(route, str(status))] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        s = self.scheduler
        st = s.stats

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("qk_prompt_tokens", "Prompt tokens prefilled", st.prompt_tokens)
        yield counter("qk_prompt_seconds", "Seconds spent in prefill", st.prompt_seconds)
        yield counter("qk_generated_tokens", "Tokens generated", st.generated_tokens)
        yield counter("qk_decode_seconds", "Seconds spent in decode steps", st.decode_seconds)
        yield counter("qk_decode_steps", "Multi-slot decode steps", st.decode_steps)
        yield gauge(
            "qk_prefill_tokens_per_second",
            "Mean prefill rate since start",
            st.prompt_tokens / st.prompt_seconds if st.prompt_seconds else 0.0,
        )
        yield gauge(
            "qk_decode_tokens_per_second",
            "Mean aggregate decode rate since start (all slots)",
            st.decode_slot_steps / st.decode_seconds if st.decode_seconds else 0.0,
        )
        yield gauge(
            "qk_decode_batch_mean",
            "Mean slots advanced per decode step",
            st.decode_slot_steps / st.decode_steps if st.decode_steps else 0.0,
        )
        table = s.reuse
        if table is not None:
            rs = table.stats
            yield gauge("qk_reuse_entries", "State snapshots held for cross-turn reuse", table.entries)
            yield gauge("qk_reuse_bytes", "GPU bytes the reuse snapshots hold", table.bytes)
            yield counter("qk_reuse_hits", "Prompts that started from a saved state", rs.hits)
            yield counter("qk_reuse_misses", "Prompts with no saved prefix", rs.misses)
            yield counter("qk_reuse_tokens", "Prompt tokens restored instead of prefilled", rs.reused_tokens)
            yield counter("qk_reuse_saves", "State snapshots saved", rs.saved)
            yield counter("qk_reuse_evictions", "Snapshots evicted to stay within bounds", rs.evicted)
        yield counter("qk_reuse_errors", "Snapshot saves or loads that failed", st.reuse_errors)
        yield gauge("qk_requests_queued", "Requests waiting for a slot", s.queued)
        yield gauge("qk_slots_busy", "Slots generating or prefilling", s.busy_slots)
        yield gauge("qk_slots_total", "Slots the engine holds", s.n_slots)
        yield gauge("qk_ready", "1 when the engine serves requests", 1.0 if s.ready else 0.0)
        yield from self._stages()
        finished = CounterMetricFamily("qk_generations", "Generations ended, by reason", labels=["reason"])
        for reason, n in sorted(st.finished.items()):
            finished.add_metric([reason], n)
        yield finished
        requests = CounterMetricFamily(
            "qk_http_requests", "HTTP requests answered", labels=["route", "status"]
        )
        with self._lock:
            items = sorted(self._requests.items())
        for (route, status), n in items:
            requests.add_metric([route, status], n)
        yield requests

    def _stages(self):
        """A split head's view of each pipeline stage."""
        driver = self.scheduler.driver
        health = driver.health() if driver is not None else None
        if health is None or health.chain is None:
            return
        up = GaugeMetricFamily("qk_stage_up", "1 while the stage is reachable", labels=["stage", "layers"])
        for st in health.stages:
            layers = "" if st["layers"] is None else f"{st['layers'][0]}:{st['layers'][1]}"
            up.add_metric([st["name"], layers], 1.0 if st["up"] else 0.0)
        yield up
        chain = health.chain
        yield CounterMetricFamily(
            "qk_chain_sessions", "Sessions established with the chain", value=chain["sessions"]
        )
        if chain["rtt_seconds"] is not None:
            yield GaugeMetricFamily(
                "qk_chain_ping_seconds",
                "Latest idle ping through the whole chain",
                value=chain["rtt_seconds"],
            )
        if chain["step_rtt_seconds"] is not None:
            yield GaugeMetricFamily(
                "qk_chain_step_seconds",
                "Latest decode step's round trip through the chain after the head",
                value=chain["step_rtt_seconds"],
            )
