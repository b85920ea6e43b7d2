"""Prometheus metrics of one server.

Each app gets its own CollectorRegistry, so several apps (tests, embedding)
never collide in the process-wide default registry. Engine state (running and
waiting requests, steps) is read when Prometheus scrapes, not pushed from the
MLX thread. With several models, engine and cache series are sums over the
loaded models (a model's counters leave the sums when it is unloaded, which
Prometheus reads as a counter reset), and `mlxserve_model_loaded` tells which
models are loaded.
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
# The first token's phases, down to a millisecond (a step's hand-over, a tiny model's prefill).
PHASE_BUCKETS = (0.001, 0.0025) + TTFT_BUCKETS
# (attribute, metric name, help) of the phases that make up the time to first token.
FIRST_TOKEN_PHASES = (
    ("queue", "mlxserve_queue_seconds",
     "Seconds from arrival (templating and tokenizing included) to admission into the running batch."),
    ("prefill", "mlxserve_prefill_seconds",
     "Seconds from admission to the end of the pass that held the prompt's last chunk."),
    ("first_step", "mlxserve_first_step_seconds",
     "Seconds from the end of prefill to the first token out of the engine step that sampled it."),
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self, engines=None, models=None):
        """`engines()`: the loaded models' engines; `models()`: (name, state) of every model."""
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
        # Where the time to first token goes: the three add up to it, request by request.
        self.phases = {attr: Histogram(name, doc, buckets=PHASE_BUCKETS, registry=r)
                       for attr, name, doc in FIRST_TOKEN_PHASES}
        self.itl = Histogram("mlxserve_inter_token_latency_seconds",
                             "Seconds between consecutive tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mlxserve_e2e_request_latency_seconds",
                             "Seconds from arrival to the last token of a request.",
                             buckets=E2E_BUCKETS, registry=r)
        if engines is not None:
            # Summed over the loaded models' engines (one series each, as with a single model).
            Gauge("mlxserve_num_requests_running", "Requests in the running batch.",
                  registry=r).set_function(lambda: sum(e.num_running for e in engines()))
            Gauge("mlxserve_num_requests_waiting", "Requests queued for a slot.",
                  registry=r).set_function(lambda: sum(e.num_waiting for e in engines()))
            Gauge("mlxserve_engine_alive", "1 while every loaded model's engine loop runs.",
                  registry=r).set_function(lambda: 1.0 if all(e.alive for e in engines()) else 0.0)
            Gauge("mlxserve_engine_steps", "Engine steps since start (of the models loaded now).",
                  registry=r).set_function(lambda: sum(e.steps for e in engines()))

            r.register(EngineCountersCollector(lambda: [e.counters() for e in engines()]))
        if models is not None:
            r.register(ModelCollector(models))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCountersCollector:
    """The caches' and speculative decoding's counters, read at scrape time from each loaded
    model's `engine.counters()` (plain numbers: the caches belong to the MLX thread, or to an
    engine process), once per scrape."""

    def __init__(self, counters):
        self.counters = counters  # () -> [engine.counters() per loaded model]

    def collect(self):
        counters = self.counters()
        yield from prefix_cache_families(counters)
        yield from vision_cache_families(counters)
        yield from speculation_families(counters)


def prefix_cache_families(counters: list[dict]):
    caches = [c["prefix_cache"] for c in counters if "prefix_cache" in c]
    if not caches:
        return
    total = _summed(caches)
    yield from _families(
        counters=[
            ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.", total["queried_tokens"]),
            ("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.", total["hit_tokens"]),
            ("prefix_cache_evictions", "Blocks evicted to keep the byte budget.", total["evictions"]),
        ],
        gauges=[
            ("prefix_cache_bytes", "Bytes of cached blocks in memory.", total["bytes"]),
            ("prefix_cache_budget_bytes", "Byte budget of the prefix cache.", total["budget"]),
            ("prefix_cache_blocks", "Cached blocks in memory.", total["blocks"]),
        ])
    disks = [c["disk"] for c in counters if "disk" in c]
    if not disks:
        return
    d = _summed([{k: v for k, v in disk.items() if k not in ("dropped", "skips")} for disk in disks])
    yield from _families(
        counters=[
            ("prefix_cache_disk_reads", "Blocks read back from the disk tier.", d["reads"]),
            ("prefix_cache_disk_writes", "Blocks written to the disk tier.", d["writes"]),
            ("prefix_cache_disk_evictions", "Block files deleted to keep the disk budget.", d["evictions"]),
            ("prefix_cache_disk_faults", "Blocks the disk tier could not copy or write.", d["faults"]),
            ("prefix_cache_disk_written_bytes", "Bytes of block files written.", d["written_bytes"]),
            ("prefix_cache_disk_write_wait_seconds", "Time the writer waited for --disk-cache-write-rate.",
             d["write_wait_s"]),
            ("prefix_cache_disk_abandoned_tmp", "Temporary files of writes cut short (a crash), "
             "deleted at start.", d["abandoned"]),
        ],
        gauges=[("prefix_cache_disk_bytes", "Bytes of block files in the disk tier.", d["bytes"])])
    dropped = CounterMetricFamily("prefix_cache_disk_dropped",
                                  "Block files deleted instead of served: damaged (checksum mismatch), "
                                  "unreadable, old_format (no checksum).", labels=["reason"])
    for reason, n in _summed([disk["dropped"] for disk in disks]).items():
        dropped.add_metric([reason], n)
    yield dropped
    skipped = CounterMetricFamily("prefix_cache_disk_skipped",
                                  "Blocks never written, by why: backlog (more waiting than the writer "
                                  "keeps up with), orphan (its parent was not written), evicted (left memory "
                                  "before its turn), daily_budget (--disk-cache-daily-writes spent).",
                                  labels=["reason"])
    for reason, n in _summed([disk["skips"] for disk in disks]).items():
        skipped.add_metric([reason], n)
    yield skipped


def vision_cache_families(counters: list[dict]):
    vcs = [c["vision_cache"] for c in counters if "vision_cache" in c]
    if not vcs:
        return
    v = _summed(vcs)
    yield from _families(
        counters=[
            ("vision_cache_hits", "Images whose embeddings came from the vision cache.", v["hits"]),
            ("vision_cache_misses", "Images run through the vision tower.", v["misses"]),
            ("vision_cache_evictions", "Entries evicted to keep the byte budget.", v["evictions"]),
            ("vision_cache_released", "Entries dropped because the prefix cache holds their images' KV.",
             v["releases"]),
        ],
        gauges=[
            ("vision_cache_bytes", "Bytes of cached image embeddings.", v["bytes"]),
            ("vision_cache_entries", "Cached images (or video frame groups).", v["entries"]),
        ])


def _summed(rows: list[dict]) -> dict:
    """Key by key sums of dicts of numbers (one per loaded model)."""
    total: dict = {}
    for row in rows:
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    return total


class ModelCollector:
    """1 for each model that is loaded, 0 for the others (by name)."""

    def __init__(self, models):
        self.models = models

    def collect(self):
        family = GaugeMetricFamily("mlxserve_model_loaded", "1 while the model is loaded.", labels=["model"])
        for name, state in self.models():
            family.add_metric([name], 1.0 if state == "loaded" else 0.0)
        yield family


def speculation_families(counters: list[dict]):
    stats = [c["speculation"] for c in counters if "speculation" in c]
    if not stats:
        return
    from mlxserve.engine.speculative import SpecStats

    s = SpecStats.summed(stats)  # over the loaded models, as the other series
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
