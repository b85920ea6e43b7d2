"""Prometheus metrics of one server.

Each app gets its own CollectorRegistry, so several apps (tests, embedding)
never collide in the process-wide default registry. Engine state (running and
waiting requests, steps) is read when Prometheus scrapes, not pushed from the
MLX thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the route

# Latencies from a few ms (small models on a GPU) to minutes (long prompts on a CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self, engine=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxserve_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mlxserve_prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.cached_tokens = Counter("mlxserve_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache.", registry=r)
        self.generation_tokens = Counter("mlxserve_generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter("mlxserve_request_finished",
                                "Engine requests by how they ended (stop, length, abort, error).",
                                ["reason"], registry=r)
        self.ttft = Histogram("mlxserve_time_to_first_token_seconds",
                              "Seconds from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mlxserve_inter_token_latency_seconds",
                             "Seconds between consecutive tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mlxserve_e2e_request_latency_seconds",
                             "Seconds from arrival to the last token of a request.",
                             buckets=E2E_BUCKETS, registry=r)
        if engine is not None:
            Gauge("mlxserve_num_requests_running", "Requests in the running batch.",
                  registry=r).set_function(lambda: engine.num_running)
            Gauge("mlxserve_num_requests_waiting", "Requests queued for a slot.",
                  registry=r).set_function(lambda: engine.num_waiting)
            Gauge("mlxserve_engine_alive", "1 while the engine loop runs.",
                  registry=r).set_function(lambda: 1.0 if engine.alive else 0.0)
            Gauge("mlxserve_engine_steps", "Engine steps since start.",
                  registry=r).set_function(lambda: engine.steps)

            r.register(PrefixCacheCollector(engine))
            r.register(VisionCacheCollector(engine))
            r.register(SpeculationCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """The prefix cache's counters, read at scrape time.

    Only plain integer attributes are read: the cache belongs to the MLX
    thread, and reading an int from another thread is safe where walking its
    dicts would not be.
    """

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        pc = self.engine.prefix_cache
        if pc is None:
            return
        pool = pc.pool
        yield from _families(
            counters=[
                ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.", pc.queried_tokens),
                ("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.", pc.hit_tokens),
                ("prefix_cache_evictions", "Blocks evicted to keep the byte budget.", pool.evictions),
            ],
            gauges=[
                ("prefix_cache_bytes", "Bytes of cached blocks in memory.", pool.nbytes),
                ("prefix_cache_budget_bytes", "Byte budget of the prefix cache.", pool.budget),
                ("prefix_cache_blocks", "Cached blocks in memory.", len(pool)),
            ])
        disk = pc.disk
        if disk is not None:
            yield from _families(
                counters=[
                    ("prefix_cache_disk_reads", "Blocks read back from the disk tier.", disk.reads),
                    ("prefix_cache_disk_writes", "Blocks written to the disk tier.", disk.writes),
                    ("prefix_cache_disk_evictions", "Block files deleted to keep the disk budget.", disk.evictions),
                    ("prefix_cache_disk_faults", "Disk-tier files that could not be written or read.", disk.faults),
                    ("prefix_cache_disk_skipped", "Blocks never written: evicted from memory, or the engine "
                     "was busy for too many.", disk.skipped),
                ],
                gauges=[("prefix_cache_disk_bytes", "Bytes of block files in the disk tier.", disk.bytes)])


class VisionCacheCollector:
    """The vision-embedding cache's counters (plain ints, read at scrape time like the prefix cache's)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        vc = self.engine.vision_cache
        if vc is None:
            return
        yield from _families(
            counters=[
                ("vision_cache_hits", "Images whose embeddings came from the vision cache.", vc.hits),
                ("vision_cache_misses", "Images run through the vision tower.", vc.misses),
                ("vision_cache_evictions", "Entries evicted to keep the byte budget.", vc.evictions),
                ("vision_cache_released", "Entries dropped because the prefix cache holds their images' KV.",
                 vc.releases),
            ],
            gauges=[
                ("vision_cache_bytes", "Bytes of cached image embeddings.", vc.bytes),
                ("vision_cache_entries", "Cached images (or video frame groups).", len(vc.entries)),
            ])


class SpeculationCollector:
    """Speculative decoding's counters (plain ints, read at scrape time like the prefix cache's)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        spec = self.engine.speculation
        if spec is None:
            return
        s = spec.stats
        yield from _families(
            counters=[
                ("spec_decode_verify_passes", "Forward passes that checked draft tokens.", s.passes),
                ("spec_decode_draft_tokens", "Draft tokens proposed and checked.", s.drafted),
                ("spec_decode_accepted_tokens", "Draft tokens accepted (equal to the model's own token).",
                 s.accepted),
                ("spec_decode_emitted_tokens", "Tokens emitted by verify passes (accepted drafts plus the "
                 "model's token after them).", s.emitted),
            ],
            gauges=[("spec_decode_acceptance_rate", "Accepted / draft tokens since start.", s.acceptance_rate)])


def _families(counters, gauges):
    """Prometheus families from (name, help, value) rows."""
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value=value)
    for name, doc, value in gauges:
        yield GaugeMetricFamily(name, doc, value=value)
