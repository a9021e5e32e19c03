"""Native batched environments by id: CartPole, Pendulum and Tag (torch reference + CUDA C
kernels), HalfCheetah and Hopper (MuJoCo physics batched by mjbatch on the CPU, or by MJWarp's
kernels on the env's device with ``physics="warp"``; task logic in torch)."""

from msrl.envs.native.base import IMPLS, NativeEnv
from msrl.envs.native.cartpole import CartPole
from msrl.envs.native.mujoco import HalfCheetah, Hopper
from msrl.envs.native.mujoco_warp import WarpHalfCheetah, WarpHopper
from msrl.envs.native.pendulum import Pendulum
from msrl.envs.native.tag import Tag

__all__ = ["NATIVE_ENVS", "MUJOCO_PHYSICS", "NativeEnv", "CartPole", "Pendulum", "Tag", "HalfCheetah", "Hopper",
           "WarpHalfCheetah", "WarpHopper", "IMPLS", "is_native", "make_native", "native_class"]

#: native env id -> class
NATIVE_ENVS = {c.ENV_ID: c for c in (CartPole, Pendulum, Tag, HalfCheetah, Hopper)}

#: MuJoCo task id -> ``env.kwargs.physics`` value -> class: ``mjbatch`` (MuJoCo's C on the CPU,
#: float64, bitwise gymnasium's; the default) or ``warp`` (MJWarp's kernels on the env's device,
#: float32)
MUJOCO_PHYSICS = {
    HalfCheetah.ENV_ID: {"mjbatch": HalfCheetah, "warp": WarpHalfCheetah},
    Hopper.ENV_ID: {"mjbatch": Hopper, "warp": WarpHopper},
}


def is_native(env_id: str) -> bool:
    """Whether ``env_id`` names a native env (the ``msrl/`` namespace)."""
    return env_id in NATIVE_ENVS


def native_class(env_id: str, physics: str | None = None) -> type:
    """The class of native env ``env_id`` with physics engine ``physics`` (MuJoCo tasks only;
    None: the default).

    Raises:
        KeyError: unknown id, listing the native ids.
        ValueError: ``physics`` given for an env without a choice, or an unknown engine.
    """
    if env_id not in NATIVE_ENVS:
        raise KeyError(f"unknown native env {env_id!r}; native envs: {', '.join(NATIVE_ENVS)}")
    if physics is None:
        return NATIVE_ENVS[env_id]
    if env_id not in MUJOCO_PHYSICS:
        raise ValueError(f"env.kwargs.physics chooses a MuJoCo task's physics engine ({', '.join(MUJOCO_PHYSICS)}); "
                         f"{env_id} has one implementation of its rules")
    engines = MUJOCO_PHYSICS[env_id]
    if physics not in engines:
        raise ValueError(f"unknown env.kwargs.physics {physics!r} for {env_id}; valid: {', '.join(engines)}")
    return engines[physics]


def make_native(env_id: str, num_envs: int, device="cpu", impl: str = "kernel", **kwargs) -> NativeEnv:
    """Builds native env ``env_id``; ``kwargs`` go to its class (``physics`` picks a MuJoCo
    task's engine: :data:`MUJOCO_PHYSICS`).

    Raises:
        KeyError: unknown id, listing the native ids.
        ValueError: as :func:`native_class`, or the class's own.
    """
    cls = native_class(env_id, kwargs.pop("physics", None))
    return cls(num_envs, device=device, impl=impl, **kwargs)
