"""``single_learner_coarse`` (Acme, MSRL): N x (env + actor + buffer), 1 x learner.

Each actor replica rolls out on its own share of the envs; the trajectories are gathered to
the learner along the env axis and the learner's weights are broadcast back.

Its two classes of boundaries are synchronous by default; the YAML may make them asynchronous
(``distribution_policy.boundaries: {trajectories: fifo, weights: latest}``): the actors then
roll out iteration k+1 while the learner learns on iteration k, acting with the newest weights
they have (the policy lag, learner version minus acting version, is logged as
``async/policy_lag_mean`` and ``async/policy_lag_max``).

The YAML may move the buffer beside the learner (``distribution_policy.placement.buffer:
learner``, as in Ape-X): the actors then send their transitions at every step, and the
learner's replay buffer holds every replica's and samples from them.
"""

from msrl.policy import ONE_LEARNER, BoundaryClass, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="single_learner_coarse",
    description="N actor replicas (env + actor + buffer) gather trajectories to 1 learner; weights broadcast back",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(
        FragmentSpec("actor", roles=("env", "actor", "buffer"), replicas=2),
        FragmentSpec("learner", roles=("learner",), replicas=1),
    ),
    boundaries=(
        BoundaryClass("trajectories", "actor", "learner", "sync", "what the actors send the learner (rollouts, samples)"),
        BoundaryClass("weights", "learner", "actor", "sync", "what the learner sends the actors (weights)",
                      data=False),
    ),
)
