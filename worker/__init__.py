"""What every worker process is, whatever its pool (layer 3: imports kv_transfer, engine, telemetry and the
protos; never the router, a pool or the CLI).

- ``role``: the ``Role`` enum (pure).
- ``args``: ``WorkerArgs``, the frozen settings ``pdserve worker`` hands a pool.
- ``convert``: protobuf <-> engine conversions shared with the router.
- ``shell``: the worker's gRPC server (health, reflection, in-flight counting, drain).
- ``agent``: registration and heartbeats with the router.
- ``auth``: the cluster token the router's control plane requires (files, metadata, the interceptor).
- ``bringup``: the one start-up both pools run: metrics -> shell -> model -> SERVING -> agent -> drain.
"""
