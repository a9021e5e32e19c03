"""``gpu_only`` (WarpDrive): the whole loop in one fragment on one device, the env stepped by
kernels on the tensors' memory (the native envs' CUDA C; MJWarp's for the MuJoCo tasks with
``env.kwargs.physics: warp``): no host copies inside an iteration.

On a machine without a GPU the same fragment runs on the CPU with the kernels' host build.
Needs a native env (``env.id: msrl/...``).
"""

from msrl.policy import ONE_LEARNER, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="gpu_only",
    description="one fragment on one device (auto: GPU if present); env as device kernels (CUDA C, or MJWarp), "
                "rollout in device memory",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(FragmentSpec("main", roles=("env", "actor", "buffer", "learner"), backend="cuda_kernel", device="auto"),),
)
