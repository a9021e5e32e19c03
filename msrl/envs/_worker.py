"""The env engine's worker process: steps its share of the batch's envs on shared memory.

Light on purpose (numpy, gymnasium and the simulators, never torch): one of these runs per
worker. Commands arrive on a pipe as a byte string (an op code, then its arguments); actions,
observations, rewards and flags live in shared arrays that the parent allocated, so a step moves
no array through the pipe. See :class:`msrl.envs.engine.ProcessEnv` for the protocol's user side.
"""

from __future__ import annotations

import pickle
import struct
import traceback
from typing import Any, Sequence

# op codes, parent -> worker
RESET, STEP_ALL, STEP_IDS, GET_STATE, SET_STATE, CLOSE = range(6)
# reply tags, worker -> parent
READY, DONE, ENV_DONE, STATE, ERROR = b"R", b"D", b"I", b"S", b"E"

_SEED = struct.Struct("<?q")  # has seed, seed
ENV_ID = struct.Struct("<i")


def arrays_from(buffers: dict[str, tuple[Any, str, tuple[int, ...]]]) -> dict[str, Any]:
    """numpy views of the shared buffers: name -> (RawArray, dtype str, shape)."""
    import numpy as np

    return {name: np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape) for name, (raw, dt, shape) in buffers.items()}


def encode_seed(seed: int | None) -> bytes:
    """The RESET command's argument."""
    return _SEED.pack(seed is not None, 0 if seed is None else int(seed))


def main(env_indices: Sequence[int], env_id: str, env_kwargs: dict[str, Any], wrappers: Sequence[str],
         discrete: bool, buffers: dict[str, tuple[Any, str, tuple[int, ...]]], conn: Any) -> None:
    """Worker entry point: builds envs ``env_indices`` (global indices in the batch), replies
    READY, then serves commands until CLOSE or the pipe closes (the parent is gone)."""
    import numpy as np

    from msrl.envs.single import make_single_env
    from msrl.envs.state import dump_env, load_env

    try:
        envs = [make_single_env(env_id, env_kwargs, wrappers) for _ in env_indices]
        a = arrays_from(buffers)
    except Exception:  # noqa: BLE001 - reported to the parent with its traceback
        conn.send_bytes(ERROR + traceback.format_exc().encode())
        return
    obs, final_obs, act, rew = a["obs"], a["final_obs"], a["action"], a["reward"]
    term, trunc = a["terminated"], a["truncated"]
    local = {int(i): k for k, i in enumerate(env_indices)}

    def step_one(i: int) -> None:
        env = envs[local[i]]
        action = int(act[i]) if discrete else np.array(act[i], copy=True)
        o, r, te, tr, _ = env.step(action)
        if te or tr:
            final_obs[i] = o
            o, _ = env.reset()
        obs[i] = o
        rew[i] = r
        term[i] = te
        trunc[i] = tr

    conn.send_bytes(READY)
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        op = msg[0]
        try:
            if op == STEP_ALL:
                for i in env_indices:
                    step_one(i)
                conn.send_bytes(DONE)
            elif op == STEP_IDS:
                for i in np.frombuffer(msg, dtype=np.int32, offset=1):
                    step_one(int(i))
                    conn.send_bytes(ENV_DONE + ENV_ID.pack(int(i)))
            elif op == RESET:
                has_seed, seed = _SEED.unpack_from(msg, 1)
                for i in env_indices:
                    obs[i], _ = envs[local[i]].reset(seed=seed + i if has_seed else None)
                conn.send_bytes(DONE)
            elif op == GET_STATE:
                shared: dict[str, bytes] = {}
                blobs = [dump_env(e, shared) for e in envs]
                conn.send_bytes(STATE + pickle.dumps((blobs, shared), protocol=pickle.HIGHEST_PROTOCOL))
            elif op == SET_STATE:
                blobs, shared = pickle.loads(msg[1:])
                restored = [load_env(b, shared) for b in blobs]
                for e in envs:
                    e.close()
                envs[:] = restored
                conn.send_bytes(DONE)
            elif op == CLOSE:
                for e in envs:
                    e.close()
                conn.send_bytes(DONE)
                return
            else:
                conn.send_bytes(ERROR + f"unknown op code {op}".encode())
        except Exception:  # noqa: BLE001 - reported to the parent with its traceback
            conn.send_bytes(ERROR + traceback.format_exc().encode())
