"""What msrl hands components and what an algorithm hands msrl: :class:`EnvSpec`,
:class:`BuildContext`, :class:`ReplayContract`, :class:`EpisodeStats` and :class:`AlgorithmSpec`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import gymnasium
import torch

__all__ = ["EnvSpec", "BuildContext", "ReplayContract", "EpisodeStats", "AlgorithmSpec"]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What a component needs to know of the environment it serves.

    Attributes:
        env_id: the registered id (e.g. ``"CartPole-v1"``).
        observation_space: the space of one env's observation (unbatched).
        action_space: the space of one env's action (unbatched).
        num_envs: envs in this replica's batch (``N`` of the ``(N, ...)`` tensors).
        num_agents: agents per env (1 for single-agent envs; multi-agent envs return
            ``(N, num_agents, ...)`` observations and ``(N, num_agents)`` rewards).
    """

    env_id: str
    observation_space: gymnasium.Space
    action_space: gymnasium.Space
    num_envs: int
    num_agents: int = 1


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """Everything a component factory receives; nothing else is shared between components.

    Attributes:
        hparams: the algorithm's validated hyperparameter dataclass.
        env_spec: spaces and the per-replica env count.
        replica: index of the fragment replica this component is built for, ``0 <= replica <
            num_replicas``.
        num_replicas: replicas of the fragment that holds the component.
        total_num_envs: envs summed over every replica of the env role.
        total_env_steps: the training budget in env steps (for annealing schedules; an offline
            algorithm's: in gradient steps, ``train.total_gradient_steps``).
        seed: the seed of this replica (already offset by the replica index).
        device: torch device the component's tensors live on.
        dataset: where an offline algorithm's dataset is (a
            :class:`msrl.rl.datasets.DatasetSource`; ``None`` for an online algorithm).
    """

    hparams: Any
    env_spec: EnvSpec
    replica: int
    num_replicas: int
    total_num_envs: int
    total_env_steps: int
    seed: int
    device: torch.device
    dataset: Any = None


@dataclasses.dataclass(frozen=True)
class ReplayContract:
    """What a captured iteration (``msrl.runtime.programs.capture``: a CUDA graph on a GPU, a host tape
    on the CPU) may assume of a component: its answer to :meth:`Component.replay_contract`.
    A replay re-runs the iteration's device work and no Python; everything else of the
    component's host state is frozen at the capture (the capture's probe checks that, naming
    what it finds changed).

    Attributes:
        capturable: its methods do all their work in torch ops (and native kernels) on its
            tensors, which a replay re-runs (``False``: an env stepping on the host, e.g.
            gymnasium's; a fragment holding it runs eagerly, saying so).
        counters: integer attributes that advance by the same amount every iteration (a step
            count): after each replay each is advanced by the captured iteration's amount.
        logs: list attributes an iteration appends device tensors to (finished episodes),
            emptied by their reader between iterations: after each replay the captured items,
            holding the replay's values, are appended again.
    """

    capturable: bool = True
    counters: tuple[str, ...] = ()
    logs: tuple[str, ...] = ()


@dataclasses.dataclass
class EpisodeStats:
    """Finished episodes since the last :meth:`Environment.pop_episode_stats`.

    Attributes:
        returns: undiscounted return of each finished episode, float (multi-agent envs: summed
            over the agents).
        lengths: its length in env steps, int.
        extra: further per-episode series by name (e.g. ``tagger_return``), logged as
            ``charts/<name>``.
        lost: episodes cut short because the process stepping their env died (the env engine
            restarted it); counted here, never among ``returns``, and logged as
            ``faults/lost_episodes``.
    """

    returns: list[float]
    lengths: list[int]
    extra: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    lost: int = 0

    def merge(self, other: "EpisodeStats") -> None:
        """Appends ``other``'s episodes to these (in place)."""
        self.returns += other.returns
        self.lengths += other.lengths
        for k, v in other.extra.items():
            self.extra.setdefault(k, []).extend(v)
        self.lost += other.lost


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """How msrl builds an algorithm: registered by the module-level ``ALGORITHM`` of a file
    in ``algorithms/``.

    Attributes:
        name: the YAML value ``algorithm.name``.
        hparams: a dataclass type; its fields (with a one-line doc each) are the keys of
            ``algorithm.hparams``.
        trainer: the :class:`Trainer` subclass.
        components: role -> factory for every role except ``env`` (msrl builds envs).
        env_steps_per_iteration: ``hparams, total_num_envs -> env steps per train_step``.
        observation_spaces, action_spaces: the gymnasium space classes of one agent's
            observation and action it supports (the config refuses an env with others).
        num_agents: the agents per env it supports, ``(least, most)`` (``None``: no limit).
        policy_lag: how its update treats data collected with older weights, which actors of
            a policy with a ``latest`` weights boundary (``async_learner``, overlapped coarse)
            produce: ``"corrected"`` (it corrects for the behaviour policy: V-trace, PPO's
            clipped importance ratio, or off-policy learning from a replay buffer),
            ``"uncorrected"`` (it assumes the learner's own policy acted, as A2C's gradient
            does: the config refuses such policies), ``"tolerated"`` (its update applies what
            older weights computed as it is, by design: A3C's asynchronous gradient push, Mnih et
            al. 2016; the lag is logged), or ``None`` (not declared: a run under such a policy
            says once on stderr that its actors lag).
        offline: it learns from a dataset (the config's ``dataset:``); its ``train_step`` is one
            update and its budget ``train.total_gradient_steps`` (one per iteration). Its
            ``buffer`` role reads the dataset (:class:`msrl.rl.datasets.DatasetBuffer`), and its
            env serves evaluation alone -- unless it trains offline then online (AWAC), stepping
            its env past a number of iterations into a replay buffer that starts with the
            dataset (:class:`msrl.rl.datasets.DatasetReplayBuffer`); the envs count those steps.
            ``env_steps_per_iteration`` gives 0.
        demonstrations: it steps its env and also reads a dataset of an expert's demonstrations
            (the config's ``dataset:``, required; GAIL's discriminator learns from it), its
            budget env steps; an ``offline`` algorithm's dataset is its only experience.
        env_wrapper: ``(env, ctx) -> env``: the algorithm's own env-side code, an
            :class:`~msrl.api.EnvWrapper` around every env batch msrl builds for training
            (AlphaZero's tree search, which must run where the games' states are), or ``None``.
            Its methods are ``env`` calls: every policy places them with the envs.
    """

    name: str
    hparams: type
    trainer: type  # a Trainer subclass (msrl.api.roles: the roles import this module)
    components: Mapping[str, Callable[[BuildContext], Any]]  # role -> ComponentFactory
    env_steps_per_iteration: Callable[[Any, int], int]
    observation_spaces: tuple[type[gymnasium.Space], ...] = (gymnasium.spaces.Box,)
    action_spaces: tuple[type[gymnasium.Space], ...] = (gymnasium.spaces.Discrete, gymnasium.spaces.Box)
    num_agents: tuple[int, int | None] = (1, 1)
    policy_lag: str | None = None
    offline: bool = False
    demonstrations: bool = False
    env_wrapper: Callable[[Any, BuildContext], Any] | None = None

    def __post_init__(self) -> None:
        if self.policy_lag not in (None, "corrected", "uncorrected", "tolerated"):
            raise ValueError(f"AlgorithmSpec.policy_lag={self.policy_lag!r}: expected 'corrected', 'uncorrected', "
                             "'tolerated' or None")

    def unsupported(self, env: EnvSpec) -> str | None:
        """Why this algorithm cannot train on ``env`` (``None`` when it can)."""
        def names(classes: tuple[type, ...]) -> str:
            return " or ".join(c.__name__ for c in classes)

        least, most = self.num_agents
        if env.num_agents < least or (most is not None and env.num_agents > most):
            kind = "single-agent" if most == 1 else f"multi-agent ({least}+ agents per env)"
            return f"{self.name} is {kind}; {env.env_id} has {env.num_agents} agent(s) per env"
        if not isinstance(env.observation_space, self.observation_spaces):
            hint = ""
            if isinstance(env.observation_space, (gymnasium.spaces.Dict, gymnasium.spaces.Tuple)):
                hint = " (env.wrappers: [flatten_observation] makes them one vector)"
            return (f"{self.name} supports {names(self.observation_spaces)} observations; {env.env_id} has "
                    f"{type(env.observation_space).__name__} observations{hint}")
        if not isinstance(env.action_space, self.action_spaces):
            hint = ""
            if (isinstance(env.action_space, gymnasium.spaces.Tuple) and gymnasium.spaces.MultiDiscrete in self.action_spaces
                    and all(isinstance(s, gymnasium.spaces.Discrete) for s in env.action_space.spaces)):
                hint = " (env.wrappers: [multi_discrete_action] takes a Tuple of Discrete actions as one MultiDiscrete)"
            return (f"{self.name} supports {names(self.action_spaces)} actions; {env.env_id} has "
                    f"{type(env.action_space).__name__} actions{hint}")
        return None
