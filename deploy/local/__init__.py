"""The local launcher behind ``pdserve up/scale/status/down``: a state file, spawning and stopping the router
and workers as background processes, readiness, and an optional local Prometheus."""
