"""IMPALA (Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance Weighted
Actor-Learner Architectures", arXiv:1802.01561): an actor-critic whose learner corrects for
acting with an older policy by V-trace (Eq. 1), written to run under ``async_learner`` (actors
queue trajectories and pull the newest weights, never waiting for the learner) and, unchanged,
under every other policy.

The actor-critic network, its rollout actor (which records the behaviour policy's
log-probabilities ``log mu(a|s)``) and the rollout buffer are :mod:`msrl.rl`'s (as PPO's and
A2C's); this file holds IMPALA's hyperparameters, learner and loop body.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import torch
from tensordict import TensorDict

from msrl.advantages import vtrace
from msrl.api import (
    AlgorithmSpec,
    BuildContext,
    LayerSizes,
    Learner,
    ModuleWeights,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.rl.actors import ActorCriticActor
from msrl.rl.buffers import RolloutBuffer
from msrl.rl.losses import clipped_surrogate_loss, normalize_advantages
from msrl.rl.networks import ACTION_SPACES, OBSERVATION_SPACES, ActorCritic, build_actor_critic
from msrl.rl.optim import RMSpropTF
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["IMPALAConfig", "IMPALALearner", "IMPALATrainer", "ALGORITHM"]


@dataclasses.dataclass
class IMPALAConfig:
    """IMPALA's hyperparameters (the paper's names where it has them)."""

    num_steps: PositiveInt = 20
    """unroll length per env per iteration (T; the paper: 20)"""
    learning_rate: PositiveFloat = 1e-3
    """the learning rate at the start of training"""
    optimizer: Literal["adam", "rmsprop_tf"] = "adam"
    """``adam`` (eps 1e-5), or the paper's RMSProp (Table G.1: decay 0.99, momentum 0) as
    TensorFlow steps it (:class:`msrl.rl.optim.RMSpropTF`: epsilon inside the square root, the
    mean square from 1, so a small gradient takes a small step, where Adam steps every weight by
    about the learning rate)"""
    rms_prop_eps: PositiveFloat = 1e-5
    """``rmsprop_tf``'s epsilon. The paper's 0.01 is for losses *summed* over the batch's T x B
    terms (its ``scalable_agent``: 20 x 32); msrl's losses are means, whose gradients are T x B
    times smaller, so the same steps take 0.01 / (T B)^2 (2.4e-8 there); 1e-5 is Baselines'
    A2C's (means too)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training (the paper: polynomial decay)"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    rho_bar: PositiveFloat = 1.0
    """V-trace's truncation of the importance weights rho_t (the value target's fixed point)"""
    c_bar: PositiveFloat = 1.0
    """V-trace's truncation of the trace coefficients c_t (the speed of convergence)"""
    vtrace_lambda: UnitInterval = 1.0
    """Section 4.2's lambda on the trace coefficients (1: Eq. 1)"""
    update_epochs: PositiveInt = 1
    """passes over each batch (the paper: 1; RLlib's ``num_epochs``), V-trace recomputed with the
    learner's current policy at every gradient step"""
    num_minibatches: PositiveInt = 1
    """gradient steps per pass, each on a slice of the envs' unrolls"""
    clip_coef: PositiveFloat | None = None
    """``None``: the paper's policy gradient ``-mean(A_t log pi)``. A number ``c``: APPO's
    clipped surrogate (Petrenko et al. 2020, "Sample Factory", on policy lag: PPO's Eq. 7 on the
    V-trace advantages, the ratio ``pi / mu`` against the behaviour policy), which bounds how far
    ``update_epochs > 1`` passes move the policy from the one that acted. Without it V-trace
    has no trust region: a Pong run with 4 epochs of 2 minibatches (Adam 2.5e-4) went from
    entropy 1.53 to 2e-21 in 3 iterations"""
    reward_scale: PositiveFloat = 1.0
    """rewards are multiplied by this before V-trace, so the critic learns returns of this scale
    (1: none; the reward scaling of Henderson et al. 2018, "Deep Reinforcement Learning that
    Matters", "Reward Scale"). An MLP critic trained by Adam for a few hundred steps cannot reach
    returns in the hundreds: CartPole's shipped config uses 0.1"""
    ent_coef: NonNegativeFloat = 0.01
    """entropy bonus coefficient"""
    norm_adv: bool = False
    """normalise the policy-gradient advantages of each minibatch to mean 0, std 1 (APPO's
    ``normalize_advantage``, Petrenko et al. 2020, Sample Factory; PPO's ``norm_adv``). With Adam
    and rare rewards (Pong: one point in hundreds of steps) the raw V-trace advantages are mostly
    noise of the critic's scale and the entropy bonus sets the step's direction: the policy stays
    uniform (a Pong run kept its entropy at 1.78 of ln 6 = 1.79 for 0.9M env steps)"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient (the paper's baseline cost)"""
    max_grad_norm: PositiveFloat = 40.0
    """global gradient-norm clip (the paper: 40)"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    cnn: Literal["nature", "impala"] = "nature"
    """the trunk for uint8 frame observations: the Nature CNN (Mnih et al. 2015) or IMPALA's
    residual network (Espeholt et al. 2018, Figure 3)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class IMPALALearner(Learner):
    """V-trace actor-critic updates on ``(T, N)`` unrolls acted by an older policy::

        v_t, A_t = vtrace(log mu, log pi, reward_scale * r, V)        (Eq. 1, Section 4.2)
        loss     = -mean(A_t log pi(a_t|s_t)) + vf_coef * 0.5 * mean((v_t - V(s_t))^2) - ent_coef * H

    or, with ``clip_coef`` set, APPO's ``mean(max(-A_t r_t, -A_t clamp(r_t, 1 - c, 1 + c)))``
    with ``r_t = pi(a_t|s_t) / mu(a_t|s_t)`` in place of the first term (the advantages keep
    V-trace's ``rho_t``, as Sample Factory's and PufferLib's do).

    with ``log mu`` the behaviour log-probabilities the actors recorded and ``log pi`` the
    learner's current policy's. Each env's unroll stays whole: the ``num_minibatches`` slices
    split the env axis, so a trace never crosses a slice.
    """

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: IMPALAConfig = ctx.hparams
        self.net: ActorCritic = build_actor_critic(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        #: the learning rate and updates taken, 0-d tensors updated in place (a captured
        #: iteration replays the schedule: :func:`msrl.rl.schedules.anneal_learning_rate`)
        self.lr = learning_rate_tensor(self.hp.learning_rate, ctx.device)
        if self.hp.optimizer == "rmsprop_tf":
            self.optimizer = RMSpropTF(self.parameters, lr=self.lr, alpha=0.99, eps=self.hp.rms_prop_eps)
        else:
            self.optimizer = torch.optim.Adam(self.parameters, lr=self.lr, eps=1e-5, fused=True)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """``update_epochs * num_minibatches`` gradient steps on one batch of unrolls.

        Args:
            batch: TensorDict of batch size ``(T, N)`` with :attr:`~msrl.rl.buffers.RolloutBuffer.KEYS`
                (``log_prob``: the behaviour policy's).

        Returns:
            ``losses/policy_loss``, ``losses/value_loss``, ``losses/entropy``,
            ``losses/grad_norm`` (of the last step), ``losses/rho_clipped`` (the fraction of
            importance weights over ``rho_bar``), ``losses/mean_ratio`` (``pi / mu``),
            ``losses/clipfrac`` with ``clip_coef`` (the fraction of ratios outside ``1 +- c``): 0-d
            tensors, ``charts/learning_rate`` too.

        Raises:
            FloatingPointError: a loss is NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        T, N = batch.batch_size
        obs_shape = batch["obs"].shape[2:]
        stats: dict[str, Any] = {}
        slices = [envs for _ in range(hp.update_epochs)
                  for envs in torch.randperm(N, generator=self.generator, device=batch.device).chunk(min(hp.num_minibatches, N))]
        for envs in slices:
            mb = batch[:, envs]
            n = envs.numel()
            log_prob, entropy, value = net.evaluate(mb["obs"].reshape(T * n, *obs_shape),
                                                    mb["action"].reshape(T * n, *mb["action"].shape[2:]))
            log_prob, entropy, value = log_prob.view(T, n), entropy.view(T, n), value.view(T, n)
            with torch.no_grad():
                next_values = net.value(mb["next_obs"].reshape(T * n, *obs_shape)).view(T, n)
            vs, pg_adv = vtrace(mb["log_prob"], log_prob.detach(), mb["reward"] * hp.reward_scale, value.detach(), next_values,
                                mb["terminated"], mb["truncated"], hp.gamma, hp.rho_bar, hp.c_bar, hp.vtrace_lambda)
            if hp.norm_adv:
                pg_adv = normalize_advantages(pg_adv)
            if hp.clip_coef is None:
                pg_loss = -(pg_adv * log_prob).mean()
            else:
                pg_loss = clipped_surrogate_loss(pg_adv, (log_prob - mb["log_prob"]).exp(), hp.clip_coef)
            v_loss = 0.5 * ((vs - value) ** 2).mean()
            entropy_loss = entropy.mean()
            loss = pg_loss + hp.vf_coef * v_loss - hp.ent_coef * entropy_loss
            grad_norm = self.apply_gradients(loss, hp.max_grad_norm)
            with torch.no_grad():
                ratio = (log_prob.detach() - mb["log_prob"]).exp()
            stats = {
                "losses/policy_loss": pg_loss.detach(),
                "losses/value_loss": v_loss.detach(),
                "losses/entropy": entropy_loss.detach(),
                "losses/grad_norm": grad_norm,
                "losses/rho_clipped": (ratio > hp.rho_bar).float().mean(),
                "losses/mean_ratio": ratio.mean(),
            }
            if hp.clip_coef is not None:
                stats["losses/clipfrac"] = ((ratio - 1.0).abs() > hp.clip_coef).float().mean()
        stats["charts/learning_rate"] = self.lr.clone()
        return stats

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actor-critic's state dict (detached tensors)."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "iteration": int(self.iteration),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_learning_rate(self.optimizer, self.lr)
        self.iteration.fill_(int(state["iteration"]))
        self.generator.set_state(state["generator"])


class IMPALATrainer(Trainer):
    """IMPALA's loop body: an unroll of ``num_steps`` steps with the behaviour policy's
    log-probabilities, one learner update, weight sync. Under ``async_learner`` the update and
    the weight sync cross asynchronous boundaries, so the next unroll runs while the learner
    learns."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, float]:
        """Unroll of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
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
    name="impala",
    observation_spaces=OBSERVATION_SPACES,
    action_spaces=ACTION_SPACES,
    hparams=IMPALAConfig,
    trainer=IMPALATrainer,
    components={"actor": ActorCriticActor, "buffer": RolloutBuffer, "learner": IMPALALearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    policy_lag="corrected",  # V-trace (Espeholt et al. 2018, eq. 1)
)
