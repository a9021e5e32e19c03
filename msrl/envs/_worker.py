"""The env engine's worker process: steps its share of the batch's envs on shared memory.

Run as ``python -m msrl.envs._worker SOCKET_FD MEMORY_FD`` by
:class:`msrl.envs.engine.ProcessEnv`, never imported by a user's ``__main__`` (a fresh
interpreter, not ``multiprocessing``'s spawn, so a script without an ``if __name__ ==
"__main__"`` guard is not re-run in every worker). Light on purpose: numpy, gymnasium and the
simulators, never torch. The first message on the socket is the worker's set-up (pickled once);
after it, commands arrive as byte strings (an op code, then its arguments) and actions,
observations, rewards and flags live in the shared memory the parent allocated, so a step moves
no array through the socket.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import struct
import sys
import traceback
from typing import Any, Sequence

# op codes, parent -> worker
RESET, STEP_ALL, STEP_IDS, GET_STATE, SET_STATE, CLOSE = range(6)
# reply tags, worker -> parent
READY, DONE, ENV_DONE, STATE, ERROR = b"R", b"D", b"I", b"S", b"E"

_SEED = struct.Struct("<?q")  # has seed, seed
ENV_ID = struct.Struct("<i")


def arrays_from(memory: Any, layout: dict[str, tuple[str, tuple[int, ...], int]]) -> dict[str, Any]:
    """numpy views of the shared memory: name -> (dtype str, shape, byte offset)."""
    import numpy as np

    out = {}
    for name, (dt, shape, offset) in layout.items():
        dtype = np.dtype(dt)
        count = 1
        for d in shape:
            count *= d
        out[name] = np.frombuffer(memory, dtype=dtype, count=count, offset=offset).reshape(shape)
    return out


def step_into(env: Any, i: int, a: dict[str, Any], discrete: bool) -> None:
    """Steps ``env`` (env ``i`` of the batch) with action row ``a["action"][i]`` and writes row
    ``i`` of ``a``'s ``obs``, ``reward``, ``terminated``, ``truncated`` and, when the episode
    ended, ``final_obs`` (its last observation; ``obs`` is then the next episode's first:
    gymnasium's same-step autoreset)."""
    import numpy as np

    act = a["action"][i]
    o, r, te, tr, _ = env.step(int(act) if discrete else np.array(act, copy=True))
    if te or tr:
        a["final_obs"][i] = o
        o, _ = env.reset()
    a["obs"][i] = o
    a["reward"][i] = r
    a["terminated"][i] = te
    a["truncated"][i] = tr


def encode_seed(seed: int | None) -> bytes:
    """The RESET command's argument."""
    return _SEED.pack(seed is not None, 0 if seed is None else int(seed))


def serve(env_indices: Sequence[int], env_id: str, env_kwargs: dict[str, Any], wrappers: Sequence[str],
          discrete: bool, memory: Any, layout: dict[str, tuple[str, tuple[int, ...], int]], conn: Any) -> None:
    """Builds envs ``env_indices`` (global indices in the batch), replies READY, then serves
    commands until CLOSE or the socket closes (the parent is gone)."""
    import numpy as np

    from msrl.envs.single_env import make_single_env, share_mujoco_models
    from msrl.envs.state import dump_env, load_env

    try:
        envs = [make_single_env(env_id, env_kwargs, wrappers) for _ in env_indices]
        share_mujoco_models(envs)
        a = arrays_from(memory, layout)
    except Exception:  # noqa: BLE001 - reported to the parent with its traceback
        conn.send_bytes(ERROR + traceback.format_exc().encode())
        return
    obs = a["obs"]
    local = {int(i): k for k, i in enumerate(env_indices)}

    def step_one(i: int) -> None:
        step_into(envs[local[i]], i, a, discrete)

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
                share_mujoco_models(restored)
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


def main(argv: Sequence[str]) -> None:
    """``python -m msrl.envs._worker SOCKET_FD MEMORY_FD``: reads the set-up message (the
    parent's ``sys.path`` and :func:`serve`'s arguments), maps the shared memory and serves."""
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes us
    conn = Connection(int(argv[1]))
    mem_fd = int(argv[2])
    try:
        setup = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    sys.path[:] = setup.pop("sys_path")
    memory = mmap.mmap(mem_fd, setup.pop("size"))
    os.close(mem_fd)
    serve(memory=memory, conn=conn, **setup)


if __name__ == "__main__":
    main(sys.argv)
