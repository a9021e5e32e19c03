"""``single``: the whole algorithm in one fragment, one process; nothing crosses a boundary."""

from msrl.policy import ONE_LEARNER, DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="single",
    description="one fragment holding env, actor, buffer and learner; one process",
    max_role_replicas={"learner": (1, ONE_LEARNER)},
    fragments=(FragmentSpec("main", roles=("env", "actor", "buffer", "learner")),),
)
