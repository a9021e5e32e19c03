"""``async_learner`` (IMPALA, Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with
Importance Weighted Actor-Learner Architectures"; A3C's asynchronous actors): N x (env + actor +
buffer), 1 x learner, the boundaries asynchronous.

Actor replicas roll out without waiting for the learner: each pushes its trajectory into a
bounded FIFO queue (``trajectories: fifo``; a full queue makes the actor wait) and pulls the
newest weights the learner published from a latest-value slot (``weights: latest``; never
waits after the first publication). The learner trains on what arrives, one trajectory from
each actor per iteration. The actors' policy lags the learner's by about one update; V-trace
(``algorithms/impala.py``) corrects for it. The lag is logged as ``async/policy_lag_mean`` and
``async/policy_lag_max``.
"""

from msrl.policy import ONE_LEARNER, BoundaryClass, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="async_learner",
    description="N actor replicas (env + actor + buffer) queue trajectories to 1 learner and pull its newest weights",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(
        FragmentSpec("actor", roles=("env", "actor", "buffer"), replicas=2),
        FragmentSpec("learner", roles=("learner",), replicas=1),
    ),
    boundaries=(
        BoundaryClass("trajectories", "actor", "learner", "fifo", "what the actors send the learner (rollouts, samples)"),
        BoundaryClass("weights", "learner", "actor", "latest", "what the learner sends the actors (weights)",
                      data=False),
    ),
    queue_capacity=1,
)
