"""Partial values (``@returns("partial")``): one replica's part of a sum -- A3C's pushed
gradients -- reduced where it crosses to other replicas: the comm op the partitioner picks, the
reduction's exact bits in replica order (synchronous and queued), what the probe and the
partitioner refuse and what they suggest, and A3C learning under each policy."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch

from msrl.algorithms import a3c
from msrl.api import returns
from msrl.errors import PartitionError
from msrl.graph import NodeKind
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec
from msrl.runtime.patterns import total

TINY = dict(num_steps=5, hidden_sizes=(8,))


def _spec(policy="single_learner_coarse", actors=2, algorithm=a3c.ALGORITHM, boundaries=None, seed=7):
    pol = load_policy(policy)
    pol = pol.with_overrides(replicas={"actor": actors} if policy != "single" else None, boundaries=boundaries)
    return JobSpec(algorithm, algorithm.hparams(**TINY), "CartPole-v1", 2 * actors, pol, seed=seed, total_env_steps=5_000)


def test_total_sums_leaf_by_leaf_in_replica_order_and_means_divide():
    g = torch.Generator().manual_seed(0)
    values = [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g), "n": 2.0} for _ in range(3)]
    s = total(values)
    want_w = values[0]["w"].clone().add_(values[1]["w"]).add_(values[2]["w"])
    assert torch.equal(s["w"], want_w) and s["n"] == 6.0
    m = total(values, mean=True)
    assert torch.equal(m["w"], want_w / 3) and m["n"] == 2.0
    assert torch.equal(values[0]["w"], values[0]["w"].clone())  # inputs untouched: the sum is a new tensor
    assert total(values[:1]) is values[0]
    with pytest.raises(ValueError, match="another structure"):
        total([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"shape \(3,\) where replica 0's has \(2,\)"):
        total([torch.zeros(2), torch.zeros(3)])


def test_returns_takes_a_reduction_for_partial_values():
    with pytest.raises(ValueError, match="combine by one of"):
        returns("partial", reduce="max")
    with pytest.raises(ValueError, match="unknown value kind 'partal'"):
        returns("partal")


def test_coarse_reduces_the_gradients_to_the_learner_and_msrl_graph_says_so(capsys):
    job = Job(_spec())
    try:
        crossing = {b.value: b for b in job.fragment_graph.boundaries if b.method == "train_step" and b.src == "actor"}
        assert set(crossing) == {"gradients", "losses"}
        for b in crossing.values():
            assert (b.comm_kind, b.value_kind, b.reduce, b.axis) == (NodeKind.REDUCE, "partial", "mean", None)
    finally:
        job.close()
    from msrl.run.cli import main

    assert main(["graph", "configs/a3c_cartpole.yaml", "distribution_policy.name=single_learner_coarse",
                 "distribution_policy.replicas.actor=4"]) == 0
    out = capsys.readouterr().out
    assert ("sync reduce (mean over actor's 4 replicas) gradients actor (x4) -> learner (x1), partial" in out)
    assert "comm.reduce('train_step/b0:gradients')" in out


class _Recorded:
    """Wraps A3C's worker and learner methods: what every actor replica pushed, what the learner got."""

    def __init__(self, monkeypatch):
        self.pushed, self.applied = [], []
        worker, learner = a3c.A3CWorker.gradients, a3c.A3CLearner.apply

        def gradients(actor, batch):
            out = worker(actor, batch)
            self.pushed.append((actor.replica_seed, {k: v.clone() for k, v in out[0].items()}))
            return out

        gradients.__msrl_returns__ = worker.__msrl_returns__
        monkeypatch.setattr(a3c.A3CWorker, "gradients", gradients)
        monkeypatch.setattr(a3c.A3CLearner, "apply", lambda lrn, grads, losses: (
            self.applied.append({k: v.clone() for k, v in grads.items()}), learner(lrn, grads, losses))[1])
        real_init = a3c.A3CWorker.__init__

        def init(actor, ctx):
            real_init(actor, ctx)
            actor.replica_seed = ctx.replica

        monkeypatch.setattr(a3c.A3CWorker, "__init__", init)


@pytest.mark.parametrize("boundaries", [None, {"trajectories": "fifo", "weights": "fresh"}], ids=["sync", "queued"])
def test_the_learner_gets_the_mean_of_every_actors_gradients_bit_for_bit(monkeypatch, boundaries):
    """Coarse x2, synchronous and in lockstep over queues: each step the learner applies
    ``(g_0 + g_1) / 2`` of the two actor replicas' pushes, summed in replica order (the same bits
    whichever replica arrives first)."""
    rec = _Recorded(monkeypatch)
    job = Job(_spec(boundaries=boundaries))
    rec.pushed.clear()  # the probe's runs
    rec.applied.clear()
    try:
        job.reset()
        if boundaries:
            job.run(3)
        else:
            for _ in range(3):
                job.train_step()
    finally:
        job.close()
    assert len(rec.applied) == 3 and len(rec.pushed) == 6
    by_replica = {0: [g for r, g in rec.pushed if r == 0], 1: [g for r, g in rec.pushed if r == 1]}
    for i, got in enumerate(rec.applied):
        g0, g1 = by_replica[0][i], by_replica[1][i]
        for k in got:
            assert torch.equal(got[k], g0[k].clone().add_(g1[k]).div_(2)), k
        assert not all(torch.equal(g0[k], g1[k]) for k in g0)  # two rollouts, two gradients


def test_a3c_bootstraps_from_its_rollouts_values_and_from_final_observations_where_truncated():
    """A3C's actors take ``V(s'_t)`` from the rollout's own values (computed by the same copy)
    and run the critic only on the last row's next observations and the final observations of
    truncated episodes: the same values, loss and gradients as the critic over every
    ``next_obs``, to float rounding."""
    import gymnasium
    import numpy as np
    from tensordict import TensorDict

    from msrl.rl.losses import actor_critic_loss, rollout_next_values
    from msrl.rl.networks import ActorCritic

    torch.manual_seed(0)
    net = ActorCritic(gymnasium.spaces.Box(-np.inf, np.inf, (4,), np.float32), gymnasium.spaces.Discrete(2), (8,))
    T, N = 5, 3
    states = torch.randn(T + 1, N, 4)
    terminated, truncated = torch.zeros(T, N, dtype=torch.bool), torch.zeros(T, N, dtype=torch.bool)
    terminated[1, 0] = True  # ends: states[2, 0] is a reset observation
    truncated[2, 1] = True   # cut by a time limit: bootstrapped from its final observation
    truncated[T - 1, 2] = True
    next_obs = states[1:].clone()
    next_obs[2, 1] = torch.randn(4)  # the final observations the env reported
    next_obs[T - 1, 2] = torch.randn(4)
    next_obs[1, 0] = torch.randn(4)
    with torch.no_grad():  # the values the actor recorded as it acted, one step at a time
        value = torch.stack([net.value(states[t]) for t in range(T)])
    batch = TensorDict({"obs": states[:T], "action": torch.randint(0, 2, (T, N)), "value": value,
                        "reward": torch.randn(T, N), "terminated": terminated, "truncated": truncated,
                        "next_obs": next_obs}, batch_size=[T, N])
    with torch.no_grad():
        full = net.value(next_obs.flatten(0, 1)).view(T, N)
    got = rollout_next_values(net, batch)
    live = ~terminated
    torch.testing.assert_close(got[live], full[live], rtol=0, atol=1e-6)
    assert not torch.allclose(full[2, 1], value[3, 1])  # the final observation's value, not the next row's
    kw = dict(gamma=0.99, gae_lambda=1.0, norm_adv=False, vf_coef=0.25, ent_coef=0.01)
    loss_full, _ = actor_critic_loss(net, batch, **kw)
    loss_cheap, _ = actor_critic_loss(net, batch, **kw, next_values=got)
    torch.testing.assert_close(loss_cheap, loss_full, rtol=0, atol=1e-6)
    grads_full = torch.autograd.grad(loss_full, list(net.parameters()))
    grads_cheap = torch.autograd.grad(loss_cheap, list(net.parameters()))
    for a, b in zip(grads_cheap, grads_full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a3c_under_single_equals_coarse_with_one_actor_bitwise():
    def run(spec):
        job = Job(spec)
        try:
            job.reset()
            metrics = [job.train_step() for _ in range(4)]
            return metrics, {k: v.clone() for k, v in job.component("learner").get_weights().items()}
        finally:
            job.close()

    a = run(_spec("single", 1))
    b = run(_spec("single_learner_coarse", 1))
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert [{k: float(v) for k, v in m.items()} for m in a[0]] == [{k: float(v) for k, v in m.items()} for m in b[0]]


def test_a3c_learner_steps_with_tensorflows_rmsprop_when_asked_and_resumes_it():
    """``optimizer: rmsprop_tf`` (configs/a3c_pong.yaml): ``p -= lr g / sqrt(v + eps)`` with the
    mean square ``v`` from 1 (TensorFlow's RMSProp, as Baselines' A2C), not torch's
    ``lr g / (sqrt(v) + eps)`` from 0; the mean square survives a checkpoint."""
    spec = _spec("single", 1)
    spec = dataclasses.replace(spec, hparams=a3c.ALGORITHM.hparams(**TINY, optimizer="rmsprop_tf", learning_rate=0.01,
                                                                     max_grad_norm=1e9))
    job = Job(spec)
    try:
        job.reset()
        learner = job.component("learner")
        before = {k: v.clone() for k, v in learner.get_weights().items()}
        g = torch.Generator().manual_seed(3)
        grads = {n: torch.randn(p.shape, generator=g) for n, p in learner.net.named_parameters()}
        learner.apply(grads, {})
        after = learner.get_weights()
        for name in grads:
            v = 0.99 + 0.01 * grads[name] ** 2  # one step of the mean square, from 1
            want = before[name] - 0.01 * grads[name] / torch.sqrt(v + 1e-5)
            torch.testing.assert_close(after[name], want, rtol=1e-6, atol=1e-7)
            torch_rmsprop = before[name] - 0.01 * grads[name] / (torch.sqrt(0.01 * grads[name] ** 2) + 1e-5)
            assert not torch.allclose(after[name], torch_rmsprop)  # (torch's first step is ~10x larger)
        buffer = io.BytesIO()
        torch.save(learner.state_dict(), buffer)  # as a checkpoint holds it
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
        twin = Job(spec)
        try:
            twin.reset()
            twin.component("learner").load_state_dict(state)
            learner.apply(grads, {})
            twin.component("learner").apply(grads, {})
            a, b = learner.get_weights(), twin.component("learner").get_weights()
            assert all(torch.equal(a[k], b[k]) for k in a)
        finally:
            twin.close()
    finally:
        job.close()


class _BatchDeclared(a3c.A3CWorker):
    """The mistake the issue found: gradients declared a batch (concatenated along each
    parameter's first axis: (8, 4) + (8, 4) -> (16, 4))."""

    @returns("batch", "partial", reduce="mean")
    def gradients(self, batch):
        return super().gradients(batch)


class _ReplicatedDeclared(a3c.A3CWorker):
    @returns("replicated")
    def gradients(self, batch):
        return super().gradients(batch)


def test_gradients_declared_a_batch_are_refused_by_the_probe_with_partial_suggested():
    algo = dataclasses.replace(a3c.ALGORITHM, components={**a3c.ALGORITHM.components, "actor": _BatchDeclared})
    with pytest.raises(PartitionError) as info:
        Job(_spec(algorithm=algo))
    msg = str(info.value)
    assert "declares 'gradients' 'batch' along axis 0" in msg and "do not share one number of rows" in msg
    assert "@msrl.api.returns('partial')" in msg


def test_a_replicated_value_from_many_replicas_suggests_partial_and_never_batch():
    algo = dataclasses.replace(a3c.ALGORITHM, components={**a3c.ALGORITHM.components, "actor": _ReplicatedDeclared})
    with pytest.raises(PartitionError) as info:
        Job(_spec(algorithm=algo))
    msg = str(info.value)
    assert "a replicated value cannot be gathered from many replicas to fewer" in msg
    assert "@msrl.api.returns('partial')" in msg and "returns('batch')" not in msg


@pytest.mark.parametrize("policy", ["single_learner_coarse", "async_learner"])
def test_a3c_reaches_475_on_cartpole_with_two_actor_replicas(tmp_path, policy):
    """A3C as configured (configs/a3c_cartpole.yaml), 2 actor processes' worth of replicas on the
    local runtime: synchronous (the mean of both pushes per step) and asynchronous (each actor
    pushes and pulls without waiting; the policy lag logged): the run stops when its evaluation
    reaches 475 (``train.stop_at_return``), within its 200k env steps."""
    import csv

    from msrl.config import load_config
    from msrl.run.training import train

    cfg = load_config("configs/a3c_cartpole.yaml", [f"runs_dir={tmp_path}", "name=a3c", "train.progress=false",
                                                   f"distribution_policy.name={policy}", "runtime=local"])
    r = train(cfg)
    assert r.eval_mean >= 475, r.eval_returns
    with open(tmp_path / "a3c" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    if policy == "async_learner":
        lags = [float(x["async/policy_lag_mean"]) for x in rows if x.get("async/policy_lag_mean") not in (None, "", "nan")]
        assert lags and all(0 <= lag <= 3 for lag in lags) and max(lags) > 0
    assert all(math.isfinite(float(x["losses/value_loss"])) for x in rows if x["losses/value_loss"] not in ("", "nan"))
