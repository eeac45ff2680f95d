"""One-host writers: one-sided writes into a peer's KV memory that bypass UCX, and the choice among them.

Each implements ``kv_transfer.transport.RemoteWriter`` for a receiver of the sender's own host:
- ``cma``: cross-memory attach (``process_vm_writev``) into host memory; also the peer's host identity and
  pidfd liveness check the others use.
- ``shm``: plain copies into a mapping of the receiver's KV cache memfd (``--kv-shared-memory``).
- ``cuda_ipc``: ``cudaMemcpyAsync`` into the receiver's CUDA memory through a CUDA IPC handle.
- ``select``: which of them a sender takes for a region, and when UCX's puts give way to tagged messages.

None imports ucxx; a UCX connection (``transports/ucx_connection.py``) asks ``select`` first and falls back
to its own puts (``transports/ucx_puts.py``).
"""
