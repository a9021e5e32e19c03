"""``single_learner_fine`` (SEED RL, Espeholt et al. 2020, "SEED RL: Scalable and Efficient
Deep-RL with Accelerated Central Inference"): N x env, 1 x (actor + buffer + learner).

Env-only replicas send their observations to the central replica every step; it runs the
actor's inference on them and sends each env replica its actions back. Rewards and the rest of
each step's transition follow to the central buffer.
"""

from msrl.policy import ONE_LEARNER, BoundaryClass, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="single_learner_fine",
    description="N env replicas send observations to 1 central actor + buffer + learner, which sends actions back",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(
        FragmentSpec("env", roles=("env",), replicas=2),
        FragmentSpec("learner", roles=("actor", "buffer", "learner"), replicas=1),
    ),
    boundaries=(
        BoundaryClass("observations", "env", "learner", "sync", "what the env replicas send (observations, rewards)"),
        BoundaryClass("actions", "learner", "env", "sync", "what the central replica sends the env replicas (actions)"),
    ),
)
