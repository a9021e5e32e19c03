"""``single``: the whole algorithm in one fragment, one process; nothing crosses a boundary."""

from msrl.policy import DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="single",
    description="one fragment holding env, actor, buffer and learner; one process",
    fragments=(FragmentSpec("main", roles=("env", "actor", "buffer", "learner")),),
)
