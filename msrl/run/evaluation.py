"""Deterministic evaluation of an actor on fresh envs."""

from __future__ import annotations

import sys
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from msrl.api import Actor
from msrl.envs.gymnasium_env import GymnasiumEnv
from msrl.errors import InputError

__all__ = ["evaluate", "evaluate_job", "evaluation_env", "actor_device", "ActorContractError", "check_evaluable"]


#: seconds after which a running evaluation says how far it is, and then again each time
PROGRESS_EVERY_S = 15.0


class ActorContractError(InputError, TypeError):
    """An actor that does not fit what evaluation calls (:func:`evaluate`), found before training."""


def check_evaluable(actor: Any) -> None:
    """Checks that ``actor`` (an actor class, or an instance) fits what :func:`evaluate` calls:
    ``act(obs, deterministic=True)``, or, for a recurrent one (``recurrent = True``),
    ``initial_state(obs)``, ``act(obs, state, deterministic=True)`` and
    ``end_episodes(state, terminated, truncated)``. An actor built by a factory function is
    checked once built.

    Raises:
        ActorContractError: names the actor class, its ``file:line`` and the call that would fail.
    """
    import inspect

    cls = actor if isinstance(actor, type) else type(actor)
    try:
        where = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        where = cls.__module__
    recurrent = bool(getattr(actor, "recurrent", False))
    needs = ["initial_state", "act", "end_episodes"] if recurrent else ["act"]
    missing = [m for m in needs if not callable(getattr(actor, m, None))]
    call = "act(obs, state, deterministic=True)" if recurrent else "act(obs, deterministic=True)"
    if not missing:
        try:
            params = list(inspect.signature(cls.act).parameters.values())[1:]  # (self)
        except (TypeError, ValueError):  # a builtin or C callable: nothing to read
            return
        keywords = any(p.kind is p.VAR_KEYWORD for p in params) or any(
            p.name == "deterministic" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "deterministic"]
        enough = any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= (2 if recurrent else 1)
        if keywords and enough:
            return
        missing = [f"act{inspect.signature(cls.act)}".replace("(self, ", "(").replace("(self)", "()")]
        raise ActorContractError(
            f"the actor {cls.__qualname__} ({where}) defines {missing[0]}, but evaluation calls {call}: "
            "add a keyword argument deterministic (act greedily when True), as the docs' actor contract says")
    raise ActorContractError(
        f"the {'recurrent ' if recurrent else ''}actor {cls.__qualname__} ({where}) has no {', '.join(missing)}, which "
        f"evaluation calls ({call}{', initial_state(obs), end_episodes(state, terminated, truncated)' if recurrent else ''})")


@torch.no_grad()
def evaluate(
    actor: Actor,
    env_id: str,
    episodes: int,
    seed: int,
    env_kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    wrappers: Sequence[str] = (),
    progress_every_s: float | None = None,
) -> list[float]:
    """Runs ``episodes`` episodes, one per env of a batch, with ``actor.act(obs, deterministic=True)``.

    Args:
        actor: an actor whose ``act`` returns an action ``(N, ...)`` or a tuple whose first
            item is the action; a recurrent one (``actor.recurrent``: :class:`~msrl.rl.recurrent.RecurrentActor`)
            is called ``act(obs, state, deterministic=True)`` with the state it returned (the
            last item of its tuple), ended episodes' rows zeroed (``end_episodes``).
        env_id: gymnasium id; ``env_kwargs``: for ``gymnasium.make``; ``wrappers``: msrl's
            named wrappers, as in training.
        episodes: number of episodes (= envs in the batch), >= 1.
        seed: env ``i`` is seeded with ``seed + i``.
        progress_every_s: an evaluation running longer than this says how far it is on stderr,
            one line each time this many seconds pass (``None``: never).

    Returns:
        the undiscounted return of each episode, in env order (a multi-agent env's: the sum of
        its agents' rewards).

    Raises:
        UnknownEnvError: unknown ``env_id``.
    """
    env = GymnasiumEnv(env_id, episodes, device, env_kwargs, wrappers)
    try:
        obs = env.reset(seed=seed)
        returns = np.zeros(episodes)
        finished = np.zeros(episodes, dtype=bool)
        recurrent = getattr(actor, "recurrent", False)  # it carries a state from step to step
        if recurrent:
            state = actor.initial_state(obs)
        start = said = time.monotonic()
        while not finished.all():
            if progress_every_s is not None and time.monotonic() - said >= progress_every_s:
                said = time.monotonic()
                print(f"msrl: evaluating on {env_id}: {int(finished.sum())} of {episodes} episodes done, "
                      f"{said - start:.0f} s", file=sys.stderr, flush=True)
            if recurrent:
                out = actor.act(obs, state, deterministic=True)
            else:
                out = actor.act(obs, deterministic=True)
            action = out[0] if isinstance(out, tuple) else out
            obs, reward, terminated, truncated, _ = env.step(action)
            if recurrent:
                state = actor.end_episodes(out[-1], terminated, truncated)  # (the new state comes last)
            # (a multi-agent env's (N, A) rewards: the team's return, summed over the agents)
            returns += np.where(finished, 0.0, reward.reshape(episodes, -1).sum(1).cpu().numpy())
            finished |= (terminated | truncated).cpu().numpy()
        return returns.tolist()
    finally:
        env.close()


def evaluate_job(job: Any, cfg: Any) -> list[float]:
    """The final (or a periodic) evaluation of a running job's current policy: ``cfg.eval``'s
    episodes and seed on :func:`evaluation_env`'s env; ``[]`` when there is no gymnasium env to
    evaluate on (e.g. native Tag: the training curves tell). The global generators hold the
    states seeded for ``(eval.seed, "evaluation")`` meanwhile (:mod:`msrl.runtime.generators`),
    and the thread runs it in the job's denormal mode (``train.flush_denormal``).
    With ``train.progress`` on, an evaluation longer than :data:`PROGRESS_EVERY_S` says how far
    it is."""
    from msrl.runtime.generators import BATON, GlobalGenerators
    from msrl.runtime.host import flushed_denormals

    env_id, kwargs, wrappers = evaluation_env(cfg)
    if env_id is None:
        return []
    # an actor drawing from the global generators draws from a stream of the evaluation's own
    # (seeded from eval.seed), never from a replica's: evaluating does not change training
    # the job's denormal mode on this thread, as its fragments run (train.flush_denormal)
    with BATON.hold(GlobalGenerators.seeded(cfg.eval.seed, "evaluation")), flushed_denormals(cfg.train.flush_denormal):
        actor = job.eval_actor()
        return evaluate(actor, env_id, cfg.eval.episodes, cfg.eval.seed, kwargs, device=actor_device(actor),
                        wrappers=wrappers, progress_every_s=PROGRESS_EVERY_S if cfg.train.progress else None)


def evaluation_env(cfg: Any) -> tuple[str | None, dict[str, Any], list[str]]:
    """The gymnasium env id, ``gymnasium.make`` kwargs and msrl wrappers evaluations run on:
    ``eval.env_id`` (with the training env's wrappers) if set, else the training env, or a
    native env's gymnasium counterpart (``None`` when a native env has none); ``eval.env_kwargs``
    over the kwargs."""
    from msrl.envs import eval_env_id, is_native

    own = dict(cfg.eval.env_kwargs or {})
    if cfg.eval.env_id:
        return cfg.eval.env_id, own, list(cfg.env.wrappers)
    if is_native(cfg.env.id):
        return eval_env_id(cfg.env.id), own, []
    if eval_env_id(cfg.env.id) is None:
        return None, {}, []
    from msrl.envs.engines import engine

    env_id, kwargs, wrappers = engine(cfg.env.engine).evaluation(cfg.env.id, cfg.env.kwargs, cfg.env.wrappers)
    return env_id, {**kwargs, **own}, wrappers


def actor_device(actor: Any) -> torch.device:
    """The device of an actor's first parameter (CPU when it has none)."""
    for v in actor.get_weights().values():
        return v.device
    return torch.device("cpu")
