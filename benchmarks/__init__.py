"""Scenario workloads and the runner that measures them (``python -m benchmarks.run --help``)."""
