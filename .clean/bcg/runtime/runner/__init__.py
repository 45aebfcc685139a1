"""The token-bucket runner: the bucket table, capture and replay through a backend, telemetry, verification."""

from bcg.runtime.runner.runner import Runner

__all__ = ["Runner"]
