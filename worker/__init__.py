"""What every worker process is, whatever its pool: its settings and flags, gRPC shell, router agent,
token and TLS, and the start-up both pools run. Layer 3: imports kv_transfer, engine, telemetry and the
protos; never the router, a pool or the CLI."""
