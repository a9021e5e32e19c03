"""``single_learner_coarse`` (Acme, MSRL): N x (env + actor + buffer), 1 x learner.

Each actor replica rolls out on its own share of the envs; the trajectories are gathered to
the learner along the env axis and the learner's weights are broadcast back.

The YAML may move the buffer beside the learner (``distribution_policy.placement.buffer:
learner``, as in Ape-X): the actors then send their transitions at every step, and the
learner's replay buffer holds every replica's and samples from them.
"""

from msrl.policy import ONE_LEARNER, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="single_learner_coarse",
    description="N actor replicas (env + actor + buffer) gather trajectories to 1 learner; weights broadcast back",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(
        FragmentSpec("actor", roles=("env", "actor", "buffer"), replicas=2),
        FragmentSpec("learner", roles=("learner",), replicas=1),
    ),
)
