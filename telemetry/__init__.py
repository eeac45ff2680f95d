"""Telemetry shared by every process: the /metrics exporter, GPU metrics and SLO buckets.

Layer 1: imports no other pdserve package.
"""
