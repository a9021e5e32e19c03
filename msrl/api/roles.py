"""The roles an algorithm is made of: :class:`Component` and its roles :class:`Environment`,
:class:`Actor`, :class:`Learner` (with its declared collective points), :class:`Buffer`, and the
:class:`Trainer` whose ``train_step`` the tracer reads."""

from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from msrl.api.specs import BuildContext, EnvSpec, EpisodeStats, ReplayContract
from msrl.errors import InputError

__all__ = ["ROLES", "Component", "UndeclaredStateError", "check_declared_state", "Environment", "EnvWrapper",
           "ModuleWeights",
           "Actor", "Learner", "Buffer", "Trainer", "ComponentFactory", "COLLECTIVE_POINTS", "collective_scope",
           "in_gradient_step"]

#: The component roles a trainer may hold, in the order the partitioner reports them.
ROLES: tuple[str, ...] = ("env", "actor", "buffer", "learner")


class Component:
    """Base of every role. Components are plain objects; their state is saved by
    :meth:`state_dict` and restored by :meth:`load_state_dict` for exact resume; what a
    captured iteration may assume of their host state they declare by :meth:`replay_contract`.
    """

    def replay_contract(self) -> ReplayContract:
        """What a replayed iteration may assume of this component (:class:`ReplayContract`).
        Default: all its work is torch ops on its tensors; no host bookkeeping to repeat."""
        return ReplayContract()

    def compile_targets(self) -> tuple[str, ...]:
        """Attribute paths, from this component, of its methods and functions that are pure
        tensor code (no host reads, no Python branching on tensor values, no ``torch.Generator``
        arguments, fixed shapes per call site), e.g. ``("net.head",)``: what
        ``distribution_policy.compile.<fragment>: inductor`` replaces by its ``torch.compile``
        (:mod:`msrl.runtime.programs.compiled`). Default: none."""
        return ()

    def state_dict(self) -> dict[str, Any]:
        """Returns everything needed to continue exactly (weights, optimiser, RNG states)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            KeyError: when ``state`` lacks an entry this component saved.
        """
        del state


class UndeclaredStateError(InputError, TypeError):
    """A component holds training state (networks, optimisers, tensors, generators) but does not
    define :meth:`Component.state_dict` and :meth:`Component.load_state_dict`: a checkpoint would
    not hold it and ``--resume`` would silently restart it (found when the job is built)."""


#: what a component's state is made of (a checkpoint must hold it for an exact resume)
_STATE_TYPES = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Generator)


def _held_state(component: Any) -> str | None:
    """The first attribute of ``component`` (or an item of a list, tuple or dict attribute) that is
    training state, as ``self.<name>`` with its type; ``None`` when it holds none."""
    for name, value in vars(component).items():
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, item in [(None, value), *items]:
            if isinstance(item, _STATE_TYPES):
                where = f"self.{name}" if key is None else f"self.{name}[{key!r}]"
                return f"{where} (a {type(item).__module__.split('.')[0]}.{type(item).__qualname__})"
    return None


def check_declared_state(role: str, component: Any) -> None:
    """Checks that a component holding training state saves it: it must define both
    :meth:`~Component.state_dict` and :meth:`~Component.load_state_dict` (the base class's return
    and take nothing). Components that hold no tensors, networks, optimisers or generators pass.

    Raises:
        UndeclaredStateError: names the role, the class with its ``file:line``, what it holds
            and the two methods to define.
    """
    cls = type(component)
    missing = [m for m in ("state_dict", "load_state_dict") if getattr(cls, m, None) is getattr(Component, m)]
    if not missing or not isinstance(component, Component):
        return
    held = _held_state(component)
    if held is None:
        return
    import inspect

    try:
        where = f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        where = cls.__module__
    raise UndeclaredStateError(
        f"the {role} {cls.__qualname__} ({where}) holds {held} but does not define "
        f"{' and '.join(missing)}: a checkpoint would not hold it and --resume would silently restart it; define "
        "state_dict() returning everything needed to continue exactly (weights, optimiser state, RNG states) and "
        "load_state_dict(state) restoring it")


class Environment(Component):
    """A batch of ``N`` environments stepped together, on torch tensors.

    Autoreset contract (gymnasium's ``SAME_STEP`` mode): when env ``i`` terminates or is
    truncated at a step, the returned observation row ``i`` is already the first observation
    of its next episode, and ``info["final_obs"]`` row ``i`` is the last observation of the
    finished episode. Rows of envs that did not finish hold the same value in both. The final
    observation is therefore never the start of the next episode, and is there to bootstrap
    truncated episodes. When no env finished, an env may return the observation tensor itself
    as ``info["final_obs"]``: read both, never write either in place.
    """

    spec: EnvSpec

    def replay_contract(self) -> ReplayContract:
        """Host envs (gymnasium's, a worker-process engine) step outside torch: a replayed
        iteration would not step them (native envs, whose steps are torch ops and kernels,
        declare otherwise)."""
        return ReplayContract(capturable=False)

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """Resets every env.

        Args:
            seed: env ``i`` is seeded with ``seed + i``; ``None`` keeps the RNG streams.

        Returns:
            observations ``(N, *obs_shape)``.
        """
        raise NotImplementedError

    def step(
        self, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Steps every env once.

        Args:
            action: ``(N, *action_shape)``; int64 for discrete spaces, float32 for boxes.

        Returns:
            ``(obs, reward, terminated, truncated, info)``: obs ``(N, *obs_shape)``, reward
            ``(N,)`` float32, terminated and truncated ``(N,)`` bool, and info with
            ``"final_obs"`` ``(N, *obs_shape)`` as described in the class docstring.
        """
        raise NotImplementedError

    def pop_episode_stats(self) -> EpisodeStats:
        """Returns and forgets the episodes finished since the last call."""
        raise NotImplementedError

    @property
    def env_steps(self) -> int:
        """Env steps taken so far, summed over the batch (``N`` per :meth:`step`)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases the envs' resources."""


class EnvWrapper(Environment):
    """An algorithm's own env-side code around the env msrl builds (its
    :attr:`~msrl.api.AlgorithmSpec.env_wrapper`): what must run where the envs' states are, such
    as AlphaZero's tree search, which clones the games it searches. Its methods are calls of the
    ``env`` role, so every policy places them with the envs (beside the actor under coarse; in
    the env replicas under ``single_learner_fine``, whose central actor then serves the search's
    network evaluations batched).

    Everything the :class:`Environment` contract names is the wrapped env's (:attr:`env`); a
    subclass adds its own methods and saves its own state by extending :meth:`state_dict` and
    :meth:`load_state_dict`. Attributes it does not define are the wrapped env's.
    """

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.spec = env.spec

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # (not yet set: during unpickling)
            raise AttributeError(name)
        return getattr(self.env, name)

    def replay_contract(self) -> ReplayContract:
        """The wrapped env's (a host wrapper keeps a host env uncapturable)."""
        return self.env.replay_contract()

    def reset(self, seed: int | None = None) -> torch.Tensor:
        """The wrapped env's :meth:`Environment.reset`."""
        return self.env.reset(seed)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  dict[str, torch.Tensor]]:
        """The wrapped env's :meth:`Environment.step`."""
        return self.env.step(action)

    def pop_episode_stats(self) -> EpisodeStats:
        """The wrapped env's."""
        return self.env.pop_episode_stats()

    @property
    def env_steps(self) -> int:
        """The wrapped env's."""
        return self.env.env_steps

    def close(self) -> None:
        """Closes the wrapped env."""
        self.env.close()

    def state_dict(self) -> dict[str, Any]:
        """``{"env": the wrapped env's state}`` (a subclass adds its own keys)."""
        return {"env": self.env.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the wrapped env's state (a subclass restores its own keys too)."""
        self.env.load_state_dict(state["env"])


class ModuleWeights:
    """A module's state-dict tensors, listed once, for weight sync between a learner and an
    actor (``get_weights`` / ``set_weights``) at the cost of a dict copy and one ``copy_`` per
    tensor: ``state_dict()`` and ``load_state_dict()`` walk the module tree at every call,
    several times an iteration of small jobs (``bench/results/startup.md``, "Figures behind the code").

    The module's parameters and buffers must be updated in place from construction on (as
    optimisers, ``load_state_dict`` and :class:`~msrl.normalization.RunningMeanStd` do):
    build this after moving the module to its device; a tensor assigned anew later is not
    seen.

    Args:
        module: the network whose weights are synced.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.tensors = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}

    def get(self) -> dict[str, torch.Tensor]:
        """The state dict: a new dict of detached tensors sharing the module's storage."""
        return dict(self.tensors)

    @torch.no_grad()
    def load_(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` (keys and shapes those of :meth:`get`) into the module in place.

        Raises:
            KeyError: ``weights`` lacks a key of the module's state dict or has another.
            ValueError: a tensor's shape differs from the module's (nothing is copied).
        """
        if weights.keys() != self.tensors.keys():
            missing = sorted(self.tensors.keys() - weights.keys())
            unexpected = sorted(weights.keys() - self.tensors.keys())
            raise KeyError(f"{type(self.module).__name__} weights: missing keys {missing}, unexpected keys {unexpected}")
        srcs = [weights[k] for k in self.tensors]
        for (k, dst), src in zip(self.tensors.items(), srcs):  # every check before any copy
            if src.shape != dst.shape:
                raise ValueError(f"{type(self.module).__name__} weights: {k!r} has shape {tuple(src.shape)}, "
                                 f"the module's has {tuple(dst.shape)}; nothing was copied")
        # one multi-tensor copy (on a GPU one kernel per dtype, not one per tensor: 12 of a PPO
        # iteration's ~720 launches were these); torch falls back to per-tensor copies across
        # devices and dtypes, with copy_'s results
        torch._foreach_copy_(list(self.tensors.values()), srcs)


class Actor(Component):
    """Policy inference. Typical use inside ``train_step``::

        action, log_prob, value = self.actor.act(self.obs)
        ...
        self.actor.set_weights(self.learner.get_weights())
    """

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> Any:
        """Chooses actions for a batch of observations ``(N, *obs_shape)``."""
        raise NotImplementedError

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Returns the policy's parameters (a state dict of detached tensors)."""
        raise NotImplementedError

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copies ``weights`` (as returned by ``Learner.get_weights``) into the policy."""
        raise NotImplementedError


def _clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)`` for gradients of one
    device and dtype, bitwise equal to it (the same foreach ops in the same order) without its
    grouping and checks (a third of the call on a small MLP: ``bench/results/startup.md``, "Figures
    behind the code"); other cases go to it.
    Returns the total norm before clipping, a 0-d tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or any(g.device != grads[0].device or g.dtype != grads[0].dtype or g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total


#: The learner's declared collective points: what a replicated learner averages over its
#: replicas, each reached through its method -- ``"gradients"``: every gradient step's
#: gradients (:meth:`Learner.apply_gradients`, as torch DDP); ``"statistics"``: running
#: statistics such as observation normalisation's (:meth:`Learner.reduce_statistics`, as
#: SyncBatchNorm beside DDP). The partitioner gives each point a call reaches its own
#: ``allreduce`` node.
COLLECTIVE_POINTS: tuple[str, ...] = ("gradients", "statistics")

#: (id of a learner, point) -> what reduces there, for the code running in this context
_NO_REDUCERS: Mapping[tuple[int, str], Callable[[list[torch.Tensor]], Any]] = types.MappingProxyType({})
_REDUCERS: contextvars.ContextVar[Mapping[tuple[int, str], Callable[[list[torch.Tensor]], Any]]] = contextvars.ContextVar(
    "msrl_collective_reducers", default=_NO_REDUCERS)
_IN_GRADIENT_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("msrl_in_gradient_step", default=False)


@contextlib.contextmanager
def collective_scope(learner: Any, point: str, reduce: Callable[[list[torch.Tensor]], Any]) -> Iterator[None]:
    """While the block runs (in this thread or task: a ``contextvars`` scope, nothing is set on
    ``learner``), ``learner``'s collective point ``point`` passes its tensors to ``reduce``,
    which replaces them in place by their mean over the learner's replicas. What a generated
    program's ``allreduce`` region opens around its call
    (:meth:`msrl.runtime.endpoint.Endpoint.allreduce`); the probe opens it to see which calls
    reach which point.

    Raises:
        ValueError: ``point`` is not one of :data:`COLLECTIVE_POINTS`.
    """
    if point not in COLLECTIVE_POINTS:
        raise ValueError(f"unknown collective point {point!r}; points are {COLLECTIVE_POINTS}")
    token = _REDUCERS.set({**_REDUCERS.get(), (id(learner), point): reduce})
    try:
        yield
    finally:
        _REDUCERS.reset(token)


def in_gradient_step() -> bool:
    """Whether the code running now is inside :meth:`Learner.apply_gradients` (an optimiser
    stepped outside it is not at the learner's gradient point: the probe names its line)."""
    return _IN_GRADIENT_STEP.get()


class Learner(Component):
    """Owns the trained networks and their optimisers. Typical use::

        metrics = self.learner.learn(batch)

    Subclasses set ``self.parameters`` (list of tensors) and ``self.optimizer`` and take
    every gradient step through :meth:`apply_gradients`. A learner with several optimisers
    (SAC: actor, twin critics, entropy temperature) passes each step's optimiser:
    ``self.apply_gradients(critic_loss, optimizer=self.q_optimizer)``, one call per optimiser,
    so the gradient all-reduce (``multi_learner``) covers each. Running statistics that every
    replica must share (observation or return normalisation) go through
    :meth:`reduce_statistics`.
    """

    parameters: list[torch.Tensor]
    optimizer: torch.optim.Optimizer

    def _reduce(self, point: str, tensors: list[torch.Tensor]) -> None:
        reduce = _REDUCERS.get().get((id(self), point))
        if reduce is not None:
            reduce(tensors)

    def reduce_statistics(self, tensors: list[torch.Tensor]) -> None:
        """The statistics collective point: replaces ``tensors`` (one dtype, e.g. a batch's
        float64 moments) in place by their mean over a replicated learner's replicas, so every
        replica's running statistics stay bitwise equal; a single learner's are left as they
        are. An ``allreduce`` node of the graph of its own (``<method>/a<k>:statistics``).

        Args:
            tensors: this replica's values; every replica passes the same shapes.
        """
        self._reduce("statistics", tensors)

    def learn(self, batch: Any) -> dict[str, float]:
        """Updates the networks from ``batch``; returns scalar metrics keyed ``losses/...``."""
        raise NotImplementedError

    def get_weights(self) -> dict[str, torch.Tensor]:
        """Returns the parameters the actor needs (a state dict of detached tensors)."""
        raise NotImplementedError

    def apply_gradients(
        self,
        loss: torch.Tensor,
        max_grad_norm: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """One optimiser step on ``loss``: zero grads, backward, the gradient collective point
        (under a replicated learner: the gradients averaged over its replicas), clip, step.

        Args:
            loss: scalar tensor.
            max_grad_norm: clip the global L2 norm of the optimiser's gradients to this value
                (``None``: no clipping).
            optimizer: the optimiser to step (default ``self.optimizer``). Only its parameters
                are zeroed, all-reduced, clipped and stepped; gradients the loss
                leaves on other parameters are zeroed by their own optimiser's next step.

        Returns:
            the global gradient norm before clipping, a 0-d tensor on the loss's device
            (``nan`` when not clipped). Nothing is copied to the host.

        Raises:
            FloatingPointError: the loss is not finite, for losses on the CPU (the step is not
                taken). On a GPU the check would copy to the host at every step; there a
                non-finite loss shows in the step's metrics, which :meth:`msrl.run.job.Job.train_step`
                checks after the iteration.
        """
        if loss.device.type == "cpu" and not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()}; the optimiser step was not taken")
        optimizer, params = self._optimizer_params(optimizer)
        for group in optimizer.param_groups:  # optimizer.zero_grad(set_to_none=True), without its ~10 us of wrappers
            for p in group["params"]:
                p.grad = None
        loss.backward()
        return self._step(optimizer, params, max_grad_norm, loss.device)

    def apply_gradient_values(
        self,
        gradients: Sequence[torch.Tensor],
        max_grad_norm: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """One optimiser step with gradients computed elsewhere (A3C's pushed gradients: an
        actor's, or the sum or mean of several, arriving as a ``partial`` value): the gradients
        set, the gradient collective point, clip, step -- :meth:`apply_gradients` without the
        backward pass.

        Args:
            gradients: one tensor per parameter of the optimiser, in its ``param_groups``
                order, each of its parameter's shape.
            max_grad_norm: as :meth:`apply_gradients`.
            optimizer: as :meth:`apply_gradients`.

        Returns:
            the global gradient norm before clipping (as :meth:`apply_gradients`).

        Raises:
            ValueError: a gradient count or shape that does not match the parameters.
            FloatingPointError: a gradient on the CPU holds NaN or infinity (the step is not taken).
        """
        optimizer, params = self._optimizer_params(optimizer)
        if len(gradients) != len(params):
            raise ValueError(f"{len(gradients)} gradients for {len(params)} parameters")
        for i, (p, g) in enumerate(zip(params, gradients)):
            if g.shape != p.shape:
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, its parameter {tuple(p.shape)}")
            if g.device.type == "cpu" and not torch.isfinite(g).all():
                raise FloatingPointError(f"gradient {i} (of a parameter of shape {tuple(p.shape)}) is not finite; "
                                         "the optimiser step was not taken")
        for p, g in zip(params, gradients):
            p.grad = g.detach().to(device=p.device, dtype=p.dtype, copy=True)
        return self._step(optimizer, params, max_grad_norm, params[0].device)

    def _optimizer_params(self, optimizer: torch.optim.Optimizer | None) -> tuple[Any, list[torch.Tensor]]:
        if optimizer is None:
            return self.optimizer, self.parameters
        return optimizer, [p for group in optimizer.param_groups for p in group["params"]]

    def _step(self, optimizer: Any, params: list[torch.Tensor], max_grad_norm: float | None,
              device: torch.device) -> torch.Tensor:
        """The gradient collective point, the clip and the optimiser step of one gradient step."""
        reduce = _REDUCERS.get().get((id(self), "gradients"))
        if reduce is not None:  # a replicated learner's gradient all-reduce
            reduce([p.grad for p in params if p.grad is not None])
        if max_grad_norm is not None:
            norm = _clip_grad_norm(params, max_grad_norm)
        else:
            norm = torch.full((), float("nan"), device=device)
        token = _IN_GRADIENT_STEP.set(True)
        try:
            optimizer.step()
        finally:
            _IN_GRADIENT_STEP.reset(token)
        return norm.detach()


class Buffer(Component):
    """Rollout or replay storage: ``insert(...)`` each step, ``gather()``/``sample()`` to read."""

    def insert(self, **step: torch.Tensor) -> None:
        """Stores one step of ``(N, ...)`` tensors."""
        raise NotImplementedError

    def gather(self) -> Any:
        """Returns what was stored as a batch (e.g. a ``TensorDict`` of batch size ``(T, N)``)."""
        raise NotImplementedError


class Trainer:
    """The loop body of an algorithm.

    Subclasses implement :meth:`train_step` (and optionally :meth:`reset`) in the subset of
    Python the tracer reads (see :mod:`msrl.frontend.tracer`): calls of ``self.<role>.<method>(...)``,
    assignments, ``for ... in range(...)`` loops, ``if``/``else`` on control values (step
    counters, hyperparameters), expressions on local values, trainer state as
    ``self.<attr>``, and calls of other trainer methods written in the same subset.

    Args:
        components: role name -> component; roles not held by this fragment are absent.
        hparams: the algorithm's hyperparameters, readable in traced code as ``self.hparams``.
        seed: this replica's seed, readable as ``self.seed``.
        num_envs: envs of the whole job, summed over every env replica, readable as
            ``self.num_envs`` (e.g. ``self.global_step += self.num_envs`` counts the job's env
            steps identically in every fragment).
        total_env_steps: the job's training budget in env steps, readable as
            ``self.total_env_steps`` (for schedules).
    """

    def __init__(
        self,
        components: Mapping[str, Component],
        hparams: Any,
        seed: int,
        num_envs: int = 1,
        total_env_steps: int = 0,
    ) -> None:
        self._components = dict(components)
        self.hparams = hparams
        self.seed = seed
        self.num_envs = num_envs
        self.total_env_steps = total_env_steps

    @property
    def env(self) -> Environment:
        """This trainer's ``env`` component.

        Raises:
            AttributeError: the fragment running this trainer does not hold the ``env`` role.
        """
        return self._component("env")

    @property
    def actor(self) -> Actor:
        """This trainer's ``actor`` component.

        Raises:
            AttributeError: the fragment running this trainer does not hold the ``actor`` role.
        """
        return self._component("actor")

    @property
    def learner(self) -> Learner:
        """This trainer's ``learner`` component.

        Raises:
            AttributeError: the fragment running this trainer does not hold the ``learner`` role.
        """
        return self._component("learner")

    @property
    def buffer(self) -> Buffer:
        """This trainer's ``buffer`` component.

        Raises:
            AttributeError: the fragment running this trainer does not hold the ``buffer`` role.
        """
        return self._component("buffer")

    @property
    def components(self) -> dict[str, Component]:
        """Role -> component held by this trainer."""
        return dict(self._components)

    def _component(self, role: str) -> Any:
        try:
            return self._components[role]
        except KeyError:
            raise AttributeError(
                f"component '{role}' is not held by this trainer (it holds "
                f"{sorted(self._components)}); it lives in another fragment"
            ) from None

    def reset(self) -> None:
        """Initialises trainer state (e.g. ``self.obs = self.env.reset(seed=self.seed)``)."""

    def train_step(self) -> Any:
        """One iteration of the algorithm; returns its metrics (a dict of scalars)."""
        raise NotImplementedError


ComponentFactory = Callable[[BuildContext], Component]

