"""Protocol buffers: the public `pdserve.v1` API and the internal worker API.

Generated modules are committed; regenerate after editing a .proto with
`python -m pdserve.proto.regen` (needs grpcio-tools, part of the test extra).
"""
