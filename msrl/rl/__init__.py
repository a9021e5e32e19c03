"""What the algorithms of ``msrl.algorithms`` truly share: math and plumbing, written only
against msrl's public API (:mod:`msrl.api`), so an algorithm written outside the project can
use it too. No learner, actor or trainer of an algorithm lives here: each algorithm file holds
its own, as CleanRL's files do, and calls these.

- :mod:`msrl.rl.networks` -- orthogonally initialised layers, tanh MLPs, the Nature CNN, the
  separate-MLP :class:`~msrl.rl.networks.ActorCritic`;
- :mod:`msrl.rl.distributions` -- categorical sampling and log-probabilities without host syncs;
- :mod:`msrl.rl.actors` -- the rollout actor of an actor-critic;
- :mod:`msrl.rl.buffers` -- the on-policy rollout buffer and the uniform replay buffer;
- :mod:`msrl.rl.schedules` -- learning rates in tensors, annealed on the device;
- :mod:`msrl.rl.losses` -- PPO's clipped surrogate and value losses, advantage normalisation,
  explained variance, shuffled minibatches.
- :mod:`msrl.rl.continuous` -- ReLU MLPs, the state-action value network, the deterministic
  policy and its noisy actor, Polyak averaging, TD3's target policy smoothing (SAC, DDPG, TD3);
- :mod:`msrl.rl.distributional` -- the categorical support and C51's projection onto it.

GAE and V-trace are :mod:`msrl.advantages`; running normalisation :mod:`msrl.normalization`.
"""
