"""Population-based training (Jaderberg et al. 2017, "Population Based Training of Neural
Networks", Section 3; the exploit/explore of Ray Tune's ``PopulationBasedTraining``): a layer
over any policy that trains ``population.size`` members of one job at once, each with its own
values of the ``population.explore``d hyperparameters.

Read top to bottom: the members' configs (:func:`member_configs`), the checks on a config
(:func:`check_population`), the exploit/explore step on scores (:func:`plan_exploits`,
:func:`explore`), copying a learner from one member into another (:func:`exploit`), and the
driver (:func:`train_population`).

Every member is a whole job under the config's policy (its fragments, replicas and devices),
built in this process (``runtime: local``), with its own seed (``seed + 1000 * i``), envs and
replay; ``population.devices`` puts member ``i``'s whole job on ``devices[i % len(devices)]``
(members on separate GPUs, or sharing them round robin; a donor's learner state is copied across
devices). The members train in turns of ``interval`` iterations; after each turn the members are
ranked by the mean return of the episodes they finished in it (a member that finished none keeps
its last score). With ``k = ceil(quantile * size)`` (at most ``size // 2``), each of the bottom
``k`` members copies a member of the top ``k`` drawn uniformly -- its learner's whole state
(weights, optimiser moments, normalisation statistics, step counters), its actors take those
weights -- and takes the donor's hyperparameters perturbed: each explored value multiplied by one
of ``perturbation_factors`` (or, with ``resample_probability``, drawn anew from its range) and
clipped to ``[min, max]``. The member's own envs, rollout or replay and random generators stay
its own; its job is rebuilt with the new hyperparameters (what a traced program reads from them
is fixed when it is built) and its optimisers take the new hyperparameters' settings (a learning
rate), not the donor's.

Only float hyperparameters can be explored (an int such as ``num_steps`` would change a
tensor's shape); the decisions use their own generator (seeded by ``seed``), so a population's
run is reproducible. Outputs, in the run directory: ``members/<i>/`` (each member's
``config.yaml`` with its final hyperparameters, ``metrics.csv`` with ``pbt/<name>`` columns, its
final checkpoint for ``msrl.load``), ``population.csv`` (one row per member per turn: score,
hyperparameters, the donor it copied), and ``eval.json`` (every member's final evaluation and
the best member).

A population checkpoints as a whole: after a turn, once ``train.checkpoint_every`` iterations
have passed since the last one (and at the end), ``population.pt`` takes every member's job
state, config, values, score and time with the turn and the decisions' generator, in one atomic
write, so the members never come from different turns. ``msrl train --resume RUN_DIR`` rebuilds
each member from it and goes on exactly (``train.total_env_steps`` may grow, as for any run);
each member's ``metrics.csv`` and ``population.csv`` drop the rows past it.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import pathlib
import random
import sys
import time
from typing import Any, Sequence

import torch

from msrl.config import RunConfig, build_job_spec, check_population, on_device
from msrl.run.outcome import TrainResult
from msrl.runtime.host import matmul_precision, torch_threads

__all__ = ["MEMBER_SEED_STRIDE", "Member", "member_configs", "member_device", "check_population", "plan_exploits", "explore",
           "exploit", "describe", "train_population"]

#: member ``i`` trains with seed ``seed + MEMBER_SEED_STRIDE * i`` (replicas offset seeds by their index)
MEMBER_SEED_STRIDE = 1000


def _sample(r: Any, rng: random.Random) -> float:
    """A value drawn from an :class:`~msrl.config.ExploreRange`: log-uniform or uniform in ``[min, max]``."""
    if r.log:
        return math.exp(rng.uniform(math.log(r.min), math.log(r.max)))
    return rng.uniform(r.min, r.max)


def member_configs(cfg: RunConfig, rng: random.Random) -> list[RunConfig]:
    """The members' configs: ``cfg`` without its ``population`` section, member ``i`` with seed
    ``seed + MEMBER_SEED_STRIDE * i``, each explored hyperparameter at ``explore.<name>.init[i]``
    (or drawn from its range with ``rng``), in ``algorithm.hparams``, and, with
    ``population.devices``, every fragment of its job on ``devices[i % len(devices)]``
    (:func:`member_device`)."""
    pop = cfg.population
    fragments = ([f.name for f in build_job_spec(cfg.model_copy(update={"population": None})).policy.fragments]
                 if pop.devices else [])
    out = []
    for i in range(pop.size):
        values = {name: (r.init[i] if r.init is not None else _sample(r, rng)) for name, r in pop.explore.items()}
        mcfg = _with_hparams(cfg, values, cfg.seed + MEMBER_SEED_STRIDE * i)
        device = member_device(cfg, i)
        out.append(mcfg if device is None else on_device(mcfg, device, fragments))
    return out


def member_device(cfg: RunConfig, i: int) -> str | None:
    """Member ``i``'s device under ``population.devices`` (round robin), or None (the policy's)."""
    devices = cfg.population.devices
    return None if not devices else devices[i % len(devices)]


def _with_hparams(cfg: RunConfig, values: dict[str, float], seed: int) -> RunConfig:
    algorithm = cfg.algorithm.model_copy(update={"hparams": {**cfg.algorithm.hparams, **values}})
    return cfg.model_copy(update={"population": None, "seed": seed, "algorithm": algorithm})


def plan_exploits(scores: Sequence[float], quantile: float, rng: random.Random) -> dict[int, int]:
    """Truncation selection: ``{member: donor}`` for each of the bottom ``k`` members by score,
    its donor drawn uniformly from the top ``k``; ``k = ceil(quantile * n)``, at most ``n // 2``.
    Ties rank by member index (lower first among equals at the bottom)."""
    n = len(scores)
    k = min(math.ceil(quantile * n), n // 2)
    order = sorted(range(n), key=lambda i: (scores[i], -i))  # worst first
    bottom, top = order[:k], order[n - k:]
    return {m: rng.choice(top) for m in bottom}


def explore(values: dict[str, float], ranges: dict[str, Any], factors: Sequence[float], resample_probability: float,
            rng: random.Random) -> dict[str, float]:
    """The donor's ``values`` perturbed: each multiplied by one of ``factors`` drawn uniformly,
    or with probability ``resample_probability`` drawn anew from its range; clipped to
    ``[min, max]`` (Jaderberg et al. 2017, Section 4.1's "perturb"; Ray Tune's defaults 0.8/1.2, 0.25)."""
    out = {}
    for name, v in values.items():
        r = ranges[name]
        new = _sample(r, rng) if rng.random() < resample_probability else v * rng.choice(list(factors))
        out[name] = min(max(new, r.min), r.max)
    return out


@dataclasses.dataclass
class Member:
    """One member of a population: its config (current hyperparameters), its job (a
    :class:`~msrl.run.job.Job`), its score, its directory and metrics writer."""

    index: int
    cfg: RunConfig
    job: Any
    values: dict[str, float]
    run_dir: pathlib.Path
    metrics: Any
    score: float = -math.inf
    time_s: float = 0.0


def _optimizers(component: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    return [(k, v) for k, v in sorted(vars(component).items()) if isinstance(v, torch.optim.Optimizer)]


def exploit(member_job: Any, own_state: Any, donor_job: Any) -> None:
    """Makes ``member_job`` -- built afresh with the member's new hyperparameters, nothing loaded
    yet -- the member with the donor's learner: the member's own state ``own_state`` (its
    :meth:`~msrl.run.job.Job.state_dict`: envs, buffers, generators, counters) loaded, then every
    learner replica's whole state copied from ``donor_job``'s (its ``state_dict``: weights,
    optimiser moments, statistics), then each optimiser's settings (``lr`` and every other
    param-group setting) put back to what the new hyperparameters set when the job was built,
    and every actor replica given the copied weights.

    Raises:
        ValueError: the two jobs' learner replicas differ in number.
    """
    mine, theirs = member_job.replicas_with("learner"), donor_job.replicas_with("learner")
    if len(mine) != len(theirs):
        raise ValueError(f"exploit: {len(mine)} learner replicas against the donor's {len(theirs)}")
    fresh = [{name: [{k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in g.items() if k != "params"}
                     for g in opt.param_groups] for name, opt in _optimizers(t.components["learner"])} for t in mine]
    member_job.load_state_dict(own_state)
    for t_m, t_d, settings in zip(mine, theirs, fresh):
        learner = t_m.components["learner"]
        learner.load_state_dict(copy.deepcopy(t_d.components["learner"].state_dict()))
        for name, opt in _optimizers(learner):
            for group, own in zip(opt.param_groups, settings[name]):
                for k, v in own.items():
                    if isinstance(group.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                        group[k].copy_(v)  # a tensor setting (a capturable lr) stays the same tensor
                    else:
                        group[k] = v
    weights = mine[0].components["learner"].get_weights()
    for t in member_job.replicas_with("actor"):
        t.components["actor"].set_weights(weights)


#: the population's checkpoint in its run directory (every member's job state, one atomic file)
POPULATION_CHECKPOINT = "population.pt"


def _save_population(run_dir: pathlib.Path, members: list[Member], turn: int, rng: random.Random) -> None:
    """Every member's state, the turn and the decisions' generator, in one atomic write."""
    from msrl.run.checkpoints import atomic_save

    atomic_save({"turn": turn, "rng": rng.getstate(),
                 "members": [{"config": m.cfg.model_dump(), "job": m.job.state_dict(), "values": dict(m.values),
                              "score": m.score, "time_s": m.time_s} for m in members]},
                run_dir / POPULATION_CHECKPOINT)


def _load_population(run_dir: pathlib.Path) -> dict[str, Any]:
    """``population.pt`` of a population run directory.

    Raises:
        ConfigError: none yet, or a damaged one (the loader's error in one line).
    """
    from msrl.config import ConfigError
    from msrl.run.checkpoints import first_sentence

    path = run_dir / POPULATION_CHECKPOINT
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: the population has no checkpoint yet ({POPULATION_CHECKPOINT}); start it again")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - zip, pickle and EOF errors all mean a damaged file
        raise ConfigError(f"{path}: damaged population checkpoint ({type(e).__name__}: {first_sentence(str(e))})") from None
    if not isinstance(state, dict) or not {"turn", "rng", "members"} <= set(state):
        raise ConfigError(f"{path}: not an msrl population checkpoint")
    return state


def _truncate_log(path: pathlib.Path, turn: int) -> None:
    """Drops ``population.csv``'s rows of turns after ``turn`` (a resumed population's)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([rows[0], *(r for r in rows[1:] if int(r[0]) <= turn)])


def train_population(cfg: RunConfig, resume: str | pathlib.Path | None = None) -> TrainResult:
    """Trains ``cfg.population.size`` members of ``cfg``'s job with PBT (see the module), each
    for ``train.total_env_steps``; returns the result of the member whose final evaluation is
    best (``run_dir``: its directory, ``<run dir>/members/<i>``, which ``msrl.load`` takes).
    With ``resume`` (a population's run directory), goes on from its ``population.pt``.

    Raises:
        ConfigError: as :func:`check_population`; the run directory cannot be made; ``resume``
            is not a population run of this config, has no checkpoint yet or a damaged one.
        TrainingStopped: a member's fragment raised (a NaN loss, ...): the message names the member.
        TrainingInterrupted: Ctrl-C; ``population.pt`` kept, the resume command named.
    """
    from msrl.config import ConfigError
    from msrl.run.checkpoints import Progress, save_checkpoint
    from msrl.run.evaluation import evaluate_job
    from msrl.run.job import Job
    from msrl.run.metrics import MetricsWriter
    from msrl.run.outcome import TrainingInterrupted
    from msrl.run.rundir import RunLock, atomic_write_text, check_resumable, check_runs_dir, load_run_config, new_run_dir, write_config

    pop = cfg.population
    spec0 = build_job_spec(cfg)  # (checks the population too: check_population)
    names = list(pop.explore)
    members: list[Member] = []
    if resume is not None:
        run_dir = pathlib.Path(resume)
        check_resumable(load_run_config(run_dir), cfg, run_dir)
        lock = RunLock(run_dir)
    else:
        check_runs_dir(cfg)
        run_dir = new_run_dir(cfg)
        lock = RunLock(run_dir)
    log_path = run_dir / "population.csv"
    saved = [0]  # the iteration population.pt holds (updated by _turns)
    try:
        # the run's threads and precision (every member's), the caller's back after the run
        with torch_threads(cfg.train.torch_threads), matmul_precision(spec0.float32_matmul_precision):
            if resume is not None:
                state = _load_population(run_dir)
                done = max((int(ms["job"]["iteration"]) for ms in state["members"]), default=0) * spec0.env_steps_per_iteration
                if spec0.num_iterations * spec0.env_steps_per_iteration < done:
                    raise ConfigError(f"train.total_env_steps={cfg.train.total_env_steps}: the population's checkpoint is already "
                                      f"at env step {done}; a resumed run can only train for longer")
                write_config(run_dir, cfg)  # a longer budget
                rng = random.Random()
                rng.setstate(state["rng"])
                turn = int(state["turn"])
                for i, ms in enumerate(state["members"]):
                    mcfg = RunConfig.model_validate(ms["config"])
                    mcfg = mcfg.model_copy(update={"train": cfg.train})  # the resumed run's budget and schedule
                    job = Job(build_job_spec(mcfg))
                    job.load_state_dict(ms["job"])
                    mdir = run_dir / "members" / str(i)
                    m = Member(i, mcfg, job, dict(ms["values"]), mdir, MetricsWriter(mdir, job.iteration), float(ms["score"]),
                               float(ms["time_s"]))
                    members.append(m)
                saved[0] = members[0].job.iteration
                _truncate_log(log_path, turn)
            else:
                rng = random.Random(cfg.seed)
                write_config(run_dir, cfg)
                for i, mcfg in enumerate(member_configs(cfg, rng)):
                    mdir = run_dir / "members" / str(i)
                    mdir.mkdir(parents=True)
                    write_config(mdir, mcfg)
                    job = Job(build_job_spec(mcfg))
                    job.reset()
                    members.append(Member(i, mcfg, job, {n: float(mcfg.algorithm.hparams[n]) for n in names}, mdir,
                                          MetricsWriter(mdir, None)))
                with open(log_path, "w", newline="") as f:
                    csv.writer(f).writerow(["turn", "iteration", "env_steps", "member", "score", *names, "copied_from"])
                turn = 0
            per = spec0.env_steps_per_iteration
            total_iterations = spec0.num_iterations
            try:
                _turns(members, turn, total_iterations, cfg, rng, run_dir, log_path, names, per, saved)
            except KeyboardInterrupt:
                kept = run_dir / POPULATION_CHECKPOINT
                have = kept.is_file()
                raise TrainingInterrupted(run_dir, members[0].job.env_steps, kept if have else None,
                                          saved[0] * per if have else None) from None
            results = []
            for m in members:
                m.metrics.close()
                returns = evaluate_job(m.job, m.cfg)
                mean = sum(returns) / len(returns) if returns else float("nan")
                results.append({"member": m.index, "hparams": m.values, "mean_return": mean, "returns": returns,
                                "env_steps": m.job.env_steps, "training_time_s": round(m.time_s, 3)})
                write_config(m.run_dir, m.cfg)
                save_checkpoint(m.run_dir, m.job, Progress(time_s=m.time_s))
            best = max(results, key=lambda r: -math.inf if math.isnan(r["mean_return"]) else r["mean_return"])
            atomic_write_text(run_dir / "eval.json", json.dumps({"best_member": best["member"], "members": results}, indent=2))
            print(f"msrl: population of {pop.size}: best member {best['member']} ({_values_text(best['hparams'])}) "
                  f"mean return {best['mean_return']:.1f}; {run_dir / 'eval.json'}", file=sys.stderr)
            top = members[best["member"]]
            return TrainResult(run_dir=top.run_dir, iterations=top.job.iteration, env_steps=top.job.env_steps,
                               time_s=top.time_s, eval_returns=best["returns"])
    finally:
        for m in members:
            m.job.close()
        lock.release()


def _turns(members: list[Member], turn: int, total_iterations: int, cfg: RunConfig, rng: random.Random,
           run_dir: pathlib.Path, log_path: pathlib.Path, names: list[str], per: int, saved: list[int]) -> None:
    """The turns after ``turn`` to the budget's end: each member trains ``interval`` iterations,
    the bottom copy the top, ``population.csv`` gets the turn's rows, and ``population.pt`` the
    population when ``train.checkpoint_every`` iterations have passed since ``saved[0]`` (and at
    the end; ``saved[0]`` then becomes the iteration it holds)."""
    from msrl.run.metrics import iteration_row
    from msrl.run.outcome import TrainingStopped
    from msrl.runtime.replica import FragmentError

    pop = cfg.population
    while members[0].job.iteration < total_iterations:
        n = min(pop.interval, total_iterations - members[0].job.iteration)
        turn += 1
        for m in members:
            t0 = time.perf_counter()
            try:
                records = m.job.run(n)
            except (FragmentError, FloatingPointError) as e:
                raise TrainingStopped(f"population member {m.index} ({_values_text(m.values)}): {e}", m.job.iteration,
                                      m.job.env_steps, None) from e
            dt = time.perf_counter() - t0
            returns = [r for rec in records for r in rec["episodes"].returns]
            if returns:
                m.score = sum(returns) / len(returns)
            for j, rec in enumerate(records):
                row = iteration_row(rec, m.job.iteration - n + j + 1, m.time_s + dt * (j + 1) / n, per, False, None, None)
                m.metrics.log({**row, **{f"pbt/{k}": v for k, v in m.values.items()}})
            m.metrics.flush()
            m.time_s += dt
        plan = plan_exploits([m.score for m in members], pop.quantile, rng) if \
            members[0].job.iteration < total_iterations else {}
        rows = []
        for m in members:
            rows.append([turn, m.job.iteration, m.job.env_steps, m.index, m.score, *(m.values[k] for k in names),
                         plan.get(m.index, "")])
        if cfg.train.progress:  # one line per member and turn: where it is, how it does, what it takes
            for m in members:
                score = "no episode finished" if m.score == -math.inf else f"mean return {m.score:.1f}"
                took = f"; copies member {plan[m.index]}" if m.index in plan else ""
                print(f"msrl: turn {turn}, member {m.index} ({_values_text(m.values)}): iteration "
                      f"{m.job.iteration}/{total_iterations}, env step {m.job.env_steps}, {score}{took}",
                      file=sys.stderr, flush=True)
        for i, d in sorted(plan.items()):
            _replace(members[i], members[d], explore(members[d].values, pop.explore, pop.perturbation_factors,
                                                      pop.resample_probability, rng))
        with open(log_path, "a", newline="") as f:
            csv.writer(f).writerows(rows)
        done = members[0].job.iteration >= total_iterations
        if done or members[0].job.iteration - saved[0] >= cfg.train.checkpoint_every:
            _save_population(run_dir, members, turn, rng)
            saved[0] = members[0].job.iteration


def describe(cfg: RunConfig, job: Any) -> str:
    """``msrl graph``'s population block: the members, what each explores, and the exchange
    (what a member copies from a donor, with its bytes measured on ``job``, a member's job)."""
    pop = cfg.population
    k = min(math.ceil(pop.quantile * pop.size), pop.size // 2)
    nbytes = sum(_state_bytes(t.components["learner"].state_dict()) for t in job.replicas_with("learner"))
    where = ("" if not pop.devices else
             "; devices: " + ", ".join(f"member {i} on {member_device(cfg, i)}" for i in range(pop.size)))
    lines = [f"## population (PBT): {pop.size} members, each the job below (its own seed, envs and buffers), in turns "
             f"of {pop.interval} iterations{where}",
             f"exchange after each turn: the bottom {k} by mean episode return copy the learner state of one of the top {k} "
             f"({nbytes} bytes: weights, optimiser, statistics) and its actors take the weights; then explore:"]
    for name, r in pop.explore.items():
        start = f"init {r.init}" if r.init is not None else f"init drawn {'log-' if r.log else ''}uniformly"
        lines.append(f"  {name} in [{r.min:g}, {r.max:g}] ({start}): x{' or x'.join(f'{f:g}' for f in pop.perturbation_factors)}"
                     f", drawn anew with p={pop.resample_probability:g}")
    return "\n".join(lines) + "\n\n"


def _state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _values_text(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in values.items())


def _replace(member: Member, donor: Member, values: dict[str, float]) -> None:
    """Member takes ``donor``'s learner with hyperparameters ``values``: its job rebuilt with
    them, its own state (envs, buffers, generators) loaded back, then :func:`exploit`."""
    from msrl.run.job import Job

    own = copy.deepcopy(member.job.state_dict())
    member.job.close()
    member.cfg = _with_hparams(member.cfg, values, member.cfg.seed)
    job = Job(build_job_spec(member.cfg))
    exploit(job, own, donor.job)
    member.job, member.values = job, dict(values)
