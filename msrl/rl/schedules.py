"""Learning-rate schedules on the device: a rate held in a 0-d tensor that an optimiser reads
and a schedule updates in place, so a captured iteration (a CUDA graph) replays the schedule."""

from __future__ import annotations

import torch

__all__ = ["learning_rate_tensor", "anneal_learning_rate", "load_learning_rate"]


def learning_rate_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A learning rate as a 0-d tensor on ``device``, for an optimiser built with ``lr=`` it
    and a schedule that updates it in place (:func:`anneal_learning_rate`): a captured
    iteration (a CUDA graph, ``msrl.runtime.programs.capture``) replays the update. float64 on the CPU
    (fused Adam reads it as a double: the same steps as with the Python float), float32 on a
    GPU (where the fused Adam kernel reads it on the device)."""
    return torch.tensor(value, device=device, dtype=torch.float32 if device.type == "cuda" else torch.float64)


@torch.no_grad()
def anneal_learning_rate(lr: torch.Tensor, iteration: torch.Tensor, base: float, num_iterations: int,
                         anneal: bool) -> torch.Tensor:
    """CleanRL's linear annealing on the device, without a host read: ``frac = 1 - iteration /
    num_iterations``, ``lr <- frac * base`` (in place, when ``anneal``), ``iteration += 1``.

    Args:
        lr: the optimiser's 0-d learning-rate tensor (:func:`learning_rate_tensor`).
        iteration: a 0-d int64 tensor, updates taken so far.

    Returns:
        ``frac``, a 0-d float64 tensor: computed in float64, it equals the same schedule in
        Python floats, bitwise.
    """
    frac = 1.0 - iteration.to(torch.float64) / num_iterations
    if anneal:
        lr.copy_(frac * base)
    iteration += 1
    return frac


def load_learning_rate(optimizer: torch.optim.Optimizer, lr: torch.Tensor) -> None:
    """After ``optimizer.load_state_dict``: the saved learning rate (a float in checkpoints
    written before rates were tensors) copied into ``lr``, which the optimiser's groups hold
    again (the schedule and a captured iteration update that tensor in place)."""
    for group in optimizer.param_groups:
        lr.copy_(torch.as_tensor(group["lr"], dtype=lr.dtype))
        group["lr"] = lr
