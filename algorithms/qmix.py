"""QMIX and VDN: cooperative multi-agent Q-learning with a value decomposition (Rashid et al.
2018, "QMIX: Monotonic Value Function Factorisation for Deep Multi-Agent Reinforcement
Learning", arXiv:1803.11485; Sunehag et al. 2017, "Value-Decomposition Networks For Cooperative
Multi-Agent Learning", arXiv:1706.05296), as PyMARL / EPyMARL write them.

Every agent acts from one shared recurrent Q-network (EPyMARL's ``RNNAgent``: a linear layer,
a GRU cell, a linear layer to ``Q_i(tau_i, .)``) fed its own observation and its one-hot agent
id, epsilon-greedy per agent. The team's value mixes the agents' chosen values: ``mixer: qmix``
a monotonic mixing network whose weights a hypernetwork makes non-negative from the global state
(Section 4.1, Eqs. 4-5), ``vdn`` their sum (Sunehag et al., Eq. 1), ``none`` no mixing --
independent Q-learners on the team reward (EPyMARL's IQL). The global state is the concatenation
of every agent's observation (MPE's ``state()`` is exactly that). The team reward is the sum of
the agents' rewards (EPyMARL's ``reward_scalarisation: sum``). Training unrolls the agents over
whole replayed episodes from zero GRU states (:class:`msrl.rl.buffers.EpisodeReplay`) and
minimises the masked squared TD error of ``Q_tot`` against ``r + gamma Q_tot^-(s', argmax Q)``
(double Q) with target networks copied every ``target_network_frequency`` env steps (or
Polyak-averaged after every step, ``target_update_tau``); the team
rewards standardised by their running statistics (EPyMARL's ``standardise_rewards``).

Read top to bottom: hyperparameters, the agent network, the mixers, the actor, the learner, the
trainer -- ``steps_per_iteration`` epsilon-greedy steps of every env into the episode replay,
then, once ``learning_starts`` env steps are collected, a target copy when due and
``gradient_steps`` updates. Envs: a PettingZoo parallel env with ``(E, A, D)`` observations,
``(E, A)`` rewards and one ``terminated``/``truncated`` per env, agents sharing one ``Discrete``
action space.

    msrl train configs/qmix_simple_spread.yaml
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn
from torch.nn import functional as F

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    Fraction,
    Learner,
    ModuleWeights,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Trainer,
    UnitInterval,
)
from msrl.normalization import RunningMeanStd
from msrl.rl.buffers import EpisodeReplay
from msrl.rl.continuous import polyak_update_
from msrl.rl.distributions import epsilon_greedy

__all__ = ["QMIXConfig", "RNNAgent", "QMixer", "QMIXActor", "QMIXLearner", "QMIXTrainer", "ALGORITHM"]


@dataclasses.dataclass
class QMIXConfig:
    """QMIX's hyperparameters (EPyMARL's names where it has them, its ``qmix.yaml`` defaults)."""

    mixer: Literal["qmix", "vdn", "none"] = "qmix"
    """how the agents' chosen values make the team's: QMIX's monotonic mixing network, VDN's sum,
    or none (independent Q-learners on the team reward)"""
    learning_rate: PositiveFloat = 5e-4
    """Adam learning rate"""
    gamma: UnitInterval = 0.99
    """discount factor"""
    batch_size: PositiveInt = 32
    """episodes a gradient step"""
    buffer_size: PositiveInt = 5000
    """episodes the replay keeps"""
    episode_limit: PositiveInt = 25
    """the longest episode the env runs, in steps (MPE: its max_cycles)"""
    hidden_dim: PositiveInt = 64
    """width of the agent network's layers and GRU state"""
    agent_id: bool = True
    """append the one-hot agent id to each agent's observation"""
    mixing_embed_dim: PositiveInt = 32
    """width of the QMIX mixing network's hidden layer"""
    hypernet_embed: PositiveInt = 64
    """width of the hypernetworks' hidden layer"""
    double_q: bool = True
    """the target's action chosen by the online network (van Hasselt et al. 2016)"""
    bootstrap_at_time_limit: bool = True
    """bootstrap the TD target where an episode was cut short (truncated); false: an episode's
    last step is terminal however it ended, a finite horizon (EPyMARL's runner on MPE, whose
    envs report no time limit)"""
    standardise_rewards: bool = True
    """train on team rewards standardised by their running mean and std (EPyMARL's qmix.yaml)"""
    target_network_frequency: PositiveInt = 5000
    """env steps (over every env of the job) between target-network copies (EPyMARL: 200 episodes);
    unused with target_update_tau"""
    target_update_tau: Fraction | None = None
    """Polyak rate of a soft target update after every gradient step instead of the copies
    (EPyMARL's target_update_interval_or_tau <= 1)"""
    max_grad_norm: PositiveFloat = 10.0
    """global gradient-norm clip"""
    start_e: UnitInterval = 1.0
    """exploration epsilon at the start"""
    end_e: UnitInterval = 0.05
    """exploration epsilon after epsilon_anneal_time env steps"""
    epsilon_anneal_time: PositiveInt = 50_000
    """env steps over which epsilon falls linearly from start_e to end_e"""
    learning_starts: NonNegativeInt = 1000
    """env steps collected before the first gradient step (the replay must hold batch_size episodes)"""
    steps_per_iteration: PositiveInt = 25
    """vector-env steps an iteration collects before its gradient steps"""
    gradient_steps: NonNegativeInt = 8
    """gradient steps an iteration, once learning has started (with 8 envs and 25-step episodes: one
    per episode collected, as EPyMARL's episode runner)"""


class RNNAgent(nn.Module):
    """EPyMARL's ``RNNAgent``, shared by every agent: ``Q_i(tau_i, .)`` from ``o_i`` (and the
    one-hot id of agent ``i``) through a linear layer, ReLU, a GRU cell and a linear layer.

    Args:
        obs_dim: ``D``; num_agents: ``A``; n_actions: one agent's ``Discrete`` size; hidden_dim:
        ``H``; agent_id: append the one-hot id.
    """

    def __init__(self, obs_dim: int, num_agents: int, n_actions: int, hidden_dim: int, agent_id: bool) -> None:
        super().__init__()
        self.num_agents, self.n_actions, self.hidden_dim, self.agent_id = num_agents, n_actions, hidden_dim, agent_id
        self.fc1 = nn.Linear(obs_dim + (num_agents if agent_id else 0), hidden_dim)
        self.rnn = nn.GRUCell(hidden_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, n_actions)
        self.register_buffer("ids", torch.eye(num_agents), persistent=False)

    def forward(self, obs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: observations ``(N, A, D)`` float32 and GRU states ``(N, A, H)`` to
        ``(Q (N, A, n_actions), next state (N, A, H))``."""
        n, a = obs.shape[:2]
        x = obs.flatten(2)
        if self.agent_id:
            x = torch.cat([x, self.ids.expand(n, -1, -1)], dim=-1)
        h = self.rnn(F.relu(self.fc1(x)).flatten(0, 1), h.reshape(n * a, -1))
        return self.fc2(h).view(n, a, -1), h.view(n, a, -1)

    def unroll(self, obs: torch.Tensor) -> torch.Tensor:
        """Q-values ``(B, T, A, n_actions)`` of episodes ``(B, T, A, D)``, from zero states."""
        h = obs.new_zeros(obs.shape[0], obs.shape[2], self.hidden_dim)
        qs = []
        for t in range(obs.shape[1]):
            q, h = self(obs[:, t], h)
            qs.append(q)
        return torch.stack(qs, dim=1)


class QMixer(nn.Module):
    """QMIX's mixing network (Rashid et al. 2018, Section 4.1): ``Q_tot = w2^T elu(W1^T q + b1)
    + V(s)``, its weights ``|hyper(s)|`` non-negative (so ``dQ_tot / dQ_i >= 0``, Eq. 5), made
    by two-layer hypernetworks from the global state ``s``.

    Args:
        num_agents: ``A``; state_dim: ``S``; embed_dim: the mixing layer's width;
        hypernet_embed: the hypernetworks' hidden width.
    """

    def __init__(self, num_agents: int, state_dim: int, embed_dim: int, hypernet_embed: int) -> None:
        super().__init__()
        self.num_agents, self.embed_dim = num_agents, embed_dim
        self.hyper_w1 = nn.Sequential(nn.Linear(state_dim, hypernet_embed), nn.ReLU(),
                                      nn.Linear(hypernet_embed, embed_dim * num_agents))
        self.hyper_w2 = nn.Sequential(nn.Linear(state_dim, hypernet_embed), nn.ReLU(), nn.Linear(hypernet_embed, embed_dim))
        self.hyper_b1 = nn.Linear(state_dim, embed_dim)
        self.value = nn.Sequential(nn.Linear(state_dim, embed_dim), nn.ReLU(), nn.Linear(embed_dim, 1))

    def forward(self, q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """``Q_tot`` ``(...)`` of the agents' values ``(..., A)`` in states ``(..., S)``."""
        lead = q.shape[:-1]
        q, s = q.reshape(-1, 1, self.num_agents), state.reshape(-1, state.shape[-1])
        w1 = self.hyper_w1(s).abs().view(-1, self.num_agents, self.embed_dim)
        hidden = F.elu(torch.bmm(q, w1) + self.hyper_b1(s).unsqueeze(1))
        w2 = self.hyper_w2(s).abs().view(-1, self.embed_dim, 1)
        return (torch.bmm(hidden, w2).view(-1) + self.value(s).view(-1)).view(lead)


class VDNMixer(nn.Module):
    """VDN's decomposition (Sunehag et al. 2017, Eq. 1): ``Q_tot = sum_i Q_i``."""

    def forward(self, q: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """``Q_tot`` ``(...)`` of the agents' values ``(..., A)`` (the state is not used)."""
        return q.sum(-1)


def _spaces(ctx: BuildContext) -> tuple[int, int, int]:
    """``(A, D, n_actions)`` of the env.

    Raises:
        ValueError: a single-agent env, or agents without a Discrete action space.
    """
    spec = ctx.env_spec
    if spec.num_agents < 2 or not isinstance(spec.action_space, gymnasium.spaces.Discrete):
        raise ValueError(f"QMIX needs a multi-agent env whose agents share a Discrete action space, got "
                         f"{spec.num_agents} agent(s) with {spec.action_space} ({spec.env_id})")
    return spec.num_agents, int(np.prod(spec.observation_space.shape)), int(spec.action_space.n)


def _build_agent(ctx: BuildContext) -> RNNAgent:
    hp, (a, d, n) = ctx.hparams, _spaces(ctx)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed)
        agent = RNNAgent(d, a, n, hp.hidden_dim, hp.agent_id)
    return agent.to(ctx.device)


def _build_mixer(ctx: BuildContext) -> nn.Module | None:
    hp, (a, d, _) = ctx.hparams, _spaces(ctx)
    if hp.mixer == "none":
        return None
    if hp.mixer == "vdn":
        return VDNMixer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(ctx.seed + 3)
        mixer = QMixer(a, a * d, hp.mixing_embed_dim, hp.hypernet_embed)
    return mixer.to(ctx.device)


def episode_replay(ctx: BuildContext) -> EpisodeReplay:
    """The episode replay (:class:`~msrl.rl.buffers.EpisodeReplay`), once sure that its first
    sample finds ``batch_size`` finished episodes in a shard of this replica's envs.

    Raises:
        ConfigError: ``learning_starts`` starts the updates before every shard holds
            ``batch_size`` episodes of up to ``episode_limit`` steps (the least value that does is named).
    """
    from msrl.errors import ConfigError

    hp = ctx.hparams
    envs = max(1, ctx.total_num_envs // ctx.num_replicas)  # the envs writing to one shard
    per_iteration = hp.steps_per_iteration * ctx.total_num_envs
    first = max(1, -(-hp.learning_starts // per_iteration))  # the iteration of the first update
    if hp.gradient_steps and envs * (first * hp.steps_per_iteration // hp.episode_limit) < hp.batch_size:
        steps = -(-hp.batch_size // envs) * hp.episode_limit  # each env's steps for enough episodes
        least = -(-steps // hp.steps_per_iteration) * per_iteration
        raise ConfigError(f"algorithm.hparams.learning_starts={hp.learning_starts}: the first update would find fewer "
                          f"than batch_size={hp.batch_size} finished episodes in a replay shard of {envs} envs (episodes "
                          f"of up to episode_limit={hp.episode_limit} steps); set learning_starts to at least {least}")
    return EpisodeReplay(ctx)


class QMIXActor(Actor):
    """Decentralised execution: each agent epsilon-greedy in its own ``Q_i`` from the shared
    agent network, the GRU states ``(N, A, H)`` a value of the trainer carried from step to step
    as PPO-LSTM's actor carries its LSTM state. Draws from its own generator (seeded ``ctx.seed``)."""

    #: evaluation and :class:`msrl.run.python_api.TrainedPolicy` carry the state between steps
    recurrent = True

    def __init__(self, ctx: BuildContext) -> None:
        self.agent = _build_agent(ctx)
        self.weights = ModuleWeights(self.agent)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def initial_state(self, obs: torch.Tensor) -> torch.Tensor:
        """Zero GRU states ``(N, A, H)`` float32 for the envs whose first observations are ``obs`` ``(N, A, D)``."""
        return obs.new_zeros(obs.shape[0], obs.shape[1], self.agent.hidden_dim, dtype=torch.float32)

    @torch.no_grad()
    def end_episodes(self, state: torch.Tensor, terminated: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """``state`` with the rows of envs whose episode ended zeroed (their next observation starts one)."""
        return state * (~(terminated | truncated)).to(state.dtype)[:, None, None]

    @torch.no_grad()
    def act(self, obs: torch.Tensor, state: torch.Tensor, epsilon: float = 0.0, deterministic: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions ``(N, A)`` int64 at observations ``(N, A, D)`` float32 and the next GRU state
        ``(N, A, H)``: each agent's greedy action, replaced by a uniformly random one with
        probability ``epsilon`` (in ``[0, 1]``); ``deterministic``: greedy."""
        q, state = self.agent(obs, state)
        greedy = q.argmax(-1)
        if deterministic:
            return greedy, state
        return epsilon_greedy(greedy.flatten(), self.agent.n_actions, epsilon, self.generator).view_as(greedy), state

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The agent network's state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the agent network (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"agent": self.agent.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.agent.load_state_dict(state["agent"])
        self.generator.set_state(state["generator"])


class QMIXLearner(Learner):
    """Centralised training: the agents unrolled over replayed episodes, their chosen values
    mixed into ``Q_tot`` and regressed on the double-Q TD target of the target networks (the
    masked mean of the squared TD error over the episodes' steps, PyMARL's ``QLearner``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: QMIXConfig = ctx.hparams
        self.agent, self.mixer = _build_agent(ctx), _build_mixer(ctx)
        self.target_agent, self.target_mixer = _build_agent(ctx), _build_mixer(ctx)
        self._polyak(1.0)  # the targets start as copies
        self.weights = ModuleWeights(self.agent)
        self.parameters = list(self.agent.parameters()) + (list(self.mixer.parameters()) if self.mixer else [])
        self.optimizer = torch.optim.Adam(self.parameters, lr=self.hp.learning_rate)
        #: the team rewards' running statistics (``standardise_rewards``), one over a replicated learner
        self.reward_rms = RunningMeanStd().to(ctx.device)
        self.replicas = ctx.num_replicas

    def describe(self) -> str:
        """``msrl graph``'s note: where the mixing happens."""
        mix = {"qmix": "QMIX's monotonic mixing network (hypernetworks of the global state)",
               "vdn": "VDN's sum", "none": "no mixer (independent Q-learners)"}[self.hp.mixer]
        return (f"agents unrolled over {self.hp.batch_size} replayed episodes an update; their chosen values mixed "
                f"here by {mix}; the actors hold only the agent network")

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """One gradient step on replayed episodes.

        Args:
            batch: TensorDict ``(B,)`` of :class:`~msrl.rl.buffers.EpisodeReplay` episodes:
                ``obs`` ``(B, L + 1, A, D)``, ``action`` ``(B, L, A)``, ``reward`` ``(B, L, A)``,
                ``terminated`` and ``filled`` ``(B, L)``.

        Returns:
            ``losses/td_loss``, ``losses/q_taken`` (mean chosen ``Q_tot``, or ``Q_i`` without a
            mixer), ``losses/target_mean``, ``losses/grad_norm``: 0-d tensors.

        Raises:
            FloatingPointError: the loss is not finite (no step is taken).
        """
        hp = self.hp
        obs, action = batch["obs"], batch["action"].long()
        reward = batch["reward"].sum(-1)  # the team reward (B, L)
        if hp.standardise_rewards:  # (EPyMARL's: every step of the batch, padding included)
            self.reward_rms.update(reward.flatten(), self.reduce_statistics, self.replicas)
            reward = self.reward_rms.normalize(reward)
        filled = batch["filled"]
        ends = batch["terminated"]
        if not hp.bootstrap_at_time_limit:  # every episode's last step ends it
            ends = ends | (filled & ~torch.cat([filled[:, 1:], torch.zeros_like(filled[:, :1])], 1))
        not_done, mask = 1.0 - ends.float(), filled.float()
        q = self.agent.unroll(obs)  # (B, L + 1, A, n)
        chosen = q[:, :-1].gather(-1, action.unsqueeze(-1)).squeeze(-1)  # (B, L, A)
        with torch.no_grad():
            target_q = self.target_agent.unroll(obs)[:, 1:]
            if hp.double_q:
                next_q = target_q.gather(-1, q[:, 1:].argmax(-1, keepdim=True)).squeeze(-1)
            else:
                next_q = target_q.max(-1).values
        state = obs.flatten(2)  # the global state: every agent's observation (B, L + 1, A * D)
        if self.mixer is None:
            taken = chosen
            targets = reward[..., None] + hp.gamma * not_done[..., None] * next_q
            mask = mask[..., None].expand_as(chosen)
        else:
            taken = self.mixer(chosen, state[:, :-1])
            with torch.no_grad():
                targets = reward + hp.gamma * not_done * self.target_mixer(next_q, state[:, 1:])
        td = (taken - targets) * mask
        loss = td.pow(2).sum() / mask.sum()
        grad_norm = self.apply_gradients(loss, hp.max_grad_norm)
        if hp.target_update_tau is not None:
            self._polyak(hp.target_update_tau)
        count = mask.sum()
        return {"losses/td_loss": loss.detach(), "losses/q_taken": (taken.detach() * mask).sum() / count,
                "losses/target_mean": (targets * mask).sum() / count, "losses/grad_norm": grad_norm}

    @torch.no_grad()
    def update_target(self) -> None:
        """Copies the agent network and the mixer into their targets (with ``target_update_tau``:
        nothing; the targets follow every gradient step)."""
        if self.hp.target_update_tau is None:
            self._polyak(1.0)

    def _polyak(self, tau: float) -> None:
        """:func:`msrl.rl.continuous.polyak_update_` of the agent network and the mixer into their
        targets; ``tau`` 1 is an exact copy (``lerp_`` at weight 1 is not bitwise the source on
        every kernel path, which single = coarse x1 would see)."""
        for target, source in [(self.target_agent, self.agent)] + ([(self.target_mixer, self.mixer)] if self.mixer else []):
            if tau == 1.0:
                target.load_state_dict(source.state_dict())
            else:
                polyak_update_(target, source, tau)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The agent network's state dict (detached tensors): all that acting needs."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        mixers = {"mixer": self.mixer.state_dict(), "target_mixer": self.target_mixer.state_dict()} if self.mixer else {}
        return {"agent": self.agent.state_dict(), "target_agent": self.target_agent.state_dict(), **mixers,
                "optimizer": self.optimizer.state_dict(), "reward_rms": self.reward_rms.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.agent.load_state_dict(state["agent"])
        self.target_agent.load_state_dict(state["target_agent"])
        if self.mixer is not None:
            self.mixer.load_state_dict(state["mixer"])
            self.target_mixer.load_state_dict(state["target_mixer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.reward_rms.load_state_dict(state["reward_rms"])


class QMIXTrainer(Trainer):
    """QMIX's loop body: ``steps_per_iteration`` epsilon-greedy steps of every env into the
    episode replay (the GRU states carried across them), then, once ``learning_starts`` env
    steps are collected, a target copy when due and ``gradient_steps`` updates."""

    def reset(self) -> None:
        """First observations, zero GRU states, step counters, the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.state = self.actor.initial_state(self.obs)
        self.global_step = 0
        self.target_synced_at = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the last update's metrics and the exploration epsilon."""
        hp = self.hparams
        for _step in range(hp.steps_per_iteration):
            epsilon = max(hp.end_e, hp.start_e - (hp.start_e - hp.end_e) * self.global_step / hp.epsilon_anneal_time)
            action, self.state = self.actor.act(self.obs, self.state, epsilon)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, terminated=terminated, truncated=truncated,
                               final_obs=info["final_obs"])
            self.state = self.actor.end_episodes(self.state, terminated, truncated)
            self.obs = next_obs
            self.global_step += self.num_envs
        metrics = {}
        if self.global_step >= hp.learning_starts:
            if self.global_step - self.target_synced_at >= hp.target_network_frequency:
                self.learner.update_target()
                self.target_synced_at = self.global_step
            for _update in range(hp.gradient_steps):
                metrics = self.learner.learn(self.buffer.sample())
            self.actor.set_weights(self.learner.get_weights())
        return {**metrics, "charts/epsilon": epsilon}


ALGORITHM = AlgorithmSpec(
    name="qmix",
    hparams=QMIXConfig,
    trainer=QMIXTrainer,
    components={"actor": QMIXActor, "buffer": episode_replay, "learner": QMIXLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.steps_per_iteration * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete,),
    num_agents=(2, None),
    policy_lag="corrected",  # off-policy: learns from replayed episodes
)
