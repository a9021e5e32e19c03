"""How a component method's result relates to the env axis: the value kinds, declared with
:func:`returns` and read with :func:`declared_kinds` (the partitioner chooses comm ops by them)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["VALUE_KINDS", "PARTIAL_REDUCTIONS", "returns", "declared_kinds"]

#: How a value relates to the env axis (see :func:`returns`): ``sharded`` (one row per env,
#: split with the envs), ``batch`` (rows of a fixed-size batch, concatenated when gathered: a
#: replay sample), ``replicated`` (the same whole value everywhere: weights, metrics) or
#: ``partial`` (each replica holds a part of a sum: gradients of its own rollout; summed, or
#: averaged, over the replicas when it crosses). The one definition; the partitioner chooses
#: comm ops by it.
VALUE_KINDS: tuple[str, ...] = ("sharded", "batch", "replicated", "partial")
#: how a ``partial`` value's replicas combine (``@returns("partial", reduce=...)``)
PARTIAL_REDUCTIONS: tuple[str, ...] = ("sum", "mean")


def returns(*kinds: str, axis: int = 0, reduce: str = "sum") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declares how a component method's result relates to the env axis.

    The partitioner chooses a boundary's comm op from it (DESIGN.md §3): ``"sharded"`` values
    have one row per env along ``axis`` and are split and concatenated with the envs (a rollout
    ``(T, N, ...)`` with ``axis=1``); a ``"batch"`` is a fixed-size batch whose rows are
    concatenated along ``axis`` when gathered from several replicas (a replay sample of 256
    transitions: two actor replicas give the learner 512; every tensor of a batch has its rows
    along ``axis``, the same number in each); ``"replicated"`` values are whole on every replica
    (weights, metrics) and are broadcast, never gathered; ``"partial"`` values are one replica's
    part of a sum (the gradients of its own rollout, A3C's gradient push; DTensor's ``Partial``
    placement): when one crosses to other replicas it is reduced -- summed leaf by leaf in replica
    order, or averaged with ``reduce="mean"`` -- and every dst replica gets the whole result.
    Undeclared results are classified by the probe (:mod:`msrl.frontend.probe`) from their shapes, which
    cannot tell a batch, a partial value or a replicated one apart; the probe also checks every
    declaration against what it observes.

    Example::

        class ReplayBuffer(Buffer):
            @returns("batch")
            def sample(self) -> TensorDict: ...

    Args:
        kinds: one kind for the whole result (every element of a tuple result), or one per
            element of a tuple result, each in :data:`VALUE_KINDS`.
        axis: the env (or batch) axis of sharded values and batches.
        reduce: how the replicas of a ``partial`` value combine, one of
            :data:`PARTIAL_REDUCTIONS` (``"sum"``; ``"mean"``: the sum divided by the replica count).

    Raises:
        ValueError: no kind, a kind outside :data:`VALUE_KINDS`, or ``reduce`` outside
            :data:`PARTIAL_REDUCTIONS`.
    """
    if not kinds:
        raise ValueError(f"returns() takes at least one kind from {VALUE_KINDS}")
    for k in kinds:
        if k not in VALUE_KINDS:
            raise ValueError(f"unknown value kind {k!r}; kinds are {VALUE_KINDS}")
    if reduce not in PARTIAL_REDUCTIONS:
        raise ValueError(f"returns(reduce={reduce!r}): a partial value's replicas combine by one of {PARTIAL_REDUCTIONS}")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__msrl_returns__ = (tuple(kinds), int(axis), reduce)  # type: ignore[attr-defined]
        return fn

    return mark


def declared_kinds(component: Any, method: str) -> tuple[tuple[str, ...], int, str] | None:
    """The ``(kinds, axis, reduce)`` declared with :func:`returns` on ``component``'s ``method``
    (looked up on its class, so subclasses inherit it), or ``None``."""
    fn = getattr(type(component), method, None)
    return getattr(fn, "__msrl_returns__", None)
