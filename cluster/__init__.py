"""What needs Ray: the Ray cluster runtime, where every fragment replica is a Ray actor in its own
process, placed in a placement group (one bundle per replica), its boundaries carried over a
torch.distributed process group (Gloo; NCCL between CUDA fragments) with the codec of
:mod:`msrl.runtime.transports.codec`; and ``msrl launch``, a run submitted to a cluster as a Ray Job.

:mod:`msrl.cluster.ray_runtime` holds the driver side (:class:`~msrl.cluster.ray_runtime.RayJob`)
and the replica actor; :mod:`msrl.cluster.launch` the Ray Jobs submission. Not built yet: the
gRPC transport for asynchronous boundaries.
"""
