"""MAPPO: multi-agent PPO with decentralised actors and a centralised critic (Yu et al. 2022,
"The Surprising Effectiveness of PPO in Cooperative Multi-Agent Games", arXiv:2103.01955).

Every agent acts with one shared actor from its own observation and its agent index (one-hot,
as the paper's implementation appends the agent id); one shared critic values agent ``i`` from
the *global* state -- all agents' observations of the env concatenated -- and ``i``'s index
(the paper's agent-specific global state, section 4.1). Training is centralised, execution
decentralised: acting needs only the actor. The update is PPO's
(:func:`msrl.rl.losses.ppo_loss`: clipped surrogate, clipped value loss, entropy bonus, epochs
of shuffled minibatches) over all agent-steps, with GAE per agent.

Envs: ``(E, A, D)`` observations, per-agent rewards ``(E, A)``, one ``terminated``/``truncated``
per env (a PettingZoo parallel env such as MPE's ``simple_spread``, msrl's native Tag). Actions
per agent: ``Discrete`` (``(E, A)``) or ``MultiDiscrete`` (``(E, A, k)``, independent
Categoricals whose log-probabilities add).

    msrl train configs/mappo_simple_spread.yaml
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from msrl.advantages import gae
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
from msrl.rl.distributions import categorical_log_prob_entropy, sample_categorical
from msrl.rl.losses import ppo_epochs, ppo_loss
from msrl.rl.networks import mlp
from msrl.rl.schedules import anneal_learning_rate, learning_rate_tensor, load_learning_rate

__all__ = ["MAPPOConfig", "MAPPONet", "MAPPOActor", "MAPPOBuffer", "MAPPOLearner", "MAPPOTrainer", "ALGORITHM"]


@dataclasses.dataclass
class MAPPOConfig:
    """MAPPO's hyperparameters (PPO's names and CleanRL's defaults), with the MAPPO paper's MPE
    learning rate (7e-4) and entropy coefficient (0.01)."""

    num_steps: PositiveInt = 128
    """rollout length per env per iteration (T)"""
    learning_rate: PositiveFloat = 7e-4
    """Adam learning rate at the start of training"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to 0 over training"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    gae_lambda: UnitInterval = 0.95
    """GAE lambda (per agent)"""
    num_minibatches: PositiveInt = 4
    """minibatches per epoch"""
    update_epochs: PositiveInt = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: PositiveFloat = 0.2
    """surrogate clipping coefficient"""
    anneal_clip: bool = False
    """anneal the clipping coefficient linearly to 0"""
    clip_vloss: bool = True
    """clip the value loss around the rollout's values"""
    ent_coef: NonNegativeFloat = 0.01
    """entropy bonus coefficient"""
    vf_coef: NonNegativeFloat = 0.5
    """value loss coefficient"""
    max_grad_norm: PositiveFloat = 0.5
    """global gradient-norm clip"""
    target_kl: PositiveFloat | None = None
    """stop the epochs of an iteration early when the approximate KL exceeds this"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of the actor and of the critic MLPs"""
    normalize_obs: bool = False
    """PPO's single-agent observation normalisation: not supported here (must stay false)"""
    normalize_reward: bool = False
    """PPO's single-agent reward normalisation: not supported here (must stay false)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        if self.normalize_obs or self.normalize_reward:
            raise ValueError("normalize_obs and normalize_reward are PPO's single-agent options; mappo does not "
                             "normalize (leave them false)")


def _nvec(space: gymnasium.Space) -> list[int]:
    if isinstance(space, gymnasium.spaces.Discrete):
        return [int(space.n)]
    if isinstance(space, gymnasium.spaces.MultiDiscrete):
        return [int(n) for n in space.nvec]
    raise ValueError(f"MAPPO needs Discrete or MultiDiscrete agent actions, got {space}")


class MAPPONet(nn.Module):
    """The shared actor ``pi(a | o_i, i)`` and the centralised critic ``V(o_1..o_A, i)``.

    Args:
        observation_space: one agent's Box ``(D,)``; action_space: one agent's Discrete or
        MultiDiscrete; num_agents: ``A``; hidden_sizes: widths of the hidden layers.

    Raises:
        ValueError: other action spaces.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, num_agents: int,
                 hidden_sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.nvec, self.num_agents = _nvec(action_space), num_agents
        self.discrete = isinstance(action_space, gymnasium.spaces.Discrete)
        d = int(np.prod(observation_space.shape))
        self.actor = mlp(d + num_agents, hidden_sizes, sum(self.nvec), out_std=0.01)
        self.critic = mlp(num_agents * d + num_agents, hidden_sizes, 1, out_std=1.0)
        self.register_buffer("agent_id", torch.eye(num_agents), persistent=False)

    def _ids(self, obs: torch.Tensor) -> torch.Tensor:
        """One-hot agent indices ``(E, A, A)`` for observations ``(E, A, D)``."""
        return self.agent_id.expand(obs.shape[0], -1, -1)

    def logits(self, obs: torch.Tensor) -> list[torch.Tensor]:
        """Per action component, logits ``(E, A, n_k)`` of observations ``(E, A, D)``."""
        x = torch.cat([obs.flatten(2), self._ids(obs)], dim=-1)
        return list(torch.split(self.actor(x), self.nvec, dim=-1))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``V(global state, i)`` ``(E, A)`` of observations ``(E, A, D)``."""
        E, A = obs.shape[:2]
        state = obs.flatten(1).unsqueeze(1).expand(E, A, -1)  # every agent sees the env's global state
        return self.critic(torch.cat([state, self._ids(obs)], dim=-1)).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_prob, entropy, value)``, each ``(E, A)``, of actions ``(E, A, k)``."""
        log_prob = torch.zeros(obs.shape[:2], device=obs.device)
        entropy = torch.zeros(obs.shape[:2], device=obs.device)
        for k, lg in enumerate(self.logits(obs)):
            lp, ent = categorical_log_prob_entropy(lg.flatten(0, 1), action[..., k].flatten())
            log_prob = log_prob + lp.view(obs.shape[:2])
            entropy = entropy + ent.view(obs.shape[:2])
        return log_prob, entropy, self.value(obs)


def _build_net(ctx: BuildContext) -> MAPPONet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = MAPPONet(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.env_spec.num_agents,
                       ctx.hparams.hidden_sizes)
    return net.to(ctx.device)


class MAPPOActor(ActorCriticActor):
    """Acts for every agent of every env from the shared actor; samples from its own generator
    (weights and state handling as :class:`msrl.rl.actors.ActorCriticActor`)."""

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """A :class:`MAPPONet`."""
        return _build_net(ctx)

    def compile_targets(self) -> tuple[str, ...]:
        """The networks' forward passes; the draws from :attr:`generator` stay eager."""
        return ("net.logits", "net.value")

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chooses actions.

        Args:
            obs: ``(E, A, D)`` float32; deterministic: argmax instead of sampling.

        Returns:
            ``(action, log_prob, value)``: action ``(E, A)`` int64 (Discrete) or ``(E, A, k)``
            (MultiDiscrete); log_prob and value ``(E, A)`` float32.
        """
        net = self.net
        actions, log_prob = [], torch.zeros(obs.shape[:2], device=obs.device)
        for lg in net.logits(obs):
            lp = torch.log_softmax(lg, dim=-1)
            if deterministic:
                a = lg.argmax(-1)
            else:
                a = sample_categorical(lp.exp().flatten(0, 1), self.generator).view(obs.shape[:2])
            actions.append(a)
            log_prob = log_prob + lp.gather(-1, a.unsqueeze(-1)).squeeze(-1)
        action = actions[0] if net.discrete else torch.stack(actions, dim=-1)
        return action, log_prob, net.value(obs)


class MAPPOBuffer(RolloutBuffer):
    """Preallocated ``(T, E, ...)`` storage: ``obs``/``next_obs`` ``(T, E, A, D)``, ``action``
    ``(T, E, A)`` or ``(T, E, A, k)`` int64, ``log_prob``, ``value``, ``reward`` ``(T, E, A)``,
    ``terminated``/``truncated`` ``(T, E)`` bool (insert, gather and checkpoints as
    :class:`msrl.rl.buffers.RolloutBuffer`)."""

    def __init__(self, ctx: BuildContext) -> None:
        spec, T = ctx.env_spec, ctx.hparams.num_steps
        E, A, D = spec.num_envs, spec.num_agents, int(np.prod(spec.observation_space.shape))
        nvec = _nvec(spec.action_space)
        act_shape = (A,) if isinstance(spec.action_space, gymnasium.spaces.Discrete) else (A, len(nvec))
        f32, dev = torch.float32, ctx.device
        self.storage = TensorDict(
            {
                "obs": torch.zeros(T, E, A, D, dtype=f32, device=dev),
                "action": torch.zeros(T, E, *act_shape, dtype=torch.int64, device=dev),
                "log_prob": torch.zeros(T, E, A, dtype=f32, device=dev),
                "value": torch.zeros(T, E, A, dtype=f32, device=dev),
                "reward": torch.zeros(T, E, A, dtype=f32, device=dev),
                "terminated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "truncated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "next_obs": torch.zeros(T, E, A, D, dtype=f32, device=dev),
            },
            batch_size=[T, E],
            device=dev,
        )
        self.t = 0


class MAPPOLearner(Learner):
    """PPO's update over every agent-step of a ``(T, E, A)`` rollout (Schulman et al. 2017, Eq. 7
    and 9, :func:`msrl.rl.losses.ppo_loss`), values from the centralised critic; minibatches
    draw whole env-steps, whose ``A`` agents the critic values together."""

    #: the minibatch loss (:func:`msrl.rl.losses.ppo_loss`), an attribute so that
    #: ``compile: inductor`` can replace it by its compiled form (:meth:`compile_targets`)
    ppo_loss = staticmethod(ppo_loss)

    def compile_targets(self) -> tuple[str, ...]:
        """The network's evaluation of a minibatch and PPO's loss on it (their backward is
        compiled with them); the optimiser step stays as written."""
        return ("net.evaluate", "ppo_loss")

    def __init__(self, ctx: BuildContext) -> None:
        self.hp = ctx.hparams
        self.net = _build_net(ctx)
        self.weights = ModuleWeights(self.net)
        self.parameters = list(self.net.parameters())
        #: the learning rate and updates taken, 0-d tensors on the learner's device updated in
        #: place (:mod:`msrl.rl.schedules`: a captured iteration replays the schedule)
        self.lr = learning_rate_tensor(self.hp.learning_rate, ctx.device)
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.lr, eps=1e-5, fused=True)
        self.num_iterations = max(1, ctx.total_env_steps // (self.hp.num_steps * ctx.total_num_envs))
        self.iteration = torch.zeros((), dtype=torch.int64, device=ctx.device)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)

    def _update(self, evaluate: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], b_logprobs: torch.Tensor,
                b_values: torch.Tensor, b_advantages: torch.Tensor, b_returns: torch.Tensor) -> dict[str, Any]:
        """The learning rate and clip of this iteration, then PPO's epochs of shuffled
        minibatches of rows of the ``(B, ...)`` batch (:func:`msrl.rl.losses.ppo_epochs`)."""
        hp = self.hp
        frac = anneal_learning_rate(self.lr, self.iteration, hp.learning_rate, self.num_iterations, hp.anneal_lr)
        clip = frac * hp.clip_coef if hp.anneal_clip else hp.clip_coef
        stats = ppo_epochs(evaluate, b_logprobs, b_values, b_advantages, b_returns, clip,
                           step=lambda loss: self.apply_gradients(loss, hp.max_grad_norm), generator=self.generator,
                           update_epochs=hp.update_epochs, num_minibatches=hp.num_minibatches, norm_adv=hp.norm_adv,
                           clip_vloss=hp.clip_vloss, ent_coef=hp.ent_coef, vf_coef=hp.vf_coef, target_kl=hp.target_kl,
                           loss=self.ppo_loss)
        stats["charts/learning_rate"] = self.lr.clone()
        return stats

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The networks' state dict (detached tensors)."""
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

    def learn(self, batch: TensorDict) -> dict[str, Any]:
        """One PPO update.

        Args:
            batch: TensorDict of batch size ``(T, E)`` with :attr:`MAPPOBuffer.KEYS`.

        Returns:
            ``losses/value_loss``, ``losses/policy_loss``, ``losses/entropy``,
            ``losses/old_approx_kl``, ``losses/approx_kl`` (of the last minibatch),
            ``losses/grad_norm``, ``losses/explained_variance``, ``losses/clipfrac`` (mean over
            minibatches), ``charts/learning_rate``: 0-d tensors on the learner's device.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        T, E, A, D = batch["obs"].shape
        with torch.no_grad():
            next_values = net.value(batch["next_obs"].reshape(T * E, A, D)).view(T, E * A)
        term = batch["terminated"][:, :, None].expand(T, E, A).reshape(T, E * A)
        trunc = batch["truncated"][:, :, None].expand(T, E, A).reshape(T, E * A)
        advantages, returns = gae(batch["reward"].reshape(T, E * A), batch["value"].reshape(T, E * A), next_values,
                                  term, trunc, hp.gamma, hp.gae_lambda)
        # minibatches of whole env-steps: the critic needs every agent's observation of the env
        b_obs = batch["obs"].reshape(T * E, A, D)
        b_actions = batch["action"].reshape(T * E, A, -1)
        shape = (T * E, A)
        b_logprobs, b_values = batch["log_prob"].reshape(shape), batch["value"].reshape(shape)
        b_advantages, b_returns = advantages.reshape(shape), returns.reshape(shape)

        return self._update(lambda mb: net.evaluate(b_obs[mb], b_actions[mb]), b_logprobs, b_values, b_advantages,
                            b_returns)


class MAPPOTrainer(Trainer):
    """MAPPO's loop body: a rollout of every agent of every env for ``num_steps`` steps, one
    learner update, weight sync."""

    def reset(self) -> None:
        """First observations, and the learner's initial weights to the actor."""
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
    name="mappo",
    hparams=MAPPOConfig,
    trainer=MAPPOTrainer,
    components={"actor": MAPPOActor, "buffer": MAPPOBuffer, "learner": MAPPOLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete, gymnasium.spaces.MultiDiscrete),
    num_agents=(2, None),
    policy_lag="corrected",  # the clipped ratio to the behaviour policy's log-prob
)
