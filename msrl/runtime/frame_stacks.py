"""Frame-stacked rollouts in their compact form: the first stack, then only the newest frame of
each step.

An Atari rollout holds ``obs`` and ``next_obs`` of shape ``(T, N, S, H, W)`` uint8: each step's
stack of the last ``S`` frames, so every frame is stored ``2 S`` times. Within an episode a
stack is the previous one shifted by one frame, and

* ``next_obs[t]`` is ``obs[t]`` shifted, the newest frame appended -- always, also at an
  episode's end (its final observation is the episode's last ``S`` frames);
* ``obs[t + 1]`` is ``next_obs[t]``, except where the episode ended at ``t``
  (``terminated | truncated``): there it is the next episode's first stack, which the env made
  from that episode's first frame by its *padding*: ``"zeros"`` (``S - 1`` zero frames, then
  the frame: ale-py's vector env) or ``"reset"`` (the frame ``S`` times: gymnasium's
  ``FrameStackObservation``, EnvPool's Atari tasks).

So ``(first (N, S, H, W), newest (T - 1, N, H, W), next_newest (T, N, H, W))`` and the done flags
determine the rollout: ``(2 T + S - 1) / (2 T S)`` of its frame bytes (1/4 for ``S = 4``, long
``T``). :func:`compact_frames` makes that form and checks, by rebuilding, that it gives back the
rollout bit for bit (an env whose stacks follow other rules is sent whole: ``None``);
:func:`rebuild_frames` rebuilds it on the receiver's device.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

__all__ = ["PADDINGS", "compact_frames", "rebuild_frames", "is_compact", "compact_value", "rebuild_value",
           "frame_padding"]

#: how an env fills an episode's first stack from its first frame
PADDINGS = ("zeros", "reset")

#: the key marking a compact rollout (a dict the codec carries as it is)
_MARK = "msrl_compact_frames"


def _rebuild(first: torch.Tensor, newest: torch.Tensor, next_newest: torch.Tensor | None, done: torch.Tensor,
             padding: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``obs`` ``(T, N, S, H, W)`` (and ``next_obs``) from the compact form in one pass: each
    env's frames on a timeline ``F`` of ``S - 1 + T`` frames (the first stack, then each later
    step's newest), ``obs[t, :, s] = F[t + s]`` (the sliding windows of ``F``, a view) where that
    frame is of the episode at ``t``; before the episode's first frame, the padding (zeros, or
    that frame)."""
    T, N, size = newest.shape[0] + 1, first.shape[0], first.shape[1]
    device = first.device
    timeline = torch.cat([first.transpose(0, 1), newest], dim=0)  # (S - 1 + T, N, H, W)
    steps = torch.arange(T, device=device)
    # the timeline index of each (t, n)'s episode's first frame: S - 1 + t' for the last t' <= t
    # that starts an episode (done at t' - 1), else 0 (the episode began at or before the rollout)
    starts = torch.where(torch.cat([torch.zeros(1, N, dtype=torch.bool, device=device), done[:-1]]),
                         (steps + size - 1).unsqueeze(1), torch.zeros((), dtype=torch.long, device=device))
    start = torch.cummax(starts, dim=0).values  # (T, N)
    index = steps.view(T, 1, 1) + torch.arange(size, device=device).view(1, 1, size)  # timeline index of obs[t, :, s]
    valid = (index >= start.unsqueeze(-1)).view(T, N, size, 1, 1)
    windows = timeline.unfold(0, size, 1).permute(0, 1, 4, 2, 3)  # (T, N, S, H, W): a view, each stack's frames
    obs = windows.contiguous()
    obs.mul_(valid)  # the frames before an episode's first: zeros (multiplies: ~15x torch.where's speed on uint8)
    if padding == "reset":  # or the episode's first frame, repeated
        first_frames = timeline[start, torch.arange(N, device=device).view(1, N)].unsqueeze(2)  # (T, N, 1, H, W)
        obs.add_(first_frames * ~valid)
    if next_newest is None:
        return obs, None
    nxt = torch.empty_like(obs)  # obs shifted by one frame, the newest appended (two block copies)
    nxt[:, :, :-1] = obs[:, :, 1:]
    nxt[:, :, -1] = next_newest
    return obs, nxt


def _fits(rollout: Any, key: str, next_key: str) -> bool:
    """Whether ``rollout`` has the shape of a frame-stacked rollout (its stacks unchecked)."""
    if not isinstance(rollout, TensorDict) or rollout.batch_dims != 2 or key not in rollout.keys():
        return False
    obs = rollout.get(key)
    nxt = rollout.get(next_key) if next_key in rollout.keys() else None
    return (isinstance(obs, torch.Tensor) and obs.dtype == torch.uint8 and obs.dim() == 5 and obs.shape[0] >= 2
            and obs.shape[2] >= 2 and (nxt is None or isinstance(nxt, torch.Tensor) and nxt.shape == obs.shape
                                       and nxt.dtype == obs.dtype)
            and "terminated" in rollout.keys() and "truncated" in rollout.keys())


def compact_frames(rollout: Any, padding: str, keys: tuple[str, str] = ("obs", "next_obs")) -> dict[str, Any] | None:
    """The compact form of ``rollout`` (see the module docstring), or ``None`` when it has none.

    Args:
        rollout: a TensorDict of batch size ``(T, N)`` holding ``keys[0]`` (and optionally
            ``keys[1]``) as uint8 ``(T, N, S, H, W)`` and ``terminated``/``truncated`` ``(T, N)``
            bool; anything else (another value, other dtypes or shapes) has no compact form.
        padding: the env's first-stack rule, one of :data:`PADDINGS`.
        keys: the observation and next-observation keys.

    Returns:
        ``{"msrl_compact_frames": [padding, obs key, next key or "", the rollout's keys in
        order...], "first": (N, S, H, W),
        "newest": (T - 1, N, H, W), "next_newest": (T, N, H, W) (absent without next
        observations), "rest": the rollout without them}``, or ``None`` when ``rollout`` has no
        compact form or its stacks do not follow ``padding`` (checked by rebuilding: what is
        sent is always what was given).

    Raises:
        ValueError: ``padding`` is not one of :data:`PADDINGS`.
    """
    if padding not in PADDINGS:
        raise ValueError(f"frame padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
    key, next_key = keys
    if not _fits(rollout, key, next_key):
        return None
    obs = rollout.get(key)
    nxt = rollout.get(next_key) if next_key in rollout.keys() else None
    done = rollout.get("terminated") | rollout.get("truncated")
    first, newest = obs[0], obs[1:, :, -1]
    next_newest = nxt[:, :, -1] if nxt is not None else None
    obs_back, next_back = _rebuild(first, newest, next_newest, done, padding)
    if not torch.equal(obs_back, obs) or (nxt is not None and not torch.equal(next_back, nxt)):
        return None
    out = {_MARK: [padding, key, next_key if nxt is not None else "", *rollout.keys()], "first": first.clone(),
           "newest": newest.clone(), "rest": rollout.exclude(key, next_key)}
    if next_newest is not None:
        out["next_newest"] = next_newest.clone()
    return out


def is_compact(value: Any) -> bool:
    """Whether ``value`` is a :func:`compact_frames` form."""
    return isinstance(value, dict) and _MARK in value


def rebuild_frames(compact: dict[str, Any], device: torch.device | str | None = None) -> TensorDict:
    """The rollout a :func:`compact_frames` form stands for, bit for bit, on ``device`` (default:
    where the form is): the compact tensors move there first, so only they cross.

    Raises:
        ValueError: ``compact`` is not such a form.
    """
    if not is_compact(compact):
        raise ValueError("not a compact frame rollout (compact_frames makes one)")
    padding, key, next_key, *order = compact[_MARK]
    rest = compact["rest"] if device is None else compact["rest"].to(device)
    first, newest = (compact[k] if device is None else compact[k].to(device) for k in ("first", "newest"))
    nn = compact.get("next_newest")
    nn = nn if nn is None or device is None else nn.to(device)
    done = rest.get("terminated") | rest.get("truncated")
    obs, nxt = _rebuild(first, newest, nn, done, padding)
    rebuilt = {key: obs, next_key: nxt}
    return TensorDict({k: rebuilt[k] if k in rebuilt else rest.get(k) for k in order}, batch_size=rest.batch_size,
                      device=rest.device)


def compact_value(value: Any, padding: str) -> tuple[Any, bool]:
    """What a boundary sends for ``value``: a frame-stacked rollout (or a tuple or list holding
    some, as the recurrent algorithms' ``(rollout, initial state)``) in compact form, anything
    else as it is. Returns ``(value to send, broken)``: ``broken`` when a rollout had the shape
    of frame stacks but not stacks following ``padding`` (sent whole; the caller stops trying).
    """
    if isinstance(value, (tuple, list)):
        parts = [compact_value(v, padding) for v in value]
        return type(value)(v for v, _ in parts), any(b for _, b in parts)
    if not _fits(value, "obs", "next_obs"):
        return value, False
    compact = compact_frames(value, padding)
    return (value, True) if compact is None else (compact, False)


def rebuild_value(value: Any, device: torch.device | str | None = None) -> Any:
    """``value`` with every compact rollout in it (at its top, or in a top-level tuple or list)
    rebuilt (:func:`rebuild_frames`, on ``device``); anything else as it is."""
    if isinstance(value, (tuple, list)):
        return type(value)(rebuild_value(v, device) for v in value)
    return rebuild_frames(value, device) if is_compact(value) else value


def frame_padding(env_engine: str, env_wrappers: tuple[str, ...] | list[str]) -> str | None:
    """How a job's env fills an episode's first frame stack, where msrl knows it: ``"zeros"``
    for ale-py's vector env (``env.engine: ale_vector``), ``"reset"`` for gymnasium's
    ``FrameStackObservation`` under the ``atari`` wrapper and for EnvPool's Atari tasks; ``None``
    otherwise (values cross whole). A wrong answer costs one failed check, never a wrong value
    (:func:`compact_frames` checks every rollout)."""
    from msrl.envs.engines import engine

    return engine(env_engine).frame_padding(env_wrappers)
