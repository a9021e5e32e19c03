"""``multi_learner``: DD-PPO's split (Wijmans et al. 2020, "DD-PPO: Learning Near-Perfect
PointGoal Navigators from 2.5 Billion Frames"). N replicas of one fragment holding env, actor,
buffer and learner, each on its share of the envs; at every ``Learner.apply_gradients`` the
replicas' gradients are averaged by an all-reduce (torch.distributed in processes, the local hub
in threads) before the optimiser step, as torch DDP does. Learners start from identical weights
(built from the job's base seed), so after every update all replicas hold the same parameters.
"""

from msrl.policy import DistributionPolicy, FragmentSpec

POLICY = DistributionPolicy(
    name="multi_learner",
    description="N x (env + actor + buffer + learner); gradients all-reduced at the learner's gradient step",
    fragments=(FragmentSpec("main", roles=("env", "actor", "buffer", "learner"), replicas=2),),
)
