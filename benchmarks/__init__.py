"""Reproducible benchmarks of pdserve and their current results (run from the repo root; not installed)."""
