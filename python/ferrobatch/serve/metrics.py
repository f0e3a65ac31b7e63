"""Prometheus metrics (prefix `ferrobatch_`, or vLLM's `vllm:` with `serve --vllm-metric-names`),
in a registry of their own per server.

Counters and histograms are fed by the engine's observer hooks; gauges and the scheduler's own
cumulative counters (preemptions, prefix cache) are read from the engine's latest step snapshot
at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ferrobatch.engine.observer import EngineObserver, FinishedRequest

TTFT_BUCKETS = (.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10, 20,
                40, 80, 160, 640, 2560)
ITL_BUCKETS = (.01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
LATENCY_BUCKETS = (.3, .5, .8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960,
                   1920, 7680)
FINISH_REASONS = ("stop", "length", "abort", "error")
HTTP_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)
UNMATCHED = "<unmatched>"          # the handler label of a path no route serves (bounded labels)
CLIENT_CLOSED = 499                # the status label of a request whose client left first
# probes and scrapes are not traffic (as vLLM leaves them out of its HTTP metrics)
HTTP_UNCOUNTED = frozenset({"/metrics", "/health", "/ready", "/ping", "/health_generate",
                            "/version", "/"})
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for per-request token counts)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class _SchedulerCollector:
    def __init__(self, engine: Any, model: str, prefix: str) -> None:
        self._engine = engine
        self._model = model
        self._prefix = prefix

    def collect(self) -> Iterable[Any]:
        s = self._engine.stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{self._prefix}{name}", doc, labels=labels)
            g.add_metric([self._model], float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{self._prefix}{name}", doc, labels=labels)
            c.add_metric([self._model], float(value))
            return c

        yield gauge("num_requests_running", "Requests with sequences in the running batch.",
                    s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    max(s.get("num_waiting", 0), s.get("num_unscheduled_requests", 0)))
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                    s.get("kv_cache_usage", 0.0))
        yield counter("num_preemptions", "Preemptions since start.",
                      s.get("num_preemptions_total", 0))
        # readiness probes are not traffic: their (one-token) prompts are not counted
        probe_queries = s.get("num_probe_prompt_tokens_total", 0) if s.get(
            "prefix_cache_queries_total", 0) else 0
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queries_total", 0) - probe_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hits_total", 0))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed by prompt lookup "
                      "and checked by the model (speculative decoding).",
                      s.get("num_draft_tokens_total", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the model agreed with "
                      "(each one a token without a step of its own).",
                      s.get("num_accepted_tokens_total", 0))
        yield counter("num_admission_holds", "Steps in which --admission-batch kept waiting "
                      "requests waiting for more free slots.",
                      s.get("num_admission_holds_total", 0))
        yield counter("guided_requests", "Accepted requests with guided decoding (JSON Schema, "
                      "regex or choice).", s.get("num_guided_requests_total", 0))
        yield gauge("guided_grammars_cached", "Compiled guided-decoding grammars kept for reuse.",
                    s.get("num_guided_grammars_cached", 0))
        yield gauge("weights_version", "Times the model's weights were updated in place since "
                    "start (update_weights, POST /update_weights_from_disk).",
                    s.get("weights_version", 0))
        yield gauge("generation_paused", "1 while generation is paused (pause_generation, "
                    "POST /pause), else 0.", 1.0 if s.get("generation_paused") else 0.0)
        lora = s.get("lora")
        if lora is not None:        # vLLM's gauge: the adapters in the labels, the value 1
            names = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
            info = GaugeMetricFamily(f"{self._prefix}lora_requests_info", "LoRA adapters of running "
                                     "and waiting requests, in the labels (the value is 1).",
                                     labels=labels + list(names))
            info.add_metric([self._model, str(lora["max_loras"]), ",".join(lora["running"]),
                             ",".join(lora["waiting"])], 1.0)
            yield info
            yield counter("lora_adapter_loads", "LoRA adapters put into a slot (a reload "
                          "after an eviction counts again).", lora["loads_total"])
            yield counter("lora_adapter_evictions", "Idle LoRA adapters evicted to make room "
                          "for another.", lora["evictions_total"])
        config = getattr(self._engine, "kv_cache_config", lambda: None)()
        if config is not None:
            names = ("block_size", "num_blocks", "cache_dtype")
            info = GaugeMetricFamily(f"{self._prefix}cache_config_info", "The KV cache's "
                                     "configuration, in the labels (the value is 1).",
                                     labels=labels + list(names))
            info.add_metric([self._model] + [str(config[n]) for n in names], 1.0)
            yield info


class ServerMetrics(EngineObserver):
    """The Prometheus metrics of a server, named ``ferrobatch_...``, or with ``prefix="vllm:"``
    (``serve --vllm-metric-names``) as vLLM names the same ones, so that dashboards made for
    vLLM read them."""

    def __init__(self, engine: Any, model_name: str, prefix: str = "ferrobatch_") -> None:
        disable_created_metrics()     # no `_created` gauge beside every counter and histogram
        self.registry = CollectorRegistry()
        r, m, px = self.registry, model_name, prefix
        lab = ["model_name"]
        self.prompt_tokens = Counter(f"{px}prompt_tokens", "Prompt tokens of scheduled "
                                     "requests.", lab, registry=r).labels(m)
        self.generation_tokens = Counter(f"{px}generation_tokens", "Generated tokens.",
                                         lab, registry=r).labels(m)
        success = Counter(f"{px}request_success", "Finished requests by finish reason "
                          "(a request of n sequences counts once: error or abort if any "
                          "sequence ended so, else the first sequence's reason).",
                          lab + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(m, reason) for reason in FINISH_REASONS}
        self.ttft = Histogram(f"{px}time_to_first_token_seconds", "Time to first token.",
                              lab, buckets=TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram(f"{px}inter_token_latency_seconds", "Time between the "
                             "steps that gave a request tokens (one gap per step, however many "
                             "sequences or accepted drafts).", lab, buckets=ITL_BUCKETS,
                             registry=r).labels(m)
        self.e2e = Histogram(f"{px}e2e_request_latency_seconds", "Arrival to finish.",
                             lab, buckets=LATENCY_BUCKETS, registry=r).labels(m)
        self.queue = Histogram(f"{px}request_queue_time_seconds", "Arrival to first "
                               "scheduled.", lab, buckets=LATENCY_BUCKETS, registry=r).labels(m)

        def latency(name: str, doc: str) -> Any:
            return Histogram(f"{px}request_{name}_time_seconds", doc, lab,
                             buckets=LATENCY_BUCKETS, registry=r).labels(m)

        self.prefill = latency("prefill", "First scheduled to first token.")
        self.decode = latency("decode", "First token to last token.")
        self.inference = latency("inference", "First scheduled to last token.")
        lengths = buckets_1_2_5(getattr(engine, "max_model_len", 8192))

        def per_request(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"{px}request_{name}", doc, lab, buckets=buckets,
                             registry=r).labels(m)

        self.request_prompt_tokens = per_request("prompt_tokens", "Prompt tokens of finished "
                                                 "requests.", lengths)
        self.request_generation_tokens = per_request("generation_tokens", "Tokens generated by "
                                                     "finished requests (all n sequences).",
                                                     lengths)
        self.request_max_tokens = per_request("params_max_tokens", "The max_tokens finished "
                                              "requests ran under (the context's room when "
                                              "none was given).", lengths)
        self.request_n = per_request("params_n", "The n (sequences) of finished requests.",
                                     N_BUCKETS)
        self.iteration_tokens = Histogram(f"{px}iteration_tokens_total", "Tokens computed "
                                          "per engine step (prompt chunks, decodes, drafts).",
                                          lab, buckets=ITERATION_BUCKETS,
                                          registry=r).labels(m)
        # every HTTP request by route (the route's path template), method and status, and its
        # time to the end of its answer (a stream's too): named as prometheus-fastapi-
        # instrumentator names them in vLLM (no prefix) with vLLM's names, else ferrobatch_http_*
        hp = "" if prefix == "vllm:" else f"{prefix}"
        self.http_requests = Counter(f"{hp}http_requests", "HTTP requests by route, method "
                                     "and status (499: the client left first).",
                                     ["handler", "method", "status"], registry=r)
        self.http_duration = Histogram(f"{hp}http_request_duration_seconds", "HTTP request "
                                       "to the end of its answer, by route and method.",
                                       ["handler", "method"], buckets=HTTP_BUCKETS, registry=r)
        r.register(_SchedulerCollector(engine, m, prefix))
        engine.add_observer(self)

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.http_requests.labels(handler, method, str(status)).inc()
        self.http_duration.labels(handler, method).observe(seconds)

    def on_scheduled(self, queue_time_s: float, num_prompt_tokens: int) -> None:
        self.queue.observe(queue_time_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_step_tokens(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        self.generation_tokens.inc(num_tokens)
        for x in inter_token_latencies:
            self.itl.observe(x)

    def on_step(self, num_batched_tokens: int) -> None:
        self.iteration_tokens.observe(num_batched_tokens)

    def on_finished(self, request: FinishedRequest) -> None:
        self.success[request.finish_reason].inc()
        self.e2e.observe(request.e2e_s)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generated)
        self.request_max_tokens.observe(request.max_tokens)
        self.request_n.observe(request.n)
        for histogram, seconds in ((self.prefill, request.prefill_s),
                                   (self.decode, request.decode_s),
                                   (self.inference, request.inference_s)):
            if seconds is not None:
                histogram.observe(seconds)


def http_metrics_middleware(metrics: ServerMetrics) -> Any:
    """Counts and times every HTTP request (``ServerMetrics.observe_http``) but probes and
    scrapes (HTTP_UNCOUNTED); the outermost middleware, so refusals (401, 503 while draining)
    and errors count with their status."""
    import asyncio
    import time

    from aiohttp import web

    @web.middleware
    async def record(request: web.Request, handler: Any) -> Any:
        if request.path in HTTP_UNCOUNTED:
            return await handler(request)
        started, status = time.monotonic(), 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = CLIENT_CLOSED
            raise
        finally:
            resource = request.match_info.route.resource
            name = resource.canonical if resource is not None else UNMATCHED
            metrics.observe_http(name, request.method, status, time.monotonic() - started)

    return record
