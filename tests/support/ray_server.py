"""A real ``butter serve --replicas`` for tests/ray, and its ``/metrics`` by model."""

from __future__ import annotations

import signal

import httpx
from conftest import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from support.hostile import read_metrics


class RayServer(ServerProcess):
    """``butter serve --replicas``: Ray takes longer to start and to stop."""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except Exception:
                self.process.kill()
                self.process.wait(10)
        self._log.close()

    def cluster(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{labels}": value}`` (the model label left out)."""
        return read_metrics(self.root, timeout=30)

    def replicas(self) -> dict[str, int]:
        """Replica id -> process id, as /metrics reports them."""
        found = {}
        for key, value in self.cluster().items():
            if key.startswith("butter_cluster_replica_pid{"):
                found[key.split('replica="')[1].split('"')[0]] = int(value)
        return found


def metrics_by_model(root: str, headers: dict[str, str] | None = None
                     ) -> dict[tuple[str, str, str], float]:
    """``/metrics`` as ``{(name, model, replica or kind): value}``."""
    text = httpx.get(f"{root}/metrics", headers=headers, timeout=30).text
    return {(sample.name, sample.labels.get("model", ""),
             sample.labels.get("replica") or sample.labels.get("kind") or ""): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
