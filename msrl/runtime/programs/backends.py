"""Fragment backends: the registry of ``fragments/<name>.py`` modules (DESIGN.md §4).

A backend module defines ``BACKEND``, a :class:`Backend`: its lowering rules for code
generation plus its hooks -- how a fragment of it builds its env (:meth:`Backend.build_env`),
what it checks in a config (:meth:`Backend.check`) and how it wraps the fragment's generated
program (:meth:`Backend.wrap_program`). No module outside ``fragments/`` compares backend
names: what differs between backends is what their hooks do."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from msrl import registry
from msrl.errors import InputError
from msrl.runtime.programs.codegen import Lowering, Program

__all__ = ["Backend", "UnknownBackendError", "load_backend", "available_backends"]


class UnknownBackendError(InputError, ValueError):
    """A backend name with no module in ``fragments/``."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A fragment backend: its lowering rules and hooks. A backend whose hooks differ from these
    defaults subclasses it (``fragments/cuda_kernel.py``, ``fragments/cpu_process_group.py``).

    Attributes:
        name: the YAML value of a fragment's ``backend``.
        lowering: rule table used by :func:`msrl.runtime.programs.codegen.generate`.
        devices: device types it runs on (``("cpu", "cuda")``).
    """

    name: str
    lowering: Lowering
    devices: tuple[str, ...]

    def env_engine(self, requested: str) -> str:
        """The env engine (:data:`msrl.envs.factory.ENGINES`) a fragment of this backend steps its
        gymnasium envs on, given ``env.engine`` (default: that one)."""
        return requested

    def build_env(self, env_id: str, num_envs: int, device: torch.device | str, engine: str,
                  env_kwargs: Any = None, wrappers: Sequence[str] = (), num_workers: int | None = None) -> Any:
        """The env role of a replica of a fragment of this backend: ``num_envs`` envs ``env_id``
        on ``device`` (default: a native env's torch reference, a gymnasium env on
        :meth:`env_engine` of ``engine``; see :func:`msrl.envs.factory.make_env`).

        Raises:
            UnknownEnvError, ValueError: as :func:`msrl.envs.factory.make_env`.
        """
        from msrl.envs.factory import make_env

        return make_env(env_id, num_envs, device, self.env_engine(engine), env_kwargs, wrappers, num_workers)

    def check(self, fragment: Any, policy: Any, env_id: str, env_engine: str) -> None:
        """Checks that ``fragment`` (a :class:`~msrl.policy.FragmentSpec` of ``policy``) can run on
        this backend with env ``env_id`` on ``env_engine`` (default: nothing to check).

        Raises:
            ConfigError: naming the config key and what is valid.
        """

    def wrap_program(self, program: Program, fragment: Any = None) -> Program:
        """The fragment's generated program as this backend runs it.

        Default: as generated, or -- when ``fragment`` (its :class:`~msrl.policy.FragmentSpec`)
        resolves ``capture`` to ``graph`` (a CUDA device's default) -- wrapped in a
        :class:`~msrl.runtime.programs.capture.CapturedProgram`: warmed up, probed, captured once (a
        CUDA graph on a GPU, a host tape on the CPU) and replayed. A program that exchanges
        values with other fragments (a boundary or an all-reduce: host work, and the other
        side's timing) runs eagerly: as generated under the default, wrapped with that as its
        stated reason when ``capture: graph`` was asked for. Under ``compile: inductor`` the
        program (inside the capture, when captured) first compiles its components' compile
        targets (:class:`~msrl.runtime.programs.compiled.CompiledProgram`). A backend that compiles the
        program otherwise replaces ``program.fn`` here.
        """
        if fragment is None:
            return program
        from msrl.graph import NodeKind
        from msrl.runtime.programs.capture import CapturedProgram, resolve_capture
        from msrl.runtime.programs.compiled import CompiledProgram, resolve_compile

        if resolve_compile(fragment.compile) == "inductor":  # inside the capture: compiled in its warm-up
            program = dataclasses.replace(program, fn=CompiledProgram(program.fn, fragment.roles))
        if resolve_capture(fragment.capture, fragment.device) != "graph":
            return program
        reason = None
        first = program.first_communication()  # from the graph's node kinds
        if first is not None:
            node, op = first
            reason = (f"the program exchanges values with other replicas ({op} at {node.where()}); only a fragment "
                      "without boundaries or collectives is captured")
        if reason is not None and fragment.capture is None:
            return program  # the default asks nothing of a fragment with boundaries: eager, silently
        state_attrs = sorted({n.target for n in program.line_nodes.values() if n.kind is NodeKind.STATE_OUT})
        fn = CapturedProgram(program.fn, program.method, state_attrs, fragment.device, reason)
        return dataclasses.replace(program, fn=fn)


def available_backends() -> list[str]:
    """Names of the backends in ``fragments/``."""
    return registry.names("msrl.fragments")


def load_backend(name: str) -> Backend:
    """The ``BACKEND`` of ``fragments/<name>.py``.

    Raises:
        UnknownBackendError: no such backend; the message lists those that exist.
    """
    return registry.load("msrl.fragments", name, "BACKEND", UnknownBackendError, "fragment backend")


def env_frame_padding(spec: Any) -> str | None:
    """How the env of job ``spec`` (a :class:`~msrl.run.job.JobSpec`) pads an episode's first frame
    stack (:func:`msrl.runtime.frame_stacks.frame_padding`), on the engine the backend of the fragment
    holding the env actually steps it on (``cpu_process_group`` steps every gymnasium env on the
    process engine, whatever ``env.engine`` says)."""
    from msrl.runtime.frame_stacks import frame_padding

    fragment = spec.policy.fragment(spec.policy.fragment_of_role("env"))
    return frame_padding(load_backend(fragment.backend).env_engine(spec.env_engine), tuple(spec.env_wrappers))
