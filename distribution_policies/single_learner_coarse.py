"""``single_learner_coarse`` (Acme, MSRL): N x (env + actor + buffer), 1 x learner.

Each actor replica rolls out on its own share of the envs; the trajectories are gathered to
the learner along the env axis and the learner's weights are broadcast back.
"""

from msrl.policy import DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="single_learner_coarse",
    description="N actor replicas (env + actor + buffer) gather trajectories to 1 learner; weights broadcast back",
    fragments=(
        FragmentSpec("actor", roles=("env", "actor", "buffer"), replicas=2),
        FragmentSpec("learner", roles=("learner",), replicas=1),
    ),
)
