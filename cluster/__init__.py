"""The Ray cluster runtime (DESIGN.md §5): placement groups for fragment replicas,
torch.distributed rendezvous, gRPC channel transport and job launch.

Not built yet: jobs run on the in-process runtime (:mod:`msrl.runtime.local`), whose channels
(:mod:`msrl.channels`) implement the same comm-op semantics this runtime will carry over Ray
actors.
"""
