"""The tracking interface the ML core logs through; `tasks/` supplies the MLflow implementation.

Only rank 0 logs: other ranks get a NullLogger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class MetricLogger(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_table(self, rows: list[dict[str, Any]], name: str) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...


class NullLogger:
    """Discards everything (ranks other than 0, notebooks, unit tests)."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        pass

    def set_tags(self, tags: dict[str, Any]) -> None:
        pass


class ListLogger(NullLogger):
    """Keeps metrics in memory (tests and the stage summaries)."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int | None, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((step, dict(metrics)))
