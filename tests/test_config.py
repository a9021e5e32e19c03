"""Config validation, overrides and their error messages; nothing is written on errors."""

import pathlib

import pytest
import yaml

from msrl.config import ConfigError, apply_overrides, load_config, validate
from msrl.run.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "configs" / "ppo_cartpole.yaml"


def raw():
    return yaml.safe_load(MAIN.read_text())


def test_main_config_validates():
    cfg = load_config(MAIN)
    assert cfg.env.id == "CartPole-v1" and cfg.algorithm.name == "ppo" and cfg.distribution_policy.name == "single"


def test_overrides_are_applied_and_typed():
    cfg = load_config(MAIN, ["train.total_env_steps=2048", "algorithm.hparams.hidden_sizes=[32, 32]", "distribution_policy.replicas.actor=4",
                             "distribution_policy.name=single_learner_coarse"])
    assert cfg.train.total_env_steps == 2048
    assert cfg.algorithm.hparams["hidden_sizes"] == [32, 32]
    assert cfg.distribution_policy.replicas == {"actor": 4}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.total_env_step=5"], "unknown key 'train.total_env_step'; valid keys at train: total_env_steps, total_gradient_steps, checkpoint_every, keep_weights, eval_every, stop_at_return, torch_threads, "
                                          "float32_matmul_precision, flush_denormal, progress"),
        (["train.float32_matmul_precision=tf32"],
         "train.float32_matmul_precision: Input should be 'highest', 'high' or 'medium'"),
        (["bogus=1"], "unknown key 'bogus'; valid keys at top level: name, seed, runs_dir, algorithm, env, distribution_policy, train, eval"),
        (["algorithm.hparams.lr=0.1"], "unknown key 'algorithm.hparams.lr'; valid keys at algorithm.hparams (ppo): num_steps, learning_rate"),
        (["env.id=CartPole-v9"], "unknown env id 'CartPole-v9'. Did you mean 'CartPole-v1', 'CartPole-v0'"),
        (["algorithm.name=ppp"], "unknown algorithm 'ppp'; available: a2c, a3c, alphazero, awac, bc, c51, cql, ddpg, discrete_cql, dqn, dreamerv3, gail, impala, impala_lstm, iql, ma_ppo, maddpg, mappo, pg, ppo, ppo_lstm, ppo_selfplay, qmix, sac, td3 (or a module on sys.path, or a .py file)"),
        (["distribution_policy.name=multi"], "unknown distribution policy 'multi'; available: async_learner, gpu_only, multi_learner, single, single_learner_coarse"),
        (["distribution_policy.backends.main=jax"], "fragment main: unknown fragment backend 'jax'; available: cpu_process_group, cuda_kernel, torch_graph"),
        (["distribution_policy.replicas.learner=2"], "distribution_policy.replicas.learner: policy single has no fragment 'learner'; fragments: main"),
        (["distribution_policy.name=single_learner_coarse", "env.num_envs=7"], "env.num_envs=7 does not split evenly over 2 env replicas"),
        (["env.num_envs=0"], "env.num_envs: Input should be greater than 0"),
        (["algorithm.hparams.num_steps=many"], "algorithm.hparams.num_steps: Input should be a valid integer"),
        (["algorithm.hparams.num_steps=0"], "algorithm.hparams.num_steps: Input should be greater than or equal to 1 (got 0)"),
        (["algorithm.hparams.learning_rate=-1"], "algorithm.hparams.learning_rate: Input should be greater than 0 (got -1)"),
        (["algorithm.hparams.gamma=1.5"], "algorithm.hparams.gamma: Input should be less than or equal to 1 (got 1.5)"),
        (["algorithm.hparams.hidden_sizes=[64, 0]"], "algorithm.hparams.hidden_sizes.1: Input should be greater than or equal to 1"),
        (["algorithm.name=ma_ppo"],
         "algorithm.name=ma_ppo cannot train on env.id=CartPole-v1: ma_ppo is multi-agent (2+ agents per env); "
         "CartPole-v1 has 1 agent(s) per env"),
        (["algorithm.name=sac"], "algorithm.name=sac cannot train on env.id=CartPole-v1: sac supports Box actions; "
                                 "CartPole-v1 has Discrete actions"),
        (["env.engine=gpu"], "env.engine: Input should be 'sync', 'process', 'envpool' or 'ale_vector'"),
        (["env.num_workers=2"], "env.num_workers=2 sets the process engine's workers (or EnvPool's threads), but env.engine='sync'"),
        (["env.num_workers=0", "env.engine=process"], "env.num_workers: Input should be greater than 0"),
        (["env.wrappers=[atari]"], "env.wrappers: 'atari' preprocesses ALE games (ids ALE/<Game>-v5), not 'CartPole-v1'"),
        (["env.wrappers=[frames]"], "env.wrappers: unknown env wrapper 'frames'; valid: atari, atari64, flatten_observation, mask_velocity, multi_discrete_action"),
        (["env.id=msrl/CartPole-v1", "env.engine=process"], "env.engine=process steps gymnasium envs"),
        (["env.id=Pong-v5"], "unknown env id 'Pong-v5'"),
        (["env.id=Pongg-v5", "env.engine=envpool"], "envpool has no task 'Pongg-v5'. Did you mean 'Pong-v5'"),
        (["env.id=Pong-v5", "env.engine=envpool"], "train.eval_every=10000: envpool task Pong-v5 is not a gymnasium id"),
        (["distribution_policy.devices.main=cuda:0"], "device cuda:0 requested but no CUDA device is available"),
        (["distribution_policy.boundaries.weights=latest"],
         "distribution_policy.boundaries.weights: policy single has no boundary class 'weights'; its boundaries are all synchronous"),
        (["distribution_policy.name=single_learner_coarse", "distribution_policy.boundaries.weight=latest"],
         "policy single_learner_coarse has no boundary class 'weight'; classes: trajectories (actor -> learner), "
         "weights (learner -> actor)"),
        (["distribution_policy.name=single_learner_coarse", "distribution_policy.boundaries.weights=newest"],
         "distribution_policy.boundaries.weights=newest: unknown boundary kind; kinds: sync, fifo, latest"),
        (["distribution_policy.name=async_learner", "distribution_policy.queue_capacity=0"],
         "distribution_policy.queue_capacity: Input should be greater than 0"),
        (["distribution_policy.inference.max_batch=1"],
         "distribution_policy.inference: policy single has no central inference; single_learner_fine has"),
        (["distribution_policy.name=single_learner_fine", "distribution_policy.inference.max_batch=3"],
         "distribution_policy.inference.max_batch=3: a batch holds the requests of at most the 2 env replicas "
         "(distribution_policy.replicas.env); valid: 1..2"),
        (["distribution_policy.name=single_learner_fine", "distribution_policy.inference.max_batch=0"],
         "distribution_policy.inference.max_batch: Input should be greater than or equal to 1 (got 0)"),
        (["distribution_policy.name=single_learner_fine", "distribution_policy.inference.timeout_ms=-1"],
         "distribution_policy.inference.timeout_ms: Input should be greater than or equal to 0 (got -1)"),
        (["distribution_policy.name=single_learner_fine", "distribution_policy.inference.batch=1"],
         "unknown key 'distribution_policy.inference.batch'; valid keys at distribution_policy.inference: max_batch, timeout_ms"),
        (["distribution_policy.name=single_learner_fine", "distribution_policy.inference.max_batch=1",
          "distribution_policy.boundaries.actions=sync"],
         "distribution_policy.boundaries.actions=sync: under distribution_policy.inference the boundaries between env "
         "and learner are fifo queues, one per env replica"),
        (["distribution_policy.name=single_learner_coarse", "cluster.cpus_per_replica=100000"],
         "cluster.cpus_per_replica=100000: each replica runs on this machine, which has"),
        (["distribution_policy.name=single_learner_coarse", "cluster.cpus_per_replica.learner=100000"],
         "cluster.cpus_per_replica.learner=100000: each replica runs on this machine, which has"),
        (["distribution_policy.name=async_learner", "cluster.cpus_per_replica={learnr: 2}"],
         "cluster.cpus_per_replica names fragment(s) learnr, which the policy does not have; its fragments: actor, learner"),
        (["cluster.gpus_per_replica={learner: -1}"], "cluster.gpus_per_replica={'learner': -1}: GPUs must be >= 0"),
        (["train.total_env_steps=100"], "train.total_env_steps=100: less than one iteration, which is 256 env steps "
                                        "for this job (env.num_envs=16); a run trains whole iterations within its "
                                        "budget: set at least 256"),
        (["train"], "bad override 'train': expected key.sub=value"),
        (["train..x=1"], "bad override 'train..x=1'"),
        (["seed.x=1"], "'seed' is a value, not a section"),
        (["name=[unclosed"], "the value is not valid YAML"),
    ],
)
def test_bad_config_and_overrides_give_clear_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(MAIN, overrides)
    assert message in str(info.value)


def test_missing_required_key():
    r = raw()
    del r["env"]
    with pytest.raises(ConfigError, match="missing key 'env'"):
        validate(r)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [x\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_apply_overrides_does_not_touch_the_input():
    r = raw()
    out = apply_overrides(r, ["train.total_env_steps=3"])
    assert r["train"]["total_env_steps"] != 3 and out["train"]["total_env_steps"] == 3


@pytest.mark.parametrize("override", ["env.id=Nope-v0", "train.bogus=1", "distribution_policy.name=nope", "train"])
def test_cli_errors_write_nothing(tmp_path, capsys, override):
    runs = tmp_path / "runs"
    code = main(["train", str(MAIN), f"runs_dir={runs}", override])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("msrl: error: ")
    assert not runs.exists()


@pytest.mark.parametrize("extra, match", [
    (["distribution_policy.backends.learner=cpu_process_group"],
     "backends.learner=cpu_process_group steps a fragment's envs in a group of worker processes, but fragment "
     "learner holds no env .*valid: the fragment holding the env, actor"),
    (["distribution_policy.backends.actor=cpu_process_group", "env.id=msrl/CartPole-v1"],
     "env.id='msrl/CartPole-v1' is a native batched env, stepped in the replica's own process: use torch_graph"),
])
def test_cpu_process_group_where_it_cannot_step_envs_in_processes(extra, match):
    from msrl.config import ConfigError, build_job_spec, load_config

    with pytest.raises(ConfigError, match=match):
        build_job_spec(load_config("configs/ppo_cartpole.yaml", ["distribution_policy.name=single_learner_coarse",
                                                                 "runtime=local", *extra]))


def test_cpu_process_group_steps_the_fragments_envs_in_worker_processes():
    """An env-only fragment chosen in YAML to run on cpu_process_group (here coarse's actor, its
    replicas threads under runtime: local) steps its envs in the env engine's worker processes:
    the same run, bitwise, as env.engine=process, while the learner's fragment is untouched."""
    import os

    from msrl.config import build_job_spec, load_config
    from msrl.envs.engine import ProcessEnv
    from msrl.run.job import Job

    base = ["distribution_policy.name=single_learner_coarse", "distribution_policy.replicas.actor=2", "runtime=local",
            "env.num_envs=4", "algorithm.hparams.num_steps=16", "env.num_workers=1"]
    runs = {}
    for name, extra in (("backend", ["distribution_policy.backends.actor=cpu_process_group"]),
                        ("engine", ["env.engine=process"])):
        job = Job(build_job_spec(load_config("configs/ppo_cartpole.yaml", [*base, *extra])))
        try:
            envs = [job.component("env", r) for r in range(2)]
            assert all(isinstance(e, ProcessEnv) for e in envs)
            if name == "backend":  # each replica's envs in a worker process of this one
                assert all(e.worker_pids and os.getpid() not in e.worker_pids for e in envs)
            job.reset()
            runs[name] = [job.train_step() for _ in range(3)]
        finally:
            job.close()
    assert runs["backend"] == runs["engine"]
