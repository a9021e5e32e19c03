"""Proximal Policy Optimisation (Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", arXiv:1707.06347), CleanRL-equivalent (vwxyzjn/cleanrl, ``ppo.py`` and
``ppo_continuous_action.py``).

PPO's components are shared with the algorithms built on them (A2C, IMPALA, MA-PPO, MAPPO), so
they live in :mod:`msrl.components`: the hyperparameters (:class:`~msrl.components.PPOConfig`),
the actor-critic network, the actor (rollout inference), the rollout buffer and the learner
(GAE, clipped surrogate, value loss, entropy bonus, epochs of shuffled minibatches, advantage
normalisation, LR annealing, grad-norm clipping). This file is PPO's loop body, the trainer
whose ``train_step`` msrl traces, and the algorithm's declaration. Written only against
msrl's public API.

Discrete action spaces use a Categorical policy; Box action spaces a diagonal Gaussian with a
state-independent log standard deviation.
"""

from __future__ import annotations

from msrl.api import AlgorithmSpec, Trainer
from msrl.components import ActorCritic, PPOActor, PPOConfig, PPOLearner, RolloutBuffer, build_actor_critic

__all__ = ["PPOConfig", "ActorCritic", "build_actor_critic", "PPOActor", "RolloutBuffer", "PPOLearner", "PPOTrainer",
           "ALGORITHM"]


class PPOTrainer(Trainer):
    """PPO's loop body: a rollout of ``num_steps`` steps, one learning update, weight sync."""

    def reset(self) -> None:
        """First observations (and agent types), and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Rollout of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
        for _step in range(self.hparams.num_steps):
            action, log_prob, value = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(
                obs=self.obs,
                action=action,
                log_prob=log_prob,
                value=value,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                next_obs=info["final_obs"],
            )
            self.obs = next_obs
        trajectory = self.buffer.gather()
        metrics = self.learner.learn(trajectory)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="ppo",
    hparams=PPOConfig,
    trainer=PPOTrainer,
    components={"actor": PPOActor, "buffer": RolloutBuffer, "learner": PPOLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="corrected",  # the clipped ratio to the behaviour policy's log-prob
)
