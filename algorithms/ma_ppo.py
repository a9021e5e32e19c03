"""Multi-agent PPO with one shared policy per agent type (parameter-sharing PPO, as studied by
Yu et al. 2022, "The Surprising Effectiveness of PPO in Cooperative Multi-Agent Games",
arXiv:2103.01955), for envs with ``(E, N, D)`` observations and per-agent rewards, such as
msrl's Tag (taggers and runners).

Every agent of type ``k`` acts with the type's actor and is valued by the type's critic from its
own observation; agent types come from the env (they change from game to game in Tag). The
update is PPO's (:func:`msrl.rl.losses.ppo_loss`): GAE per agent, the clipped surrogate,
value loss, entropy bonus, epochs of shuffled minibatches over all agent-steps.

MultiDiscrete actions (Tag: acceleration index, turn index) are independent Categoricals, one
per component; log-probabilities and entropies add up.
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
    NonNegativeInt,
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

__all__ = ["MultiAgentPPOConfig", "TypedActorCritic", "MultiAgentPPOActor", "MultiAgentRolloutBuffer", "MultiAgentPPOLearner",
           "MultiAgentPPOTrainer", "ALGORITHM"]


@dataclasses.dataclass
class MultiAgentPPOConfig:
    """Multi-agent PPO's hyperparameters (PPO's names and CleanRL's defaults) and the agent types."""

    num_steps: PositiveInt = 128
    """rollout length per env per iteration (T)"""
    learning_rate: PositiveFloat = 2.5e-4
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
    num_agent_types: PositiveInt = 2
    """agent types, each with its own actor and critic (Tag: runners = 0, taggers = 1)"""
    trained_types: tuple[NonNegativeInt, ...] | None = None
    """agent types whose networks learn (None: all); the others keep their initial, near-uniform
    policy, i.e. act at random"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        if self.normalize_obs or self.normalize_reward:
            raise ValueError("normalize_obs and normalize_reward are PPO's single-agent options; ma_ppo does not "
                             "normalize (leave them false)")


class TypedActorCritic(nn.Module):
    """One actor MLP and one critic MLP per agent type.

    Args:
        observation_space: a Box of one agent's observation ``(D,)``.
        action_space: MultiDiscrete ``[n_1, ..., n_k]`` of one agent.
        hidden_sizes: widths of the hidden layers; num_types: agent types.

    Raises:
        ValueError: other kinds of spaces.
    """

    def __init__(self, observation_space: gymnasium.Space, action_space: gymnasium.Space, hidden_sizes: tuple[int, ...],
                 num_types: int) -> None:
        super().__init__()
        if not isinstance(action_space, gymnasium.spaces.MultiDiscrete):
            raise ValueError(f"multi-agent PPO needs a MultiDiscrete action space, got {action_space}")
        obs_dim = int(np.prod(observation_space.shape))
        self.nvec = [int(n) for n in action_space.nvec]
        self.actors = nn.ModuleList(mlp(obs_dim, hidden_sizes, sum(self.nvec), out_std=0.01) for _ in range(num_types))
        self.critics = nn.ModuleList(mlp(obs_dim, hidden_sizes, 1, out_std=1.0) for _ in range(num_types))

    def _by_type(self, nets: nn.ModuleList, obs: torch.Tensor, agent_type: torch.Tensor) -> torch.Tensor:
        """Each row through its type's network: ``(B, D), (B,) -> (B, out)``."""
        out = torch.stack([net(obs) for net in nets])  # (types, B, out): every row through every net
        index = agent_type.to(torch.int64).clamp(0, len(nets) - 1)
        return out.gather(0, index.view(1, -1, 1).expand(1, -1, out.shape[-1]))[0]

    def value(self, obs: torch.Tensor, agent_type: torch.Tensor) -> torch.Tensor:
        """``V(o)`` of observations ``(B, D)`` by type ``(B,)`` -> ``(B,)``."""
        return self._by_type(self.critics, obs, agent_type).squeeze(-1)

    def logits(self, obs: torch.Tensor, agent_type: torch.Tensor) -> list[torch.Tensor]:
        """Per action component, logits ``(B, n_k)``."""
        return list(torch.split(self._by_type(self.actors, obs, agent_type), self.nvec, dim=-1))

    def evaluate(self, obs: torch.Tensor, agent_type: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(log_prob, entropy, value)``, each ``(B,)``, of actions ``(B, k)``."""
        log_prob = torch.zeros(obs.shape[0], device=obs.device)
        entropy = torch.zeros(obs.shape[0], device=obs.device)
        for i, lg in enumerate(self.logits(obs, agent_type)):
            lp, ent = categorical_log_prob_entropy(lg, action[:, i])
            log_prob = log_prob + lp
            entropy = entropy + ent
        return log_prob, entropy, self.value(obs, agent_type)


def _build_net(ctx: BuildContext) -> TypedActorCritic:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        net = TypedActorCritic(ctx.env_spec.observation_space, ctx.env_spec.action_space, ctx.hparams.hidden_sizes,
                               ctx.hparams.num_agent_types)
    return net.to(ctx.device)


class MultiAgentPPOActor(ActorCriticActor):
    """Acts for every agent of every env; samples from its own generator (weights and state
    handling as :class:`msrl.rl.actors.ActorCriticActor`)."""

    def build_net(self, ctx: BuildContext) -> nn.Module:
        """A :class:`TypedActorCritic`."""
        return _build_net(ctx)

    def compile_targets(self) -> tuple[str, ...]:
        """The networks' forward passes; the draws from :attr:`generator` stay eager."""
        return ("net.logits", "net.value")

    @torch.no_grad()
    def act(self, obs: torch.Tensor, agent_type: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, ...]:
        """Chooses actions.

        Args:
            obs: ``(E, N, D)`` float32; agent_type: ``(E, N)`` (type index as float or int).
            deterministic: argmax instead of sampling.

        Returns:
            ``(action, log_prob, value)``: action ``(E, N, k)`` int64, log_prob and value ``(E, N)``.
        """
        E, N = obs.shape[:2]
        flat, types = obs.reshape(E * N, -1), agent_type.reshape(E * N)
        actions, log_prob = [], torch.zeros(E * N, device=obs.device)
        for lg in self.net.logits(flat, types):
            lp = torch.log_softmax(lg, dim=-1)
            a = lg.argmax(-1) if deterministic else sample_categorical(lp.exp(), self.generator)
            actions.append(a)
            log_prob = log_prob + lp.gather(-1, a.unsqueeze(-1)).squeeze(-1)
        value = self.net.value(flat, types)
        return torch.stack(actions, dim=-1).view(E, N, -1), log_prob.view(E, N), value.view(E, N)


class MultiAgentRolloutBuffer(RolloutBuffer):
    """Preallocated ``(T, E, N, ...)`` storage: ``obs``/``next_obs`` ``(T, E, N, D)``,
    ``agent_type``/``next_agent_type``, ``log_prob``, ``value``, ``reward`` ``(T, E, N)``,
    ``action`` ``(T, E, N, k)`` int64, ``terminated``/``truncated`` ``(T, E)`` bool. ``insert``,
    ``gather`` and the checkpoint state are :class:`msrl.rl.buffers.RolloutBuffer`'s."""

    KEYS = ("obs", "agent_type", "action", "log_prob", "value", "reward", "terminated", "truncated", "next_obs",
            "next_agent_type")

    def __init__(self, ctx: BuildContext) -> None:
        spec, T = ctx.env_spec, ctx.hparams.num_steps
        E, N, D = spec.num_envs, spec.num_agents, int(np.prod(spec.observation_space.shape))
        k = len(spec.action_space.nvec)
        f32, dev = torch.float32, ctx.device
        self.storage = TensorDict(
            {
                "obs": torch.zeros(T, E, N, D, dtype=f32, device=dev),
                "agent_type": torch.zeros(T, E, N, dtype=f32, device=dev),
                "action": torch.zeros(T, E, N, k, dtype=torch.int64, device=dev),
                "log_prob": torch.zeros(T, E, N, dtype=f32, device=dev),
                "value": torch.zeros(T, E, N, dtype=f32, device=dev),
                "reward": torch.zeros(T, E, N, dtype=f32, device=dev),
                "terminated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "truncated": torch.zeros(T, E, dtype=torch.bool, device=dev),
                "next_obs": torch.zeros(T, E, N, D, dtype=f32, device=dev),
                "next_agent_type": torch.zeros(T, E, N, dtype=f32, device=dev),
            },
            batch_size=[T, E],
            device=dev,
        )
        self.t = 0


class MultiAgentPPOLearner(Learner):
    """PPO's update over all agent-steps of a ``(T, E, N)`` rollout (Schulman et al. 2017, Eq. 7
    and 9, :func:`msrl.rl.losses.ppo_loss`), each agent valued by its type's critic."""

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
            batch: TensorDict of batch size ``(T, E)`` with :attr:`MultiAgentRolloutBuffer.KEYS`.

        Returns:
            ``losses/value_loss``, ``losses/policy_loss``, ``losses/entropy``,
            ``losses/old_approx_kl``, ``losses/approx_kl`` (of the last minibatch),
            ``losses/grad_norm``, ``losses/explained_variance``, ``losses/clipfrac`` (mean over
            minibatches), ``charts/learning_rate``: 0-d tensors on the learner's device.

        Raises:
            FloatingPointError: a loss became NaN or infinite (no step is taken).
        """
        hp, net = self.hp, self.net
        T, E, N, D = batch["obs"].shape
        with torch.no_grad():
            next_values = net.value(batch["next_obs"].reshape(-1, D), batch["next_agent_type"].reshape(-1)).view(T, E * N)
        term = batch["terminated"][:, :, None].expand(T, E, N).reshape(T, E * N)
        trunc = batch["truncated"][:, :, None].expand(T, E, N).reshape(T, E * N)
        advantages, returns = gae(batch["reward"].reshape(T, E * N), batch["value"].reshape(T, E * N), next_values, term, trunc,
                                  hp.gamma, hp.gae_lambda)
        b_obs = batch["obs"].reshape(-1, D)
        b_types = batch["agent_type"].reshape(-1)
        b_actions = batch["action"].reshape(T * E * N, -1)
        b_logprobs, b_values = batch["log_prob"].reshape(-1), batch["value"].reshape(-1)
        b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
        if hp.trained_types is not None:  # only the agent-steps of trained types enter the loss
            keep = torch.isin(b_types.to(torch.int64), torch.tensor(list(hp.trained_types), device=b_types.device))
            b_obs, b_types, b_actions = b_obs[keep], b_types[keep], b_actions[keep]
            b_logprobs, b_values, b_advantages, b_returns = b_logprobs[keep], b_values[keep], b_advantages[keep], b_returns[keep]
        return self._update(lambda mb: net.evaluate(b_obs[mb], b_types[mb], b_actions[mb]), b_logprobs, b_values,
                            b_advantages, b_returns)


class MultiAgentPPOTrainer(Trainer):
    """The loop body: a rollout of every agent of every env, one update, weight sync."""

    def reset(self) -> None:
        """First observations (and agent types), and the learner's initial weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.agent_type = self.env.agent_types()
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """Rollout of ``num_steps`` steps, one learner update, weight sync; returns the metrics."""
        for _step in range(self.hparams.num_steps):
            action, log_prob, value = self.actor.act(self.obs, self.agent_type)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(
                obs=self.obs,
                agent_type=self.agent_type,
                action=action,
                log_prob=log_prob,
                value=value,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                next_obs=info["final_obs"],
                next_agent_type=info["final_agent_type"],
            )
            self.obs = next_obs
            self.agent_type = info["agent_type"]
        trajectory = self.buffer.gather()
        metrics = self.learner.learn(trajectory)
        self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="ma_ppo",
    hparams=MultiAgentPPOConfig,
    trainer=MultiAgentPPOTrainer,
    components={"actor": MultiAgentPPOActor, "buffer": MultiAgentRolloutBuffer, "learner": MultiAgentPPOLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.num_steps * total_num_envs,
    action_spaces=(gymnasium.spaces.MultiDiscrete,),
    num_agents=(2, None),
    policy_lag="corrected",  # the clipped ratio to the behaviour policy's log-prob
)
