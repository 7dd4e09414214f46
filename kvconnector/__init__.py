"""Layout-aware KV-cache block transfer between prefill and decode workers over ZeroMQ."""

__version__ = "0.1.0"
