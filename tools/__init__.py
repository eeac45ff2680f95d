"""Development tooling and one-off diagnostics, run from the repository root; not installed."""
