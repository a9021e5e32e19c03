"""msrl's PPO under every distribution policy vs RLlib's PPO on CartPole-v1, in one run; with
``--algo impala``, msrl's IMPALA (``configs/impala_cartpole.yaml`` under ``async_learner`` and
``single``) vs RLlib's APPO and IMPALA.

The peer is RLlib's own tuned CartPole PPO (``rllib/tuned_examples/ppo/cartpole_ppo.py`` of Ray
2.x: new API stack, one 32-unit linear hidden layer with a shared value head, lr 3e-4, 6 epochs,
gamma 0.99, vf_loss_coeff 0.01, KL loss; RLlib's defaults otherwise: 2 env runner processes,
4,000-step train batches, 128-sample minibatches), started the way its docs start it
(``config.build_algo()``, then ``algo.train()`` in a loop). msrl runs ``configs/ppo_cartpole.yaml``
with only ``distribution_policy`` (and ``runtime: ray`` for the multi-process rows) changed.

For each seed, each system trains until a deterministic evaluation (20 episodes of CartPole-v1,
envs seeded 10000..10019, after every ``--eval-every`` env steps; for RLlib after the first
iteration that crosses each multiple) reaches a mean return >= 475, or the budget runs out.
Reported as medians over seeds (a seed that never reaches 475 counts as infinitely slow):

* ``time to 475``: training wall time until that evaluation, evaluations and start-up (Ray,
  actors, RLlib's ``build_algo``) excluded;
* ``env steps/s``: env steps over training wall time (sampling and learning, as both run them);
  for RLlib also its sampling-only rate (env steps over ``env_runner_sampling_timer``).

RLlib pins an older gymnasium than msrl's default install, so run this from an environment with
``pip install -e ".[bench,rllib]"`` (or a venv made with ``--system-site-packages`` that adds
``ray[rllib]``)::

    python bench/bench_rllib.py --seeds 1 2 3
    python bench/bench_rllib.py --algo impala --seeds 1 2 3

RLlib's APPO is its tuned CartPole example (``rllib/tuned_examples/appo/cartpole_appo.py``:
``circular_buffer_iterations_per_batch=2``, ``vf_loss_coeff=0.05``, ``entropy_coeff=0.0``, shared
value layers; RLlib's defaults otherwise: 2 env runner processes); its IMPALA row uses the same
settings where IMPALA has them (``vf_loss_coeff``, ``entropy_coeff``, shared layers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

THRESHOLD = 475.0
EVAL_EPISODES = 20
EVAL_SEED = 10_000

#: (row name, config overrides) of msrl's rows.
MSRL_ROWS = [
    ("single", ["distribution_policy.name=single", "runtime=local"]),
    ("single_learner_coarse, 1 actor (ray)", ["distribution_policy.name=single_learner_coarse",
                                              "distribution_policy.replicas.actor=1", "runtime=ray"]),
    ("single_learner_coarse, 2 actors (ray)", ["distribution_policy.name=single_learner_coarse",
                                               "distribution_policy.replicas.actor=2", "runtime=ray"]),
    ("multi_learner, 1 replica (ray)", ["distribution_policy.name=multi_learner",
                                        "distribution_policy.replicas.main=1", "runtime=ray"]),
    ("multi_learner, 2 replicas (ray)", ["distribution_policy.name=multi_learner",
                                         "distribution_policy.replicas.main=2", "runtime=ray"]),
]


#: msrl's rows against RLlib's APPO and IMPALA (``--algo impala``)
IMPALA_ROWS = [
    ("impala, async_learner, 2 actors (ray)", ["distribution_policy.name=async_learner", "runtime=ray"],
     "configs/impala_cartpole.yaml"),
    ("impala, single", ["distribution_policy.name=single", "runtime=local"], "configs/impala_cartpole.yaml"),
]


def run_msrl(overrides: list[str], seed: int, eval_every: int, budget: int, runs_dir: str,
             config: str = "configs/ppo_cartpole.yaml") -> dict:
    """One msrl run to 475 through :func:`msrl.run.training.train` (what ``msrl train`` runs)."""
    from msrl.config import load_config
    from msrl.run.training import train

    cfg = load_config(config, [
        *overrides, f"seed={seed}", f"runs_dir={runs_dir}", "train.progress=false",
        f"train.eval_every={eval_every}", f"train.stop_at_return={THRESHOLD}", f"train.total_env_steps={budget}",
        f"eval.episodes={EVAL_EPISODES}", f"eval.seed={EVAL_SEED}",
    ])
    r = train(cfg)
    return {"time_to_475": r.time_to_threshold_s, "steps_to_475": r.steps_to_threshold, "sps": r.env_steps / r.time_s}


def _rllib_evaluate(module) -> float:
    """Mean return of 20 deterministic (argmax) episodes of RLlib's module, msrl's protocol."""
    import gymnasium

    env = gymnasium.make_vec("CartPole-v1", num_envs=EVAL_EPISODES, vectorization_mode="sync",
                             vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP})
    obs, _ = env.reset(seed=EVAL_SEED)
    ret = np.zeros(EVAL_EPISODES)
    done = np.zeros(EVAL_EPISODES, dtype=bool)
    while not done.all():
        with torch.no_grad():
            logits = module.forward_inference({"obs": torch.as_tensor(obs, dtype=torch.float32)})["action_dist_inputs"]
        obs, r, te, tr, _ = env.step(logits.argmax(-1).numpy())
        ret += np.where(done, 0.0, r)
        done |= te | tr
    env.close()
    return float(ret.mean())


def _rllib_config(algo: str, seed: int, budget: int = 300_000):
    """RLlib's tuned CartPole config of ``algo`` (``ppo``, ``appo``, ``impala``), or with
    ``impala_msrl`` RLlib's IMPALA with the hyperparameters msrl's ``configs/impala_cartpole.yaml``
    had until 2026-11-26 (bench/RESULTS.md's IMPALA tables ran it): 2 env runners of 16 envs,
    unrolls of 32 steps, one 512-step batch per update, Adam at 5e-4 annealed linearly to 0 over
    ``budget`` env steps, gamma 0.99, rho/c bar 1, entropy 0.01, value 0.5, global-norm clip 0.5,
    separate 64-64 tanh actor and critic. The config now ships gamma 0.995 and ``reward_scale``
    0.1, which RLlib's IMPALA has no option for (it would need an env wrapper its env runner
    processes can import); this peer is not yet re-run with them."""
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    if algo == "impala_msrl":
        from ray.rllib.algorithms.impala import IMPALAConfig

        return (
            IMPALAConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=2, num_envs_per_env_runner=16, rollout_fragment_length=32)
            .training(lr=[[0, 5e-4], [budget, 0.0]], gamma=0.99, train_batch_size_per_learner=512,
                      vtrace_clip_rho_threshold=1.0, vtrace_clip_pg_rho_threshold=1.0, entropy_coeff=0.01,
                      vf_loss_coeff=0.5, grad_clip=0.5, grad_clip_by="global_norm")
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64, 64], fcnet_activation="tanh",
                                                       vf_share_layers=False))
            .debugging(seed=seed)
        )
    if algo == "ppo":
        from ray.rllib.algorithms.ppo import PPOConfig

        return (
            PPOConfig()
            .environment("CartPole-v1")
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[32], fcnet_activation="linear", vf_share_layers=True))
            .training(gamma=0.99, lr=0.0003, num_epochs=6, vf_loss_coeff=0.01, use_kl_loss=True)
            .debugging(seed=seed)
        )
    if algo == "appo":
        from ray.rllib.algorithms.appo import APPOConfig

        return (APPOConfig().environment("CartPole-v1")
                .training(circular_buffer_iterations_per_batch=2, vf_loss_coeff=0.05, entropy_coeff=0.0)
                .rl_module(model_config=DefaultModelConfig(vf_share_layers=True)).debugging(seed=seed))
    from ray.rllib.algorithms.impala import IMPALAConfig

    return (IMPALAConfig().environment("CartPole-v1").training(vf_loss_coeff=0.05, entropy_coeff=0.0)
            .rl_module(model_config=DefaultModelConfig(vf_share_layers=True)).debugging(seed=seed))


def run_rllib(seed: int, eval_every: int, budget: int, algo: str = "ppo", whole_budget: bool = False) -> dict:
    """One RLlib run of its CartPole config of ``algo`` (see :func:`_rllib_config`); evaluation and
    ``build_algo`` excluded from its clock. With ``whole_budget`` it trains the whole budget (the
    threshold: the first evaluation at or above it) and adds ``final_eval``, a greedy evaluation of
    the final module, and ``curve`` ((env steps, training s, eval return) per evaluation)."""
    import ray

    config = _rllib_config(algo, seed, budget)
    if algo != "ppo" and not ray.is_initialized():
        # APPO/IMPALA's defaults place a remote learner beside the main process and 2 env
        # runners: 4 CPU bundles, which a 2-core machine's Ray cannot place (the run hangs);
        # declare 4 logical CPUs, as msrl's Ray runtime declares what its bundles ask for
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False)
    algo = config.build_algo()
    train_s, steps, done_eval = 0.0, 0, 0
    hit: tuple[float, int] | None = None
    sampling_sps = []
    curve: list[tuple[int, float, float]] = []
    final_eval = None
    try:
        while steps < budget:
            t0 = time.perf_counter()
            result = algo.train()
            train_s += time.perf_counter() - t0
            new_steps = int(result["num_env_steps_sampled_lifetime"])
            sample_s = result.get("timers", {}).get("env_runner_sampling_timer")
            if sample_s:
                sampling_sps.append((new_steps - steps) / sample_s)
            steps = new_steps
            if steps // eval_every > done_eval:
                done_eval = steps // eval_every
                ret = _rllib_evaluate(algo.get_module())
                curve.append((steps, train_s, ret))
                if ret >= THRESHOLD and hit is None:
                    hit = (train_s, steps)
                    if not whole_budget:
                        break
        if whole_budget:
            final_eval = _rllib_evaluate(algo.get_module())
    finally:
        algo.stop()
        ray.shutdown()
    out = {"time_to_475": hit[0] if hit else None, "steps_to_475": hit[1] if hit else None,
           "sps": steps / train_s, "sampling_sps": statistics.median(sampling_sps) if sampling_sps else None}
    if whole_budget:
        out.update(final_eval=final_eval, curve=curve)
    return out


def _median_time(xs: list) -> float | None:
    """Median with a run that never reached the threshold counted as infinitely slow."""
    vals = sorted(float("inf") if x is None else x for x in xs)
    m = statistics.median(vals)
    return None if m == float("inf") else m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--eval-every", type=int, default=4000, help="env steps between evaluations (RLlib's batch size)")
    p.add_argument("--budget", type=int, default=300_000)
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--algo", choices=["ppo", "impala"], default="ppo",
                   help="ppo: msrl's PPO rows vs RLlib's PPO; impala: msrl's IMPALA rows vs RLlib's APPO and IMPALA")
    args = p.parse_args()
    try:
        import ray.rllib  # noqa: F401
    except ImportError as e:
        sys.exit(f"bench_rllib: RLlib is not installed ({e}); pip install -e '.[bench,rllib]'")
    torch.set_num_threads(1)
    rows = [(n, o, "configs/ppo_cartpole.yaml") for n, o in MSRL_ROWS] if args.algo == "ppo" else IMPALA_ROWS
    peers = ["ppo"] if args.algo == "ppo" else ["appo", "impala"]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    for peer in peers:
        results[f"rllib {peer}"] = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for seed in args.seeds:
            for name, over, config in rows:
                results[name].append(run_msrl(over, seed, args.eval_every, args.budget, runs_dir, config))
                import ray

                if ray.is_initialized():
                    ray.shutdown()
            for peer in peers:
                results[f"rllib {peer}"].append(run_rllib(seed, args.eval_every, args.budget, peer))
            print(f"seed {seed}: " + "; ".join(f"{k} {v[-1]}" for k, v in results.items()), flush=True)
    med = {k: {"time_to_475": _median_time([r["time_to_475"] for r in v]),
               "steps_to_475": _median_time([r["steps_to_475"] for r in v]),
               "sps": statistics.median(r["sps"] for r in v),
               "reached": sum(r["time_to_475"] is not None for r in v)} for k, v in results.items()}
    import ray

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"ray {ray.__version__}, seeds {args.seeds}, eval every {args.eval_every} env steps")
    print("| system | reached 475 | time to 475 (s, median) | env steps to 475 (median) | env steps/s (median) | "
          + " | ".join(f"time / RLlib {p}'s | env steps/s / RLlib {p}'s" for p in peers) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in peers) + " |")
    for k in results:
        m = med[k]
        tt = f"{m['time_to_475']:.2f}" if m["time_to_475"] is not None else "not reached"
        st = f"{m['steps_to_475']:.0f}" if m["steps_to_475"] is not None else "-"
        ratios = []
        for p_ in peers:
            peer = med[f"rllib {p_}"]
            ratios.append(f"{m['time_to_475'] / peer['time_to_475']:.3f}x" if m["time_to_475"] and peer["time_to_475"] else "n/a")
            ratios.append(f"{m['sps'] / peer['sps']:.1f}x")
        print(f"| {k} | {m['reached']}/{len(args.seeds)} | {tt} | {st} | {m['sps']:.0f} | " + " | ".join(ratios) + " |")
    for p_ in peers:
        sampling = [r["sampling_sps"] for r in results[f"rllib {p_}"] if r.get("sampling_sps")]
        if sampling:
            print(f"\nRLlib {p_}'s sampling-only rate (env steps / env_runner_sampling_timer, median): "
                  f"{statistics.median(sampling):.0f} env steps/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "medians": med}, f, indent=2)


if __name__ == "__main__":
    main()
