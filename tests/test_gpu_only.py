"""The gpu_only policy: one fragment, env ops as kernels (host build here), rollout on one device."""

import contextlib
import pathlib
import sys
import traceback

import pytest
import torch

from msrl.config import ConfigError, build_job_spec, load_config
from msrl.envs.native import CartPole
from msrl.job import Job
from msrl.run import train

CFG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "ppo_cartpole_gpu_only.yaml"
SMALL = ["env.num_envs=8", "algorithm.hparams.num_steps=16", "train.total_env_steps=4096"]


def test_gpu_only_is_one_kernel_fragment_with_no_boundaries():
    job = Job(build_job_spec(load_config(CFG, SMALL)))
    fg = job.fragment_graph
    assert [(f.name, f.spec.backend) for f in fg.fragments] == [("main", "cuda_kernel")]
    assert fg.boundaries == []
    env = job.component("env")
    assert isinstance(env, CartPole) and env.impl == "kernel"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert env.device.type == expected and fg.fragments[0].spec.device.startswith(expected)
    job.close()


def test_gpu_only_kernels_reproduce_the_torch_reference_bitwise():
    """The same job with the env on the torch reference (policy single) learns identically."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernels' sin/cos differ from torch's by ulps")
    kernel = Job(build_job_spec(load_config(CFG, SMALL)))
    reference = Job(build_job_spec(load_config(CFG, SMALL + ["distribution_policy.name=single"])))
    assert reference.component("env").impl == "torch"
    kernel.reset(), reference.reset()
    for _ in range(4):
        assert kernel.train_step() == reference.train_step()
    assert torch.equal(kernel.trainers[("main", 0)].obs, reference.trainers[("main", 0)].obs)
    kernel.close(), reference.close()


def test_gpu_only_needs_a_native_env():
    with pytest.raises(ConfigError, match="is a gymnasium env, but fragment main runs the env on the cuda_kernel backend"):
        load_config(CFG, ["env.id=CartPole-v1"])
    with pytest.raises(ConfigError, match="unknown native env id 'msrl/Nope-v0'; native envs: msrl/CartPole-v1"):
        load_config(CFG, ["env.id=msrl/Nope-v0"])
    with pytest.raises(ConfigError, match="evaluations run on gymnasium envs"):
        load_config(CFG, ["eval.env_id=msrl/CartPole-v1"])


def test_gpu_only_learns_and_is_evaluated_on_gymnasium(tmp_path):
    cfg = load_config(CFG, [f"runs_dir={tmp_path}", "train.progress=false", "train.eval_every=0",
                            "train.total_env_steps=40000", "seed=2"])
    r = train(cfg)
    assert r.eval_mean >= 100, r.eval_returns  # a random policy scores ~22


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gpu_only_reaches_475_on_gymnasium_cartpole(tmp_path, seed):
    cfg = load_config(CFG, [f"runs_dir={tmp_path}", "train.progress=false", f"seed={seed}"])
    assert cfg.train.total_env_steps <= 500_000
    r = train(cfg)
    assert r.eval_mean >= 475, r.eval_returns


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("env_id", ["msrl/CartPole-v1", "msrl/Pendulum-v1"])
def test_no_host_device_copies_inside_an_iteration_on_cuda(env_id):
    from torch.profiler import ProfilerActivity, profile

    job = Job(build_job_spec(load_config(CFG, [f"env.id={env_id}", "env.num_envs=1024", "algorithm.hparams.num_steps=16"])))
    job.reset()
    job.runtime.run("train_step")  # warm up (allocator, kernels)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        job.runtime.run("train_step")
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy" in e.name and ("HtoD" in e.name or "DtoH" in e.name)]
    assert copies == [], copies[:10]
    job.close()


def test_native_env_replicas_draw_what_one_process_draws():
    """Env i is seeded with seed + i, so 2 replicas of 4 envs start where 8 envs in one process do."""
    one = Job(build_job_spec(load_config(CFG, SMALL)))
    two = Job(build_job_spec(load_config(CFG, SMALL + ["distribution_policy.name=single_learner_coarse",
                                                       "distribution_policy.replicas.actor=2"])))
    one.reset(), two.reset()
    both = torch.cat([two.trainers[("actor", r)].obs for r in range(2)])
    assert torch.equal(one.trainers[("main", 0)].obs.cpu(), both.cpu())  # gpu_only on a GPU, coarse on the CPU
    one.close(), two.close()


@contextlib.contextmanager
def _host_syncs(allow=(("api.py", "apply_gradients"), ("", "pop_episode_stats"))):
    """Records every tensor -> Python conversion (``bool``, ``item``, ``tolist``, ``numpy``,
    ``int``/``float``): on a GPU each is a device-to-host copy and a sync. ``apply_gradients``'s
    finiteness check is allowed: it runs only for CPU losses; so is the runtime's one read of
    the iteration's finished episodes after the iteration (as its metrics are read)."""
    names = ("__bool__", "item", "tolist", "numpy", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    hits = []

    def recording(name):
        original = saved[name]

        def f(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if not any(caller.co_filename.endswith(file) and caller.co_name == fn for file, fn in allow):
                hits.append(f"Tensor.{name} from " + "".join(traceback.format_stack(limit=4)[:-1]))
            return original(self, *args, **kwargs)
        return f

    for n in names:
        setattr(torch.Tensor, n, recording(n))
    try:
        yield hits
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("config, env_id", [(CFG, "msrl/CartPole-v1"), (CFG, "msrl/Pendulum-v1"),
                                             (pathlib.Path(CFG).with_name("ma_ppo_tag.yaml"), "msrl/Tag-v0")])
def test_no_tensor_to_host_conversion_on_the_gpu_only_hot_path(config, env_id):
    """The CPU guard against hidden syncs: one iteration of every native env's gpu_only job
    (rollout, GAE, update) converts no tensor to a Python value (a validating
    torch.distributions.Normal did, ~3 times per env step)."""
    job = Job(build_job_spec(load_config(config, [f"env.id={env_id}", "env.num_envs=8", "algorithm.hparams.num_steps=8"])))
    try:
        job.reset()
        job.runtime.run("train_step")
        with _host_syncs() as hits:
            job.runtime.run("train_step")
        assert hits == [], hits[0]
    finally:
        job.close()
