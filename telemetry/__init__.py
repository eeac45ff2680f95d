"""Telemetry shared by every process (layer 1: imports no other pdserve package).

- ``exporter``: the per-process Prometheus registry and its ``/metrics`` HTTP endpoint.
- ``gpu``: GPU utilisation and memory through NVML (an absent driver is not an error).
- ``slo``: SLO thresholds as histogram bucket boundaries, shared by the router, the pools and the
  dashboards.
"""
