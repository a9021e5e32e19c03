"""Native batched environments by id: CartPole, Pendulum and Tag (torch reference + CUDA C
kernels), HalfCheetah and Hopper (MuJoCo physics batched by mjbatch, task logic in torch)."""

from msrl.envs.native.base import IMPLS, NativeEnv
from msrl.envs.native.cartpole import CartPole
from msrl.envs.native.mujoco import HalfCheetah, Hopper
from msrl.envs.native.pendulum import Pendulum
from msrl.envs.native.tag import Tag

__all__ = ["NATIVE_ENVS", "NativeEnv", "CartPole", "Pendulum", "Tag", "HalfCheetah", "Hopper", "IMPLS", "is_native",
           "make_native"]

#: native env id -> class
NATIVE_ENVS = {c.ENV_ID: c for c in (CartPole, Pendulum, Tag, HalfCheetah, Hopper)}


def is_native(env_id: str) -> bool:
    """Whether ``env_id`` names a native env (the ``msrl/`` namespace)."""
    return env_id in NATIVE_ENVS


def make_native(env_id: str, num_envs: int, device="cpu", impl: str = "kernel", **kwargs) -> NativeEnv:
    """Builds native env ``env_id``.

    Raises:
        KeyError: unknown id, listing the native ids.
    """
    if env_id not in NATIVE_ENVS:
        raise KeyError(f"unknown native env {env_id!r}; native envs: {', '.join(NATIVE_ENVS)}")
    return NATIVE_ENVS[env_id](num_envs, device=device, impl=impl, **kwargs)
