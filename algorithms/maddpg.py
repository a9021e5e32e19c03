"""MADDPG: multi-agent DDPG with centralised critics and decentralised actors (Lowe et al. 2017,
"Multi-Agent Actor-Critic for Mixed Cooperative-Competitive Environments", arXiv:1706.02275,
Algorithm 1), as the paper's code writes it.

Every agent ``i`` has its own deterministic actor ``mu_i(o_i)`` and its own centralised critic
``Q_i(x, a_1, ..., a_N)``, where ``x`` is every agent's observation: the critics see everything in
training, the actors only their own observation (so acting needs nothing else). Each critic
regresses on ``y_i = r_i + gamma Q_i'(x', mu_1'(o_1'), ..., mu_N'(o_N'))`` with its own agent's
reward (the agents may compete: ``simple_adversary``), and each actor climbs ``Q_i`` with its own
action replaced by its policy's and the others' as replayed (Eq. 6). Targets are Polyak-averaged.

Actions: a ``Box`` agent action space (MPE's ``continuous_actions=True``) takes ``tanh`` squashed
into the bounds plus Gaussian exploration noise; a ``Discrete`` one takes the Gumbel-softmax
(Jang et al. 2017; the paper's Section 4.1 for discrete communication): the critics see one-hot
actions, the actor's gradient passes a relaxed sample, acting samples the categorical.

Read top to bottom: hyperparameters, the per-agent networks, the actor, the learner, the trainer
-- ``steps_per_iteration`` steps of every env into a replay buffer of joint transitions, then, once
``learning_starts`` env steps are collected, ``gradient_steps`` updates of every critic and actor.
Envs: a PettingZoo parallel env with ``(E, A, D)`` observations (agents of unequal observation
spaces through ``env.wrappers: [pad_observations]``, SuperSuit's) and ``(E, A)`` rewards.

    msrl train configs/maddpg_simple_spread.yaml
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import gymnasium
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from msrl.api import (
    Actor,
    AlgorithmSpec,
    BuildContext,
    Fraction,
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
from msrl.rl.buffers import ReplayBuffer
from msrl.rl.continuous import polyak_update_, relu_mlp

__all__ = ["MADDPGConfig", "AgentNetworks", "gumbel_softmax", "MADDPGActor", "MADDPGLearner", "MADDPGTrainer",
           "ALGORITHM"]


@dataclasses.dataclass
class MADDPGConfig:
    """MADDPG's hyperparameters (the paper's Appendix: its MPE settings)."""

    learning_rate: PositiveFloat = 0.01
    """Adam learning rate of the actors and of the critics"""
    gamma: UnitInterval = 0.95
    """discount factor"""
    tau: Fraction = 0.01
    """target networks' Polyak rate"""
    batch_size: PositiveInt = 1024
    """transitions per gradient step"""
    buffer_size: PositiveInt = 1_000_000
    """replay capacity in transitions"""
    hidden_sizes: LayerSizes = (64, 64)
    """hidden layer widths of every actor and critic (ReLU)"""
    learning_starts: NonNegativeInt = 25_600
    """env steps collected before the first update (the paper's code: batch_size x 25)"""
    steps_per_iteration: PositiveInt = 25
    """vector-env steps an iteration collects before its updates"""
    gradient_steps: NonNegativeInt = 2
    """updates of every critic and actor an iteration, once learning has started"""
    exploration_noise: NonNegativeFloat = 0.1
    """Box actions: std of the Gaussian acting noise, a fraction of the action range's half-width"""
    gumbel_temperature: PositiveFloat = 1.0
    """Discrete actions: the Gumbel-softmax relaxation's temperature"""
    policy_regularization: NonNegativeFloat = 1e-3
    """weight of the actors' squared pre-activation outputs in their loss (the paper's code)"""
    max_grad_norm: PositiveFloat = 0.5
    """global gradient-norm clip of the critics' and of the actors' step (the paper's code)"""
    actor_actions: Literal["replayed", "current"] = "replayed"
    """the other agents' actions in an actor's loss: ``replayed`` (the paper's Eq. 6: each actor
    climbs its own critic, the others' actions from the minibatch) or ``current`` (every agent's
    action from its current actor, the gradient through all of them: each actor climbs every
    agent's critic, as TorchRL's ``DDPGLoss`` over a centralised critic does)"""

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)


class AgentNetworks(nn.Module):
    """One ReLU MLP per agent (no parameter sharing): inputs ``(B, A, n_in)`` to ``(B, A,
    n_out)``, agent ``i``'s network on row ``i``; :meth:`one` runs agent ``i``'s alone."""

    def __init__(self, num_agents: int, n_in: int, hidden: tuple[int, ...], n_out: int) -> None:
        super().__init__()
        self.nets = nn.ModuleList(relu_mlp(n_in, hidden, n_out) for _ in range(num_agents))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every agent's network on its own row: ``(B, A, n_in) -> (B, A, n_out)``."""
        return torch.stack([net(x[:, i]) for i, net in enumerate(self.nets)], dim=1)

    def one(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Agent ``i``'s network: ``(B, n_in) -> (B, n_out)``."""
        return self.nets[i](x)


def _gumbel(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of ``logits``' shape, ``u`` uniform from ``generator``."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp(1e-10, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def gumbel_softmax(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """A relaxed one-hot sample ``softmax((logits + g) / temperature)``, ``g`` standard Gumbel
    noise from ``generator`` (Jang et al. 2017, Eq. 1): ``(..., n) -> (..., n)`` float32,
    differentiable in ``logits``; ``temperature`` > 0."""
    return torch.softmax((logits + _gumbel(logits, generator)) / temperature, dim=-1)


def _spaces(ctx: BuildContext) -> tuple[int, int, int, gymnasium.Space]:
    """``(A, D, action width, the agent action space)``.

    Raises:
        ValueError: a single-agent env, or an agent action space other than Discrete and bounded Box.
    """
    spec, space = ctx.env_spec, ctx.env_spec.action_space
    if spec.num_agents < 2:
        raise ValueError(f"MADDPG needs a multi-agent env, got {spec.env_id} with {spec.num_agents} agent")
    if isinstance(space, gymnasium.spaces.Box) and not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
        raise ValueError(f"MADDPG squashes Box actions into their bounds; {space} is unbounded")
    width = int(space.n) if isinstance(space, gymnasium.spaces.Discrete) else int(np.prod(space.shape))
    return spec.num_agents, int(np.prod(spec.observation_space.shape)), width, space


def _build(ctx: BuildContext, seed: int, critic: bool) -> AgentNetworks:
    """The actors (``critic=False``: ``o_i`` to actions or logits) or the centralised critics
    (every observation and action to ``Q_i``), initialised from ``seed`` alone."""
    a, d, k, _ = _spaces(ctx)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = AgentNetworks(a, a * (d + k) if critic else d, ctx.hparams.hidden_sizes, 1 if critic else k)
    return net.to(ctx.device)


class _Actions:
    """What an actor's output means: the bounds of Box actions, or the Gumbel-softmax of Discrete."""

    def __init__(self, ctx: BuildContext) -> None:
        _, _, self.width, space = _spaces(ctx)
        self.discrete = isinstance(space, gymnasium.spaces.Discrete)
        if not self.discrete:
            low = torch.as_tensor(space.low, dtype=torch.float32, device=ctx.device).flatten()
            high = torch.as_tensor(space.high, dtype=torch.float32, device=ctx.device).flatten()
            self.low, self.high, self.scale, self.bias = low, high, (high - low) / 2, (high + low) / 2
            self.shape = tuple(space.shape)

    def squash(self, out: torch.Tensor) -> torch.Tensor:
        """Box: ``tanh(out)`` into the bounds ``(..., k)``."""
        return torch.tanh(out) * self.scale + self.bias

    def one_hot(self, action: torch.Tensor) -> torch.Tensor:
        """The critics' view of replayed actions ``(B, A)`` int64 (one-hot ``(B, A, n)``) or ``(B, A, *shape)``."""
        return F.one_hot(action.long(), self.width).float() if self.discrete else action.flatten(2).float()


class MADDPGActor(Actor):
    """Decentralised acting: every agent's own actor on its own observation, with exploration
    (Gaussian noise on Box actions, a categorical sample of Discrete ones) drawn from the
    actor's own generator (seeded ``ctx.seed``)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.policy = _build(ctx, ctx.seed, critic=False)
        self.weights = ModuleWeights(self.policy)
        self.actions = _Actions(ctx)
        self.exploration_noise = float(ctx.hparams.exploration_noise)
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions at observations ``(N, A, D)`` float32: ``(N, A)`` int64 (Discrete; sampled
        from the softmax, its argmax when ``deterministic``) or ``(N, A, *shape)`` float32 within
        the bounds (Box; ``mu_i(o_i)`` plus noise, without when ``deterministic``)."""
        out = self.policy(obs.flatten(2))
        acts = self.actions
        if acts.discrete:
            if deterministic:
                return out.argmax(-1)
            return (out + _gumbel(out, self.generator)).argmax(-1)  # the Gumbel-max trick: a softmax sample
        action = acts.squash(out)
        if not deterministic:
            noise = torch.randn(action.shape, generator=self.generator, device=action.device)
            action = torch.max(torch.min(action + noise * (self.exploration_noise * acts.scale), acts.high), acts.low)
        return action.view(*action.shape[:2], *acts.shape)

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actors' state dict (detached tensors)."""
        return self.weights.get()

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` into the actors (in place)."""
        self.weights.load_(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.generator.set_state(state["generator"])


class MADDPGLearner(Learner):
    """Every agent's centralised critic towards its target, then every agent's actor up its own
    critic (Algorithm 1), the targets Polyak-averaged; two Adam optimisers (all critics, all actors)."""

    def __init__(self, ctx: BuildContext) -> None:
        self.hp: MADDPGConfig = ctx.hparams
        self.actions = _Actions(ctx)
        self.policy, self.policy_target = _build(ctx, ctx.seed, False), _build(ctx, ctx.seed, False)
        self.critic, self.critic_target = _build(ctx, ctx.seed + 1, True), _build(ctx, ctx.seed + 1, True)
        self.weights = ModuleWeights(self.policy)
        self.critic_parameters = list(self.critic.parameters())
        self.critic_optimizer = torch.optim.Adam(self.critic_parameters, lr=self.hp.learning_rate)
        self.policy_optimizer = torch.optim.Adam(list(self.policy.parameters()), lr=self.hp.learning_rate)
        self.optimizer, self.parameters = self.critic_optimizer, self.critic_parameters
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(ctx.seed + 1)

    def _policy_actions(self, out: torch.Tensor) -> torch.Tensor:
        """The critics' view of actors' outputs ``(B, A, k)``: the squashed action, or a relaxed one-hot sample."""
        if self.actions.discrete:
            return gumbel_softmax(out, self.hp.gumbel_temperature, self.generator)
        return self.actions.squash(out)

    def learn(self, batch: TensorDict) -> dict[str, torch.Tensor]:
        """One update of every critic and every actor on a replay minibatch.

        Args:
            batch: TensorDict ``(B,)`` with :attr:`~msrl.rl.buffers.ReplayBuffer.KEYS`: ``obs``
                and ``next_obs`` ``(B, A, D)``, ``action`` ``(B, A)`` or ``(B, A, *shape)``,
                ``reward`` ``(B, A)``, ``terminated`` ``(B,)``.

        Returns:
            ``losses/critic_loss`` (the agents' MSEs summed), ``losses/actor_loss``,
            ``losses/q_values``, ``losses/critic_grad_norm``, ``losses/actor_grad_norm``: 0-d tensors.

        Raises:
            FloatingPointError: a loss is not finite (no step is taken).
        """
        hp = self.hp
        obs, next_obs = batch["obs"].flatten(2), batch["next_obs"].flatten(2)
        B, A = obs.shape[:2]
        joint = obs.flatten(1)[:, None].expand(B, A, -1)  # every critic sees every observation
        with torch.no_grad():
            next_actions = self._policy_actions(self.policy_target(next_obs)).flatten(1)
            x2 = torch.cat([next_obs.flatten(1), next_actions], -1)[:, None].expand(B, A, -1)
            target = batch["reward"] + hp.gamma * (1.0 - batch["terminated"].float())[:, None] * \
                self.critic_target(x2).squeeze(-1)
        replayed = self.actions.one_hot(batch["action"])  # (B, A, k)
        q = self.critic(torch.cat([joint, replayed.flatten(1)[:, None].expand(B, A, -1)], -1)).squeeze(-1)
        critic_loss = ((q - target) ** 2).mean(0).sum()
        critic_norm = self.apply_gradients(critic_loss, hp.max_grad_norm, optimizer=self.critic_optimizer)
        # each actor up its own critic, its action the policy's and the others' as replayed (Eq. 6)
        out = self.policy(obs)
        mine = self._policy_actions(out)
        for p in self.critic_parameters:  # the critics pass gradients to the actions only
            p.requires_grad_(False)
        try:
            if hp.actor_actions == "current":  # every critic on every actor's current actions
                x = torch.cat([joint, mine.flatten(1)[:, None].expand(B, A, -1)], -1)
                losses = -self.critic(x).squeeze(-1).mean(0)
            else:
                losses = []
                for i in range(A):
                    own = torch.zeros(1, A, 1, device=obs.device)
                    own[0, i] = 1.0
                    actions = replayed * (1.0 - own) + mine * own
                    losses.append(-self.critic.one(i, torch.cat([obs.flatten(1), actions.flatten(1)], -1)).mean())
                losses = torch.stack(losses)
            actor_loss = losses.sum() + hp.policy_regularization * (out ** 2).mean()
        finally:
            for p in self.critic_parameters:
                p.requires_grad_(True)
        actor_norm = self.apply_gradients(actor_loss, hp.max_grad_norm, optimizer=self.policy_optimizer)
        polyak_update_(self.critic_target, self.critic, hp.tau)
        polyak_update_(self.policy_target, self.policy, hp.tau)
        return {"losses/critic_loss": critic_loss.detach(), "losses/actor_loss": actor_loss.detach(),
                "losses/q_values": q.detach().mean(), "losses/critic_grad_norm": critic_norm,
                "losses/actor_grad_norm": actor_norm}

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The actors' state dict (detached tensors): all that acting needs."""
        return self.weights.get()

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "policy_target": self.policy_target.state_dict(),
                "critic": self.critic.state_dict(), "critic_target": self.critic_target.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict(),
                "policy_optimizer": self.policy_optimizer.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in ("policy", "policy_target", "critic", "critic_target", "critic_optimizer", "policy_optimizer"):
            getattr(self, name).load_state_dict(state[name])
        self.generator.set_state(state["generator"])


class MADDPGTrainer(Trainer):
    """MADDPG's loop body: ``steps_per_iteration`` steps of every env into the replay buffer,
    then, once ``learning_starts`` env steps are collected, ``gradient_steps`` updates."""

    def reset(self) -> None:
        """First observations, the step counter, the learner's weights to the actor."""
        self.obs = self.env.reset(seed=self.seed)
        self.global_step = 0
        self.actor.set_weights(self.learner.get_weights())

    def train_step(self) -> dict[str, Any]:
        """One iteration; returns the last update's metrics (empty before learning starts)."""
        hp = self.hparams
        for _step in range(hp.steps_per_iteration):
            action = self.actor.act(self.obs)
            next_obs, reward, terminated, truncated, info = self.env.step(action)
            self.buffer.insert(obs=self.obs, action=action, reward=reward, next_obs=info["final_obs"],
                               terminated=terminated)
            self.obs = next_obs
            self.global_step += self.num_envs
        metrics = {}
        if self.global_step >= hp.learning_starts:
            for _update in range(hp.gradient_steps):
                metrics = self.learner.learn(self.buffer.sample())
            self.actor.set_weights(self.learner.get_weights())
        return metrics


ALGORITHM = AlgorithmSpec(
    name="maddpg",
    hparams=MADDPGConfig,
    trainer=MADDPGTrainer,
    components={"actor": MADDPGActor, "buffer": ReplayBuffer, "learner": MADDPGLearner},
    env_steps_per_iteration=lambda hp, total_num_envs: hp.steps_per_iteration * total_num_envs,
    action_spaces=(gymnasium.spaces.Discrete, gymnasium.spaces.Box),
    num_agents=(2, None),
    policy_lag="corrected",  # off-policy: learns from a replay buffer
)
