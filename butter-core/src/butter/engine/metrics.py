"""Counters and gauges the engine keeps, rendered as Prometheus text.

Only the engine thread writes; readers (``GET /metrics``) read plain ints under
the GIL, so a scrape may be one step stale but never torn.
"""

from __future__ import annotations

import attrs

CANCEL_PHASES = ("queued", "prefill", "decode")


@attrs.define
class Metrics:
    # Counters.
    requests_total: int = 0
    requests_rejected: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    model_passes: int = 0
    cancellations: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(CANCEL_PHASES, 0))
    # Gauges.
    active_requests: int = 0
    queued_requests: int = 0
    sessions_total: int = 0
    sessions_busy: int = 0
    kv_capacity_cells: int = 0
    kv_reserved_cells: int = 0
    kv_used_cells: int = 0

    def render(self, *, model_id: str, fused: bool) -> str:
        label = f'model="{_escape(model_id)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: int, extra: str = "") -> None:
            labels = f"{label},{extra}" if extra else label
            if not any(line.startswith(f"# HELP butter_{name} ") for line in lines):
                lines.append(f"# HELP butter_{name} {help_text}")
                lines.append(f"# TYPE butter_{name} {kind}")
            lines.append(f"butter_{name}{{{labels}}} {value}")

        metric("requests_total", "counter", "Requests admitted by the engine.", self.requests_total)
        metric("requests_rejected_total", "counter", "Requests refused at admission.",
               self.requests_rejected)
        metric("requests_failed_total", "counter", "Requests that failed while running.",
               self.requests_failed)
        metric("active_requests", "gauge", "Requests holding a session.", self.active_requests)
        metric("queued_requests", "gauge", "Requests waiting in the FIFO.", self.queued_requests)
        metric("sessions", "gauge", "Sessions in the pool.", self.sessions_total)
        metric("sessions_busy", "gauge", "Sessions leased to a request.", self.sessions_busy)
        metric("kv_capacity_cells", "gauge", "KV cells in the shared cache.", self.kv_capacity_cells)
        metric("kv_reserved_cells", "gauge", "KV cells reserved by active requests.",
               self.kv_reserved_cells)
        metric("kv_used_cells", "gauge",
               "KV cells holding tokens (active and idle sessions; a shared prefix counts "
               "once per session that holds it).", self.kv_used_cells)
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
               self.prompt_tokens)
        metric("cached_tokens_total", "counter", "Prompt tokens reused from a session's KV.",
               self.cached_tokens)
        metric("generated_tokens_total", "counter", "Completion tokens sampled.",
               self.generated_tokens)
        metric("prefill_chunks_total", "counter", "Prefill chunks run.", self.prefill_chunks)
        metric("prefill_tokens_total", "counter", "Prompt tokens prefilled.", self.prefill_tokens)
        metric("decode_steps_total", "counter", "Engine steps that decoded at least one token.",
               self.decode_steps)
        metric("model_passes_total", "counter", "Native model calls (llama_decode).",
               self.model_passes)
        for phase, count in self.cancellations.items():
            metric("cancellations_total", "counter", "Requests cancelled, by phase.", count,
                   f'phase="{phase}"')
        metric("fused_batching", "gauge", "1 when sessions share model passes.", int(fused))
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
