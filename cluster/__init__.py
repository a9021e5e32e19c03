"""The Ray cluster runtime (DESIGN.md §5): every fragment replica a Ray actor in its own
process, placed in a placement group (one bundle per replica), its boundaries carried over a
torch.distributed (Gloo) process group with the codec of :mod:`msrl.runtime.codec`.

:mod:`msrl.cluster.ray_runtime` holds the driver side (:class:`~msrl.cluster.ray_runtime.RayJob`)
and the replica actor. Not built yet: the gRPC transport for asynchronous boundaries, NCCL for
CUDA tensors and ``msrl launch`` (Ray Jobs).
"""
