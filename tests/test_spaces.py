"""The spaces users bring: ``MultiDiscrete`` actions for the actor-critic algorithms (PPO, A2C,
IMPALA: independent Categoricals), ``Dict`` observations packed one row per env
(:mod:`msrl.envs.dict_obs`: bytes stay bytes) and encoded per key (:class:`DictEncoder`: a CNN
per image, an MLP for the rest), or flattened by gymnasium's ``FlattenObservation``
(``env.wrappers: [flatten_observation]``), on every env engine, learned and checkpointed exactly;
what is still refused, in one line."""

from __future__ import annotations

import csv

import engine_envs  # noqa: F401 - registers MatchTargets-v0, LookAndMatch-v0 (Dict observations, MultiDiscrete actions)
import gymnasium
import numpy as np
import pytest
import torch

ENV = "engine_envs:MatchTargets-v0"
LOOK = "engine_envs:LookAndMatch-v0"  # a frame and a vector: a packed row of bytes
CONFIGS = {"ppo": "configs/ppo_cartpole.yaml", "a2c": "configs/a2c_cartpole.yaml", "impala": "configs/impala_cartpole.yaml",
           "ppo_lstm": "configs/ppo_lstm_cartpole_novel.yaml"}
#: each algorithm's settings for this task (its CartPole config's, where they fit a one-step task):
#: IMPALA's CartPole run makes one update per 512 steps at lr 5e-4 for a 500-step horizon
TUNED = {"impala": ["algorithm.hparams.learning_rate=0.003", "algorithm.hparams.gamma=0.9",
                    "algorithm.hparams.reward_scale=1.0", "env.num_envs=8", "algorithm.hparams.num_steps=16"]}


def test_multi_categorical_log_prob_and_entropy_are_the_sum_of_torchs_categoricals():
    from msrl.rl.distributions import multi_categorical_log_prob_entropy, sample_multi_categorical

    nvec = (3, 4, 2)
    logits = torch.randn(5, sum(nvec), generator=torch.Generator().manual_seed(0))
    action, log_prob = sample_multi_categorical(logits, nvec, torch.Generator().manual_seed(1))
    assert action.shape == (5, 3) and action.dtype == torch.int64
    parts = logits.split(list(nvec), -1)
    assert all(((0 <= action[:, j]) & (action[:, j] < n)).all() for j, n in enumerate(nvec))
    dists = [torch.distributions.Categorical(logits=p) for p in parts]
    want_lp = sum(d.log_prob(action[:, j]) for j, d in enumerate(dists))
    want_ent = sum(d.entropy() for d in dists)
    lp, ent = multi_categorical_log_prob_entropy(logits, nvec, action)
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(log_prob, want_lp, atol=1e-6)
    assert torch.allclose(ent, want_ent, atol=1e-6)
    mode, _ = sample_multi_categorical(logits, nvec, deterministic=True)
    assert torch.equal(mode, torch.stack([p.argmax(-1) for p in parts], -1))


@pytest.mark.parametrize("algo, engine, policy, env, wrappers", [
    ("ppo", "process", "single", ENV, "[flatten_observation]"),
    ("ppo", "process", "single", ENV, "[]"),
    ("ppo", "process", "single", "engine_envs:TupleMatchTargets-v0", "[multi_discrete_action]"),
    ("a2c", "sync", "single", ENV, "[]"),
    ("impala", "sync", "single", ENV, "[]"),
    ("ppo", "sync", "single_learner_fine", ENV, "[]"),
    ("ppo", "sync", "single_learner_coarse", LOOK, "[]"),
    ("impala", "sync", "async_learner", LOOK, "[]"),
    ("ppo_lstm", "sync", "single", LOOK, "[]"),
], ids=["ppo-flattened", "ppo-process", "ppo-tuple_actions", "a2c", "impala", "ppo-central_inference", "ppo-coarse-frame_and_vector",
        "impala-async-frame_and_vector", "ppo_lstm-frame_and_vector"])
def test_an_algorithm_learns_multi_discrete_actions_from_dict_observations(tmp_path, algo, engine, policy, env, wrappers):
    """Each actor-critic algorithm on Dict observations with two-component MultiDiscrete actions,
    packed and encoded per key (MatchTargets: a vector and a Discrete; LookAndMatch: a uint8 frame
    through the CNN beside a vector and a Discrete), or flattened by the wrapper; under one process,
    gathered from 2 actor replicas, served by central inference and queued asynchronously: its
    return rises from a random policy's (4.67; LookAndMatch: 8) towards 16, and its deterministic
    evaluation answers both targets nearly always."""
    from msrl.config import load_config
    from msrl.run.training import train

    over = [f"runs_dir={tmp_path}", "name=spaces", f"env.id={env}", f"env.wrappers={wrappers}",
            f"env.engine={engine}", f"distribution_policy.name={policy}", "train.total_env_steps=40000",
            "train.progress=false", "train.eval_every=0", "eval.episodes=10", "runtime=local", *TUNED.get(algo, [])]
    if env == LOOK:  # each step's reward is its own: a short horizon learns it in fewer steps
        over += ["algorithm.hparams.gamma=0.5"]
    if algo == "ppo_lstm":
        over += ["env.num_envs=8", "algorithm.hparams.num_steps=32", "algorithm.hparams.learning_rate=0.003",
                 "train.total_env_steps=30000"]
    result = train(load_config(CONFIGS[algo], over))
    with open(tmp_path / "spaces" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    returns = [float(r["charts/episodic_return"]) for r in rows[-10:] if r["charts/episodic_return"] not in ("", "nan")]
    assert returns and np.mean(returns) > 12.0, returns  # random: 4.67 (8 on LookAndMatch), perfect: 16
    assert result.eval_returns and result.eval_mean > 13.0


def _dict_space(kind: str) -> gymnasium.spaces.Dict:
    S = gymnasium.spaces
    frame, byte_vector = S.Box(0, 255, (2, 5, 7), np.uint8), S.Box(0, 255, (3,), np.uint8)
    vector, grid = S.Box(-2.0, 2.0, (3,), np.float32), S.Box(-1.0, 1.0, (2, 2), np.float64)
    discrete, multi = S.Discrete(5, start=-2), S.MultiDiscrete([3, 4], start=[1, 0])
    return {"uint8": S.Dict({"frame": frame, "bytes": byte_vector}),
            "float32": S.Dict({"vector": vector, "grid": grid, "choice": discrete, "multi": multi, "bits": S.MultiBinary(3)}),
            "bytes": S.Dict({"frame": frame, "vector": vector, "choice": discrete, "bytes": byte_vector,
                             "multi": multi})}[kind]


@pytest.mark.parametrize("kind, row_dtype", [("uint8", np.uint8), ("float32", np.float32), ("bytes", np.uint8)])
def test_a_dict_observation_packs_into_one_row_and_every_key_comes_back_exactly(kind, row_dtype):
    """Packed rows restore every key's values exactly: uint8 keys as the same bytes (never
    widened: an all-byte Dict is a uint8 row, a frame beside floats a row of bytes), float keys as
    float32 (float64 keys rounded once), discrete keys as their index from 0; also from rows that
    sit at an odd place in a bigger buffer (a rollout's slice)."""
    from msrl.envs.dict_obs import DictLayout

    space = _dict_space(kind)
    space.seed(0)
    layout = DictLayout(space)
    assert layout.dtype == row_dtype and layout.packed_space().shape == (layout.width,)
    assert layout.bytes_row == (kind == "bytes") and (not layout.bytes_row or layout.width % 4 == 0)
    samples = [space.sample() for _ in range(6)]
    rows = torch.from_numpy(np.stack([layout.pack(o) for o in samples]))
    big = torch.zeros(7 * layout.width + 1, dtype=rows.dtype)
    big[1:] = torch.cat([rows.flatten(), torch.zeros(layout.width, dtype=rows.dtype)])
    odd = big[1:1 + 6 * layout.width].view(6, layout.width)  # storage offset 1: not 4-byte aligned
    for batch in (rows, odd, rows[2:5]):
        parts = layout.unpack(batch)
        first = 2 if batch is not rows and batch.shape[0] == 3 else 0
        for i in range(batch.shape[0]):
            o = samples[first + i]
            for f in layout.fields:
                got, want = parts[f.key][i], np.asarray(o[f.key])
                if f.uint8:
                    assert got.dtype == torch.uint8 and torch.equal(got, torch.from_numpy(want))
                elif f.kind == "discrete":
                    assert got.item() == int(want) - int(f.space.start)
                elif f.kind == "multi_discrete":
                    assert torch.equal(got, torch.from_numpy((want - f.space.start).astype(np.float32)))
                else:
                    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(want.astype(np.float32)))


def test_the_dict_encoder_sees_each_key_as_its_own_encoder_would():
    """The encoder's image part is its CNN on the key's frames scaled by 1/255, its vector part
    the other keys in order (discrete ones one-hot) through the MLP; the rollout storage holds the
    packed bytes as uint8."""
    from msrl.api import BuildContext, EnvSpec
    from msrl.envs.dict_obs import DictLayout
    from msrl.rl.buffers import RolloutBuffer
    from msrl.rl.networks import DictEncoder

    S = gymnasium.spaces
    space = S.Dict({"frame": S.Box(0, 255, (4, 36, 36), np.uint8), "vector": S.Box(-1.0, 1.0, (3,), np.float32),
                    "choice": S.Discrete(4)})
    space.seed(1)
    torch.manual_seed(0)
    enc = DictEncoder(space, (8,))
    layout = DictLayout(space)
    samples = [space.sample() for _ in range(5)]
    x = torch.from_numpy(np.stack([layout.pack(o) for o in samples]))
    frames = torch.from_numpy(np.stack([o["frame"] for o in samples])).float() / 255.0
    choice = torch.nn.functional.one_hot(torch.tensor([int(o["choice"]) for o in samples]), 4).float()
    vec = torch.cat([choice, torch.from_numpy(np.stack([o["vector"] for o in samples]))], dim=1)
    want = torch.cat([enc.cnns[0](frames), enc.vector(vec)], dim=1)
    assert enc.width == 512 + 8 and torch.allclose(enc(x), want, atol=1e-6)

    class _Hp:
        num_steps = 4

    buf = RolloutBuffer(BuildContext(hparams=_Hp(), env_spec=EnvSpec("x", space, S.Discrete(2), 3), replica=0,
                                     num_replicas=1, total_num_envs=3, total_env_steps=12, seed=0,
                                     device=torch.device("cpu")))
    assert buf.storage["obs"].dtype == torch.uint8 and buf.storage["obs"].shape == (4, 3, layout.width)
    assert layout.width == 4 * 36 * 36 + 4 * (3 + 1)


@pytest.mark.parametrize("space, error, match", [
    (gymnasium.spaces.Dict({"inner": gymnasium.spaces.Dict({"x": gymnasium.spaces.Discrete(2)})}), ValueError,
     "observation key 'inner' is a Dict space.*flatten_observation"),
    (gymnasium.spaces.Dict({"t": gymnasium.spaces.Text(5)}), ValueError, "observation key 't' is a Text space"),
    (gymnasium.spaces.Dict({}), ValueError, "empty Dict"),
])
def test_a_dict_of_keys_msrl_cannot_pack_is_refused_naming_the_key(space, error, match):
    from msrl.envs.dict_obs import DictLayout

    with pytest.raises(error, match=match):
        DictLayout(space)


@pytest.mark.parametrize("obs, error, match", [
    ({"v": np.array([0.0, np.nan], np.float32), "c": 1}, FloatingPointError, "observation key 'v' holds a NaN"),
    ({"v": np.zeros(3, np.float32), "c": 1}, ValueError, r"observation key 'v' has shape \(3,\)"),
    ({"v": np.zeros(2, np.float32), "c": 7}, ValueError, r"observation key 'c' is 7, outside its space Discrete\(3\)"),
    ({"v": np.zeros(2, np.float32)}, KeyError, "no key 'c'"),
])
def test_a_bad_dict_observation_is_an_error_naming_its_key(obs, error, match):
    from msrl.envs.dict_obs import DictLayout

    layout = DictLayout(gymnasium.spaces.Dict({"v": gymnasium.spaces.Box(-1, 1, (2,)), "c": gymnasium.spaces.Discrete(3)}))
    with pytest.raises(error, match=match):
        layout.pack(obs)


def test_dict_observations_step_alike_on_both_engines_and_checkpoint_exactly(tmp_path):
    """The in-process and the worker-process engine return the same packed rows (bytes for a frame
    beside floats), and a process-engine snapshot restores envs that step exactly as the saved
    ones (the packing wrapper pickles with its env)."""
    from msrl.envs.engine import ProcessEnv
    from msrl.envs.gymnasium_env import GymnasiumEnv

    acts = [torch.randint(0, 2, (4, 2), generator=torch.Generator().manual_seed(t)) for t in range(12)]
    sync, proc = GymnasiumEnv(LOOK, 4), ProcessEnv(LOOK, 4, num_workers=2)
    try:
        assert isinstance(proc.spec.observation_space, gymnasium.spaces.Dict)
        a, b = sync.reset(seed=5), proc.reset(seed=5)
        assert a.dtype == torch.uint8 and torch.equal(a, b)
        for act in acts[:9]:  # past an episode end (8 steps): the final observations too
            sa, sb = sync.step(act), proc.step(act)
            assert torch.equal(sa[0], sb[0]) and torch.equal(sa[4]["final_obs"], sb[4]["final_obs"])
        state = proc.state_dict()
        after = [proc.step(act)[0] for act in acts[9:]]
        proc.load_state_dict(state)
        again = [proc.step(act)[0] for act in acts[9:]]
    finally:
        sync.close()
        proc.close()
    assert all(torch.equal(x, y) for x, y in zip(after, again))


def test_a_trained_dict_policy_acts_on_the_dicts_the_env_returns(tmp_path):
    """``msrl.load`` of a run on Dict observations acts on one env's dict and on a batch of
    them, as the engines packed them in training."""
    import msrl
    from msrl.config import load_config
    from msrl.run.training import train

    over = [f"runs_dir={tmp_path}", "name=dict", f"env.id={ENV}", "train.total_env_steps=2048",
            "train.progress=false", "train.eval_every=0", "eval.episodes=2", "runtime=local"]
    train(load_config(CONFIGS["ppo"], over))
    policy = msrl.load(tmp_path / "dict")
    env = gymnasium.make(ENV)
    obs, _ = env.reset(seed=0)
    one = policy.act(obs)
    assert one.shape == (2,) and env.action_space.contains(one.astype(np.int64))
    batch = policy.act({"first": np.stack([obs["first"]] * 3), "second": np.array([obs["second"]] * 3)})
    assert batch.shape == (3, 2) and (batch == one).all()
    with pytest.raises(ValueError, match="takes Dict observations"):
        policy.act(np.zeros(4))


def test_a_flattened_dict_env_is_checkpointed_exactly_on_the_process_engine():
    """FlattenObservation holds a lambda (no pickle): the env snapshot makes the wrapper again
    around its restored env, and the restored envs step exactly as the saved ones."""
    from msrl.envs.engine import ProcessEnv

    env = ProcessEnv(ENV, 4, num_workers=2, wrappers=["flatten_observation"])
    try:
        env.reset(seed=3)
        acts = [torch.randint(0, 3, (4, 2), generator=torch.Generator().manual_seed(t)) for t in range(6)]
        for a in acts[:3]:
            env.step(a)
        state = env.state_dict()
        after = [env.step(a)[0] for a in acts[3:]]
        env.load_state_dict(state)
        again = [env.step(a)[0] for a in acts[3:]]
    finally:
        env.close()
    assert all(torch.equal(x, y) for x, y in zip(after, again))
    assert after[0].shape == (4, 3 + 4)  # one-hot of 3 and of Discrete(4)


def test_a_dict_observation_an_algorithm_cannot_take_is_one_config_error_naming_the_wrapper(tmp_path):
    from msrl.config import ConfigError, build_job_spec, load_config

    with pytest.raises(ConfigError) as info:
        build_job_spec(load_config("configs/dqn_cartpole.yaml", [f"runs_dir={tmp_path}", f"env.id={ENV}"]))
    msg = str(info.value)
    assert "supports Box observations" in msg and "Dict observations" in msg
    assert "env.wrappers: [flatten_observation]" in msg and "\n" not in msg


def test_the_rollout_stores_multi_discrete_actions_as_int64_columns():
    from msrl.api import BuildContext, EnvSpec
    from msrl.rl.buffers import RolloutBuffer

    class _Hp:
        num_steps = 4

    spec = EnvSpec("x", gymnasium.spaces.Box(-1, 1, (5,), np.float32), gymnasium.spaces.MultiDiscrete([3, 4]), 2)
    buf = RolloutBuffer(BuildContext(hparams=_Hp(), env_spec=spec, replica=0, num_replicas=1, total_num_envs=2,
                                     total_env_steps=8, seed=0, device=torch.device("cpu")))
    assert buf.storage["action"].shape == (4, 2, 2) and buf.storage["action"].dtype == torch.int64


def test_tuple_actions_are_refused_with_the_wrapper_that_takes_them(tmp_path):
    """A Tuple of Discrete actions is one line naming ``multi_discrete_action``; the wrapper
    hands the env each sub-space's ``start + index``; a Tuple holding a Box is refused by position."""
    from msrl.config import ConfigError, build_job_spec, load_config
    from msrl.envs.single_env import TupleAsMultiDiscrete, make_single_env

    with pytest.raises(ConfigError) as info:
        build_job_spec(load_config("configs/ppo_cartpole.yaml",
                                   [f"runs_dir={tmp_path}", "env.id=engine_envs:TupleMatchTargets-v0"]))
    msg = str(info.value)
    assert "Tuple actions" in msg and "env.wrappers: [multi_discrete_action]" in msg and "\n" not in msg
    env = make_single_env("engine_envs:TupleMatchTargets-v0", wrappers=["multi_discrete_action"])
    assert env.action_space == gymnasium.spaces.MultiDiscrete([3, 4])
    while not isinstance(env, TupleAsMultiDiscrete):  # under the Dict observation's packing
        env = env.env
    assert env.action(np.array([2, 3])) == (3, 3)
    box = gymnasium.make("engine_envs:TupleMatchTargets-v0")
    box.unwrapped.action_space = gymnasium.spaces.Tuple((gymnasium.spaces.Discrete(2), gymnasium.spaces.Box(0, 1)))
    with pytest.raises(ValueError, match="action 1 of the Tuple is Box"):
        TupleAsMultiDiscrete(box)
