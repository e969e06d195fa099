"""The server's /metrics: a scheduler metrics snapshot (Scheduler.metrics) as Prometheus text, and the process's
resident memory that goes with it. Shared by the FastAPI app and the Ray Serve ingress (which adds up replicas)."""
from __future__ import annotations

import psutil


def resident_bytes() -> int:
    return psutil.Process().memory_info().rss


def prometheus(snap: dict) -> str:
    """Prometheus text exposition of a metrics snapshot."""
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]], prefix: str = "castspec_"):
        lines.append(f"# HELP {prefix}{name} {help_}")
        lines.append(f"# TYPE {prefix}{name} {kind}")
        lines.extend(f"{prefix}{name}{labels} {value}" for labels, value in samples)

    metric("requests_total", "counter", "Finished requests by reason.",
           [(f'{{reason="{k}"}}', v) for k, v in snap["requests"].items()])
    metric("rejected_total", "counter", "Requests refused because the queue was full.", [("", snap["rejected"])])
    metric("generated_tokens_total", "counter", "Tokens sent to clients.", [("", snap["tokens"])])
    metric("goodput_tokens_per_second", "gauge", "Tokens of normally finished requests per second of uptime.",
           [("", snap["goodput_tokens_per_s"])])
    metric("rounds_total", "counter", "Batched decoding rounds.", [("", snap["rounds"])])
    metric("mean_committed_tokens_per_round", "gauge", "Mean tokens a request commits per verify round (R).",
           [("", snap["mean_committed_per_round"])])
    metric("prefill_tokens_total", "counter", "Prompt tokens prefilled.", [("", snap["prefill_tokens"])])
    metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens copied from a kept prompt prefix, not read.",
           [("", snap["prefix_hit_tokens"])])
    metric("active_requests", "gauge", "Requests decoding now.", [("", snap["active"])])
    metric("queued_requests", "gauge", "Requests waiting for a batch slot.", [("", snap["queued"])])
    for name, key, help_ in (("accepted_tokens", "acceptance_histogram", "Accepted drafted tokens per request-round."),
                             ("batch_size", "batch_size_histogram", "Requests verified together per round.")):
        hist = snap[key]
        samples, total, acc = [], 0, 0
        for k in sorted(hist):
            acc += hist[k]
            samples.append((f'_bucket{{le="{k}"}}', acc))
            total += k * hist[k]
        samples += [('_bucket{le="+Inf"}', acc), ("_sum", total), ("_count", acc)]
        metric(name, "histogram", help_, samples)
    metric("process_resident_memory_bytes", "gauge", "Resident memory of the server process.",
           [("", snap["rss_bytes"])], prefix="")
    return "\n".join(lines) + "\n"
