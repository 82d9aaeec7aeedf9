"""The worker room: checkpoint loading, the per-device runtime, and the worker process."""
