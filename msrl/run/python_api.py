"""msrl from Python (notebooks, scripts): ``msrl.train``, ``msrl.load``, ``msrl.evaluate``.

::

    import msrl

    result = msrl.train("configs/ppo_cartpole.yaml", seed=3, train__total_env_steps=100_000)
    result.run_dir, result.eval_mean, result.metrics()[-1]["losses/value_loss"]

    policy = msrl.load(result.run_dir)           # the trained actor
    action = policy.act(obs)                     # one observation, or a batch (N, *obs_shape)
    msrl.evaluate(policy, episodes=20)           # deterministic returns on gymnasium envs

They do what ``msrl train`` / ``msrl eval`` do, with the same run directories, checks and errors
(:class:`~msrl.config.ConfigError` for bad input, nothing written).
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping

__all__ = ["train", "load", "evaluate", "TrainedPolicy"]


def _config(config: Any, overrides: Mapping[str, Any]) -> Any:
    """``config`` (a YAML path, a mapping or a RunConfig) with keyword ``overrides`` applied
    (``__`` standing for ``.``), validated."""
    from msrl.config import ConfigError, RunConfig, load_config, set_values, validate

    if isinstance(config, (str, pathlib.Path)):
        config = load_config(config)
    if isinstance(config, RunConfig):
        if not overrides:
            return config
        config = config.model_dump()
    if not isinstance(config, Mapping):
        raise ConfigError(f"a config is a YAML file's path, a mapping or a RunConfig, got {type(config).__name__}")
    return validate(set_values(config, [(key.replace("__", ".").split("."), value) for key, value in overrides.items()]))


def train(config: Any = None, /, *, resume: str | pathlib.Path | None = None, own_process: bool = False,
          **overrides: Any) -> Any:
    """Trains a job and returns its :class:`~msrl.run.outcome.TrainResult` (``run_dir``,
    ``eval_returns``/``eval_mean``, ``env_steps``, ``time_s``, ``metrics()``).

    Args:
        config: a YAML config's path, the same content as a mapping, or a
            :class:`~msrl.config.RunConfig`; optional with ``resume`` (the run's own config).
        resume: a run directory to continue from its last checkpoint (``msrl train --resume``).
        own_process: give this process the ``msrl`` command's start-up shortcuts
            (:func:`msrl.runtime.startup.own_process`: tensordict without its compile marks and
            ``torch.optim`` without TorchDynamo's wrappers, for the rest of the process; about
            as long as ``import torch`` saved). Off by default: without it, training changes
            nothing of torch, ``torch.optim`` or tensordict in your process. Ignored (plain
            torch) where the job compiles a fragment or the torch release is untested.
        **overrides: config keys with ``__`` for ``.`` (``seed=3``,
            ``train__total_env_steps=100_000``), or dotted keys passed as ``**{"env.num_envs": 8}``;
            with ``resume``, only budget-like keys (:data:`msrl.run.rundir.RESUMABLE`).

    Raises:
        ConfigError: an invalid config or override, or a resume that changes a fixed key.
        TraceError, PartitionError: code or a policy msrl cannot honour exactly.
        TrainingStopped: a fragment raised (e.g. a NaN), the last checkpoint is kept.
        TrainingInterrupted: Ctrl-C; the checkpoint is kept, ``resume=`` continues it.
    """
    if own_process:  # before msrl.run.training and the validation, which import tensordict
        _own_process(pathlib.Path(resume) / "config.yaml" if resume is not None and config is None else config, overrides)
    from msrl.run.rundir import resume_config
    from msrl.run.training import train as run_train

    if resume is not None:  # run_train refuses a change outside the resumable keys
        return run_train(_config(resume_config(resume) if config is None else config, overrides), resume=resume)
    if config is None:
        from msrl.config import ConfigError

        raise ConfigError("msrl.train needs a config (a YAML path, a mapping or a RunConfig), or resume=RUN_DIR")
    return run_train(_config(config, overrides))


def _own_process(config: Any, overrides: Mapping[str, Any]) -> None:
    """:func:`msrl.runtime.startup.own_process` for ``msrl.train(..., own_process=True)``: plain torch
    where the config (read, not yet validated) compiles a fragment or cannot be read (its error
    comes from the validation that follows)."""
    from msrl.config import ConfigError, RunConfig, read_config, set_values
    from msrl.runtime.startup import config_compiles, own_process

    try:
        if isinstance(config, (str, pathlib.Path)):
            raw = read_config(config)
        elif isinstance(config, RunConfig):
            raw = config.model_dump()
        else:
            raw = dict(config)
        raw = set_values(raw, [(key.replace("__", ".").split("."), value) for key, value in overrides.items()])
    except (ConfigError, TypeError, ValueError):
        return
    compiles = config_compiles(raw)
    if compiles is not None:
        own_process(compiles=compiles)


class TrainedPolicy:
    """A run's trained actor, for acting outside msrl.

    Attributes:
        actor: the algorithm's :class:`~msrl.api.Actor`, with the checkpoint's weights.
        config: the run's :class:`~msrl.config.RunConfig`.
        observation_space, action_space: one env's (one agent's) spaces.
        num_agents: agents per env.
    """

    def __init__(self, actor: Any, config: Any, env_spec: Any, device: Any) -> None:
        self.actor, self.config, self.device = actor, config, device
        self.observation_space, self.action_space = env_spec.observation_space, env_spec.action_space
        self.num_agents = env_spec.num_agents
        self._state: Any = None  # a recurrent actor's state, carried between act() calls

    def act(self, obs: Any, deterministic: bool = True, episode_start: Any = None) -> Any:
        """The actions for ``obs``.

        Args:
            obs: one env's observation (``obs_shape``; ``(num_agents, *obs_shape)`` for
                multi-agent envs) or a batch with a leading env axis, as a NumPy array or tensor;
                for a Dict observation space, a mapping of each key's value (or batch).
            deterministic: the mode of the action distribution (``False``: a sample).
            episode_start: a recurrent policy (``ppo_lstm``) carries its state from call to call;
                ``(N,)`` bools mark the envs whose episode starts with ``obs`` (their state starts
                afresh; every env's does on the first call, or after :meth:`reset_state`).

        Returns:
            a NumPy array: the action(s), without a batch axis when ``obs`` had none.

        Raises:
            ValueError: ``obs`` has neither the shape of one observation nor of a batch.
        """
        import gymnasium
        import numpy as np
        import torch

        if isinstance(self.observation_space, gymnasium.spaces.Dict):
            return self._act_dict(obs, deterministic, episode_start)
        x = torch.as_tensor(np.asarray(obs) if not isinstance(obs, torch.Tensor) else obs, dtype=torch.float32,
                            device=self.device)
        one = tuple(self.observation_space.shape)
        if self.num_agents > 1:
            one = (self.num_agents, *one)
        if tuple(x.shape) == one:
            single = True
            x = x.unsqueeze(0)
        elif tuple(x.shape[1:]) == one:
            single = False
        else:
            raise ValueError(f"obs of shape {tuple(x.shape)}: expected {one} (one env) or (N, {', '.join(map(str, one))})")
        with torch.no_grad():
            if getattr(self.actor, "recurrent", False):
                out = self._act_recurrent(x, deterministic, episode_start)
            else:
                out = self.actor.act(x, deterministic=deterministic)
        action = (out[0] if isinstance(out, tuple) else out).cpu().numpy()
        return action[0] if single else action

    def _act_dict(self, obs: Any, deterministic: bool, episode_start: Any) -> Any:
        """:meth:`act` for a Dict observation space: ``obs`` is a mapping of one env's values, or
        of batches with a leading env axis, packed as the engines pack them
        (:class:`~msrl.envs.dict_obs.DictLayout`)."""
        import numpy as np
        import torch

        from msrl.envs.dict_obs import DictLayout

        layout = DictLayout(self.observation_space)
        if not hasattr(obs, "keys"):
            raise ValueError(f"obs: this policy takes Dict observations ({layout.describe()}), got a {type(obs).__name__}")
        first = layout.fields[0]
        got = np.shape(np.asarray(obs[first.key])) if first.key in obs else None
        single = got == first.shape
        if not single and (got is None or tuple(got[1:]) != first.shape):
            raise ValueError(f"obs[{first.key!r}] of shape {got}: expected {first.shape} (one env) or (N, ...)")
        if single:
            rows = layout.pack(obs)[None]
        else:
            n = got[0]
            rows = np.stack([layout.pack({k: np.asarray(v)[i] for k, v in obs.items()}) for i in range(n)])
        x = torch.as_tensor(rows, device=self.device)
        with torch.no_grad():
            if getattr(self.actor, "recurrent", False):
                out = self._act_recurrent(x, deterministic, episode_start)
            else:
                out = self.actor.act(x, deterministic=deterministic)
        action = (out[0] if isinstance(out, tuple) else out).cpu().numpy()
        return action[0] if single else action

    def _act_recurrent(self, x: Any, deterministic: bool, episode_start: Any) -> Any:
        """A recurrent actor's step, carrying its state from the last call (a new one for a
        first call, another batch size, or after :meth:`reset_state`)."""
        import torch

        n = x.shape[0]
        if self._state is None or self._state.shape[0] != n:
            self._state = self.actor.initial_state(x)
        if episode_start is not None:
            start = torch.as_tensor(episode_start, dtype=torch.bool, device=x.device).reshape(n)
            self._state = self.actor.end_episodes(self._state, start, torch.zeros_like(start))
        out = self.actor.act(x, self._state, deterministic=deterministic)
        self._state = out[-1]  # (a recurrent actor's new state comes last)
        return out

    def reset_state(self) -> None:
        """A recurrent policy's next :meth:`act` starts every env's episode afresh (no-op for others)."""
        self._state = None


def load(run_dir: str | pathlib.Path, device: str = "cpu") -> TrainedPolicy:
    """The trained actor of a run directory (its last good checkpoint; see
    :func:`msrl.run.checkpoints.load_checkpoint`). It sets this process's torch intra-op threads
    to the run's ``train.torch_threads`` (``torch.set_num_threads``) and leaves them so, since the
    policy acts in this process afterwards: as fast as it trained (on 2 cores, 2 evaluation
    episodes of the main job took 26.7 s with torch's default threads against 7.9 s with the
    run's one). :func:`train` and :func:`evaluate` give the caller's threads back.

    Raises:
        ConfigError: not a run directory, no checkpoint, or no readable one
            (:class:`~msrl.run.checkpoints.CheckpointError`).
    """
    import torch

    from msrl.config import ConfigError, build_job_spec
    from msrl.run.checkpoints import load_checkpoint
    from msrl.run.rundir import load_run_config
    from msrl.runtime.replica import build_standalone_actor

    cfg = load_run_config(run_dir)
    try:
        ckpt, _ = load_checkpoint(run_dir)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    torch.set_num_threads(cfg.train.torch_threads)
    actor, es = build_standalone_actor(build_job_spec(cfg), device)
    actor.set_weights({k: v.to(device) for k, v in ckpt["actor_weights"].items()})
    return TrainedPolicy(actor, cfg, es, torch.device(device))


def evaluate(policy: TrainedPolicy | str | pathlib.Path, episodes: int = 20, seed: int | None = None,
             env_id: str | None = None) -> list[float]:
    """Deterministic episodes of a trained policy on gymnasium envs (env ``i`` seeded ``seed + i``),
    with torch's intra-op threads at the run's ``train.torch_threads`` (as :func:`load` sets them)
    and the run's denormal mode on this thread while they run (``train.flush_denormal``); the
    caller's threads come back afterwards (a ``policy`` loaded here included).

    Args:
        policy: a :class:`TrainedPolicy` or a run directory.
        episodes: >= 1.
        seed: default the run's ``eval.seed``.
        env_id: default the run's evaluation env (its ``eval.env_id``, its training env, or a
            native env's gymnasium twin).

    Returns:
        each episode's undiscounted return.

    Raises:
        ConfigError: ``episodes`` < 1, or no gymnasium env to evaluate on (e.g. native Tag).
    """
    import torch

    from msrl.config import ConfigError
    from msrl.run.evaluation import evaluate as run_episodes
    from msrl.run.evaluation import evaluation_env
    from msrl.runtime.host import flushed_denormals, torch_threads

    if episodes < 1:
        raise ConfigError(f"episodes must be at least 1, got {episodes}")
    with torch_threads(torch.get_num_threads()):  # (the caller's count back, whatever load sets)
        if not isinstance(policy, TrainedPolicy):
            policy = load(policy)
        torch.set_num_threads(policy.config.train.torch_threads)  # as the run trained (see load)
        default_id, kwargs, wrappers = evaluation_env(policy.config)
        env_id = env_id or default_id
        if env_id is None:
            raise ConfigError(f"{policy.config.env.id} has no gymnasium twin to evaluate on; pass env_id=")
        with flushed_denormals(policy.config.train.flush_denormal):  # as the run's fragments computed
            return run_episodes(policy.actor, env_id, episodes, policy.config.eval.seed if seed is None else seed,
                                kwargs if env_id == default_id else {}, device=policy.device, wrappers=wrappers)
