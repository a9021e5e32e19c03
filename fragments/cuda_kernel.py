"""``cuda_kernel``: a fragment whose native env steps through its CUDA C kernels (DESIGN.md §4).

Programs are lowered as by ``torch_graph``; what differs is the env: a native env built in a
``cuda_kernel`` fragment runs its ``reset``/``step`` through its kernels (the GPU build on a CUDA
device, the host build on the CPU; :mod:`msrl.envs.native.kernels`) instead of its torch
reference. A gymnasium env is refused (a config error; a ``ValueError`` when built directly). The
kernel machinery itself is :mod:`msrl.envs.native.kernels`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from msrl.errors import ConfigError
from msrl.fragments.torch_graph import LOWERING as TORCH_GRAPH
from msrl.runtime.programs.backends import Backend
from msrl.runtime.programs.codegen import Lowering

__all__ = ["BACKEND", "CudaKernelBackend"]


class CudaKernelBackend(Backend):
    """``torch_graph``'s lowering; the fragment's env is a native env stepped by its CUDA C
    kernels (GPU build on CUDA, host build on the CPU: :func:`msrl.envs.native.kernels.load_kernels`)."""

    def build_env(self, env_id: str, num_envs: int, device: torch.device | str, engine: str,
                  env_kwargs: Any = None, wrappers: Sequence[str] = (), num_workers: int | None = None) -> Any:
        """The native env ``env_id`` on its kernels.

        Raises:
            ValueError: a gymnasium env (this backend steps native envs only), or wrappers.
        """
        from msrl.envs.factory import NATIVE_ENVS, is_native, make_env

        if not is_native(env_id):
            raise ValueError(
                f"env {env_id!r} is a gymnasium env; the cuda_kernel backend runs native envs only ({', '.join(NATIVE_ENVS)})"
            )
        return make_env(env_id, num_envs, device, engine, env_kwargs, wrappers, num_workers, native_impl="kernel")

    def check(self, fragment: Any, policy: Any, env_id: str, env_engine: str) -> None:
        """The fragment's env, if it holds one, must be native.

        Raises:
            ConfigError: a gymnasium ``env.id``.
        """
        from msrl.envs.factory import is_native

        if "env" in fragment.roles and not is_native(env_id):
            raise ConfigError(
                f"env.id={env_id!r} is a gymnasium env, but fragment {fragment.name} runs the env on the cuda_kernel "
                "backend, which steps native envs only (e.g. msrl/CartPole-v1)"
            )


BACKEND = CudaKernelBackend(name="cuda_kernel", lowering=Lowering(backend="cuda_kernel", rules=TORCH_GRAPH.rules),
                            devices=("cpu", "cuda"))
