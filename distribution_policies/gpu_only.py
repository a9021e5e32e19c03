"""``gpu_only`` (WarpDrive): the whole loop in one fragment on one device, the env stepped by
CUDA kernels on the tensors' memory: no host copies inside an iteration.

On a machine without a GPU the same fragment runs on the CPU with the kernels' host build.
Needs a native env (``env.id: msrl/...``).
"""

from msrl.policy import ONE_LEARNER, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="gpu_only",
    description="one fragment on one device (auto: GPU if present); env as CUDA kernels, rollout in device memory",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(FragmentSpec("main", roles=("env", "actor", "buffer", "learner"), backend="cuda_kernel", device="auto"),),
)
