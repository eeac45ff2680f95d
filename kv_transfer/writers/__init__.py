"""One-host writers: ``RemoteWriter``s into the KV memory of a receiver on the sender's own host that bypass
UCX (``cma``: cross-memory attach; ``shm``: copies into a shared memfd; ``cuda_ipc``: CUDA IPC copies), and
``select``, the choice among them. None imports ucxx; a UCX connection falls back to its own puts.
"""
