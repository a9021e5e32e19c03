"""The learner's weights after 3 iterations of the main jobs (PPO, DQN, SAC, IMPALA, MAPPO), under
``single`` (one process) and ``single_learner_coarse`` with 2 actor replicas on Ray: one SHA-256
prefix per (job, policy), printed as JSON. Run it in two checkouts and compare the outputs: a
refactor that keeps behaviour bit for bit prints the same digests (issue 68's acceptance).

    python bench/weights_digest.py > new.json
    (cd ../old-checkout && PYTHONPATH=. python bench/weights_digest.py > old.json); diff old.json new.json

Runs against whichever msrl is importable (an older checkout's ``RayJob(spec)`` too).
"""

from __future__ import annotations

import hashlib
import json
import sys

from msrl.config import build_job_spec, load_config

try:  # this checkout's layout
    from msrl.run.driver import ray_job
    from msrl.run.job import Job
except ImportError:  # an older checkout's (msrl/job.py; RayJob.compile, or RayJob(spec) before it)
    from msrl.cluster.ray_runtime import RayJob
    from msrl.job import Job

    ray_job = getattr(RayJob, "compile", RayJob)

CASES = {
    "ppo": ("configs/ppo_cartpole.yaml", ["env.num_envs=4", "algorithm.hparams.num_steps=16"]),
    "dqn": ("configs/dqn_cartpole.yaml", ["env.num_envs=4", "algorithm.hparams.learning_starts=0", "algorithm.hparams.batch_size=32"]),
    "sac": ("configs/sac_pendulum.yaml", ["env.num_envs=4", "algorithm.hparams.learning_starts=0", "algorithm.hparams.batch_size=32"]),
    "impala": ("configs/impala_cartpole.yaml", ["env.num_envs=4"]),
    "mappo": ("configs/mappo_simple_spread.yaml", ["env.num_envs=4"]),
}

def digest(weights: dict) -> str:
    """A 16-hex-digit SHA-256 prefix of ``weights`` (name -> tensor), keys sorted."""
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

out = {}
which = sys.argv[1:] or list(CASES)
for name in which:
    cfg_path, over = CASES[name]
    base = ["train.eval_every=0", "runtime=local"]
    try:
        spec = build_job_spec(load_config(cfg_path, [*over, *base, "distribution_policy.name=single"]))
        job = Job(spec)
        job.reset()
        for _ in range(3):
            job.train_step()
        out[f"{name}/single"] = digest(job.component("learner").get_weights())
        job.close()
    except Exception as e:
        out[f"{name}/single"] = f"ERR {type(e).__name__}: {str(e)[:120]}"
    try:
        spec = build_job_spec(load_config(cfg_path, [*over, "train.eval_every=0", "distribution_policy.name=single_learner_coarse",
                                                     "distribution_policy.replicas.actor=2", "runtime=ray"]))
        job = ray_job(spec)
        try:
            job.reset()
            job.run(3)
            out[f"{name}/coarse_x2_ray"] = digest(job.weights("learner"))
        finally:
            job.close()
    except Exception as e:
        out[f"{name}/coarse_x2_ray"] = f"ERR {type(e).__name__}: {str(e)[:120]}"
print(json.dumps(out, indent=1))
