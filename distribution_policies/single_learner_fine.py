"""``single_learner_fine`` (SEED RL, Espeholt et al. 2020, "SEED RL: Scalable and Efficient
Deep-RL with Accelerated Central Inference"): N x env, 1 x (actor + buffer + learner).

Env-only replicas send their observations to the central replica every step; it runs the
actor's inference on them and sends each env replica its actions back. Rewards and the rest of
each step's transition follow to the central buffer.

By default every step is one lockstep collective: the central replica gathers every env
replica's observations, acts on all of them at once and scatters the actions (the same numbers
as ``single``). ``distribution_policy.inference: {max_batch: B, timeout_ms: D}`` turns on
SEED's dynamic batching: each env replica streams its own observations over a queue, and the
central replica acts on the requests that are waiting -- a batch closes at ``B`` env replicas or
when its oldest request has waited ``D`` ms -- so an env replica never waits for a slower one
(see :class:`msrl.policy.InferenceSpec`).
"""

from msrl.policy import ONE_LEARNER, BoundaryClass, DistributionPolicy, FragmentSpec, InferenceSpec

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
    inference=InferenceSpec(server="learner", clients="env", role="actor"),
)
