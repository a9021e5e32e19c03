"""IMPALA: V-trace against a plain loop over Eq. 1 of Espeholt et al. (2018), its on-policy
special case, and the learner on a batch."""

import pytest
import torch

from msrl.advantages import gae, vtrace


def _reference(mu, pi, r, v, v_next, term, trunc, gamma, rho_bar, c_bar, lam):
    """Eq. 1 written as a sum, one env and one start ``s`` at a time: ``v_s = V(x_s) +
    sum_{t=s}^{e} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t`` up to the first step ``e >= s``
    that ends the episode (or the trajectory's end)."""
    T, N = r.shape
    vs = torch.zeros(T, N, dtype=torch.float64)
    adv = torch.zeros(T, N, dtype=torch.float64)
    for n in range(N):
        ratio = [float(torch.exp(pi[t, n] - mu[t, n])) for t in range(T)]
        rho = [min(rho_bar, x) for x in ratio]
        c = [lam * min(c_bar, x) for x in ratio]
        delta = [rho[t] * (float(r[t, n]) + gamma * (1 - float(term[t, n])) * float(v_next[t, n]) - float(v[t, n]))
                 for t in range(T)]
        for s in range(T):
            e = s
            while e < T - 1 and not (term[e, n] or trunc[e, n]):
                e += 1
            total, trace = 0.0, 1.0
            for t in range(s, e + 1):
                total += gamma ** (t - s) * trace * delta[t]
                trace *= c[t]
            vs[s, n] = float(v[s, n]) + total
        for s in range(T):
            goes_on = s < T - 1 and not (term[s, n] or trunc[s, n])
            nxt = float(vs[s + 1, n]) if goes_on else float(v_next[s, n])
            adv[s, n] = rho[s] * (float(r[s, n]) + gamma * (1 - float(term[s, n])) * nxt - float(v[s, n]))
    return vs, adv


def _trajectory(T=9, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(T, N, generator=g, dtype=torch.float64) * 2
    pi = mu + torch.randn(T, N, generator=g, dtype=torch.float64) * 0.7  # ratios above and below 1
    r = torch.randn(T, N, generator=g, dtype=torch.float64)
    v = torch.randn(T, N, generator=g, dtype=torch.float64)
    v_next = torch.cat([v[1:], torch.randn(1, N, generator=g, dtype=torch.float64)])
    term = torch.rand(T, N, generator=g) < 0.15
    trunc = (torch.rand(T, N, generator=g) < 0.1) & ~term
    v_next = torch.where(term | trunc, torch.randn(T, N, generator=g, dtype=torch.float64), v_next)  # final obs values
    return mu, pi, r, v, v_next, term, trunc


@pytest.mark.parametrize("rho_bar, c_bar, lam", [(1.0, 1.0, 1.0), (2.0, 0.5, 1.0), (1.0, 1.0, 0.9), (0.5, 0.3, 0.95)])
def test_vtrace_equals_a_plain_loop_over_equation_1(rho_bar, c_bar, lam):
    mu, pi, r, v, v_next, term, trunc = _trajectory()
    assert term.any() and trunc.any()
    vs, adv = vtrace(mu, pi, r, v, v_next, term, trunc, 0.97, rho_bar, c_bar, lam)
    ref_vs, ref_adv = _reference(mu, pi, r, v, v_next, term, trunc, 0.97, rho_bar, c_bar, lam)
    torch.testing.assert_close(vs, ref_vs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)


def test_on_policy_vtrace_is_the_n_step_return():
    """pi = mu, rho_bar = c_bar = lambda = 1: v_s is the bootstrapped n-step return, GAE's
    target with lambda = 1 (the paper's remark below Eq. 1)."""
    mu, _, r, v, v_next, term, trunc = _trajectory(seed=3)
    vs, adv = vtrace(mu, mu, r, v, v_next, term, trunc, 0.9)
    advantages, returns = gae(r, v, v_next, term, trunc, 0.9, 1.0)
    torch.testing.assert_close(vs, returns, rtol=1e-12, atol=1e-12)


def test_vtrace_rejects_mismatched_shapes():
    mu, pi, r, v, v_next, term, trunc = _trajectory()
    with pytest.raises(ValueError, match=r"vtrace: values has shape \(8, 5\), rewards has \(9, 5\)"):
        vtrace(mu, pi, r, v[:-1], v_next, term, trunc, 0.9)


def test_the_learner_steps_and_reports_its_importance_weights():
    from msrl.algorithms import impala
    from msrl.policy import load_policy
    from msrl.run.job import Job, JobSpec

    hp = impala.IMPALAConfig(num_steps=8, hidden_sizes=(8,), num_minibatches=2)
    job = Job(JobSpec(impala.ALGORITHM, hp, "CartPole-v1", 4, load_policy("single"), seed=3, total_env_steps=2_000))
    try:
        job.reset()
        before = {k: t.clone() for k, t in job.component("learner").get_weights().items()}
        m = job.run(3)[-1]["output"]
        after = job.component("learner").get_weights()
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert {"losses/policy_loss", "losses/value_loss", "losses/rho_clipped", "losses/mean_ratio"} <= set(m)
        # single: acting and learning alternate, so the first slice's ratios are exactly 1
        assert 0.0 <= m["losses/rho_clipped"] <= 1.0 and 0.5 < m["losses/mean_ratio"] < 2.0
    finally:
        job.close()


def _learner_and_batch(T=8, N=4, **hp):
    import gymnasium
    from tensordict import TensorDict

    from msrl.algorithms import impala
    from msrl.api import BuildContext, EnvSpec

    spec = EnvSpec("CartPole-v1", gymnasium.spaces.Box(-1.0, 1.0, (4,)), gymnasium.spaces.Discrete(2), N)
    learner = impala.IMPALALearner(BuildContext(impala.IMPALAConfig(hidden_sizes=(8,), **hp), spec, 0, 1, N,
                                                100_000, 3, torch.device("cpu")))
    g = torch.Generator().manual_seed(5)
    batch = TensorDict({
        "obs": torch.randn(T, N, 4, generator=g), "next_obs": torch.randn(T, N, 4, generator=g),
        "action": torch.randint(0, 2, (T, N), generator=g), "log_prob": -torch.rand(T, N, generator=g) - 0.2,
        "value": torch.randn(T, N, generator=g), "reward": torch.rand(T, N, generator=g) * 3,
        "terminated": torch.rand(T, N, generator=g) < 0.1, "truncated": torch.zeros(T, N, dtype=torch.bool),
    }, batch_size=(T, N))
    return learner, batch


def _weights(learner):
    return {k: t.clone() for k, t in learner.net.state_dict().items()}


def test_update_epochs_are_passes_over_the_same_batch():
    """update_epochs=2 takes the gradient steps of two single-pass updates on the same batch,
    bitwise (the minibatch order drawn from the learner's generator in the same sequence)."""
    two, batch = _learner_and_batch(update_epochs=2, num_minibatches=2, anneal_lr=False)
    one, _ = _learner_and_batch(update_epochs=1, num_minibatches=2, anneal_lr=False)
    start = _weights(one)
    two.learn(batch)
    one.learn(batch)
    once = _weights(one)
    one.learn(batch)
    assert all(torch.equal(a, b) for a, b in zip(_weights(two).values(), _weights(one).values()))
    assert any(not torch.equal(a, b) for a, b in zip(once.values(), _weights(one).values()))
    assert any(not torch.equal(a, b) for a, b in zip(start.values(), once.values()))


def test_reward_scale_is_the_learning_on_scaled_rewards():
    """reward_scale=c learns exactly what reward_scale=1 learns from the rewards times c."""
    scaled, batch = _learner_and_batch(reward_scale=0.125)
    plain, _ = _learner_and_batch()
    m_scaled = scaled.learn(batch)
    rescaled = batch.clone()
    rescaled["reward"] = batch["reward"] * 0.125
    m_plain = plain.learn(rescaled)
    assert all(torch.equal(a, b) for a, b in zip(_weights(scaled).values(), _weights(plain).values()))
    assert torch.equal(m_scaled["losses/value_loss"], m_plain["losses/value_loss"])
    unscaled, _ = _learner_and_batch()
    unscaled.learn(batch)
    assert any(not torch.equal(a, b) for a, b in zip(_weights(scaled).values(), _weights(unscaled).values()))


def test_norm_adv_takes_the_policy_gradient_on_normalised_v_trace_advantages():
    """norm_adv=True: the policy loss is -(normalize(pg_adv) * log pi).mean() with V-trace's
    advantages under the learner's network before its step (APPO's normalize_advantage)."""
    from msrl.advantages import vtrace
    from msrl.rl.losses import normalize_advantages

    learner, batch = _learner_and_batch(norm_adv=True, anneal_lr=False)
    raw, _ = _learner_and_batch(anneal_lr=False)
    T, N = batch.batch_size
    hp, net = learner.hp, learner.net
    with torch.no_grad():  # one minibatch of all envs: the order of the env slice does not change a mean
        log_prob, _, value = net.evaluate(batch["obs"].reshape(T * N, 4), batch["action"].reshape(T * N))
        log_prob, value = log_prob.view(T, N), value.view(T, N)
        next_values = net.value(batch["next_obs"].reshape(T * N, 4)).view(T, N)
        _, pg_adv = vtrace(batch["log_prob"], log_prob, batch["reward"], value, next_values, batch["terminated"],
                           batch["truncated"], hp.gamma, hp.rho_bar, hp.c_bar, hp.vtrace_lambda)
    expected = -(normalize_advantages(pg_adv) * log_prob).mean()
    plain = -(pg_adv * log_prob).mean()
    got = learner.learn(batch)["losses/policy_loss"]
    assert torch.allclose(got, expected, atol=1e-6) and not torch.allclose(got, plain, atol=1e-3)
    assert torch.allclose(raw.learn(batch)["losses/policy_loss"], plain, atol=1e-6)


def _on_policy(learner, batch):
    """``batch`` with ``log_prob`` the learner's own (every ratio ``pi / mu`` exactly 1)."""
    T, N = batch.batch_size
    with torch.no_grad():
        log_prob, _, _ = learner.net.evaluate(batch["obs"].reshape(T * N, 4), batch["action"].reshape(T * N))
    batch = batch.clone()
    batch["log_prob"] = log_prob.view(T, N)
    return batch


def test_clip_coef_takes_appos_clipped_surrogate_of_the_v_trace_advantages():
    """clip_coef=c: the policy loss is PPO's clipped surrogate (Eq. 7) of V-trace's advantages
    with the ratio pi / mu against the behaviour policy, not IMPALA's -mean(A log pi)."""
    from msrl.advantages import vtrace
    from msrl.rl.losses import clipped_surrogate_loss

    learner, batch = _learner_and_batch(clip_coef=0.1, anneal_lr=False)
    T, N = batch.batch_size
    hp, net = learner.hp, learner.net
    with torch.no_grad():
        log_prob, _, value = net.evaluate(batch["obs"].reshape(T * N, 4), batch["action"].reshape(T * N))
        log_prob, value = log_prob.view(T, N), value.view(T, N)
        next_values = net.value(batch["next_obs"].reshape(T * N, 4)).view(T, N)
        _, pg_adv = vtrace(batch["log_prob"], log_prob, batch["reward"], value, next_values, batch["terminated"],
                           batch["truncated"], hp.gamma, hp.rho_bar, hp.c_bar, hp.vtrace_lambda)
    ratio = (log_prob - batch["log_prob"]).exp()
    expected = clipped_surrogate_loss(pg_adv, ratio, 0.1)
    m = learner.learn(batch)
    assert torch.allclose(m["losses/policy_loss"], expected, atol=1e-6)
    assert not torch.allclose(m["losses/policy_loss"], -(pg_adv * log_prob).mean(), atol=1e-3)
    clipped = ((ratio - 1).abs() > 0.1).float().mean()
    assert 0.0 < clipped < 1.0 and torch.equal(m["losses/clipfrac"], clipped)


def test_clip_coef_first_step_on_policy_is_the_policy_gradient_and_bounds_later_epochs():
    """On the actors' own policy (ratio 1) the surrogate's gradient is the policy gradient, so
    the first step equals IMPALA's; over many passes on one batch the clip holds the policy near
    the behaviour policy where the plain loss walks away from it."""
    clip, batch = _learner_and_batch(clip_coef=0.1, anneal_lr=False, learning_rate=1e-2)
    plain, _ = _learner_and_batch(anneal_lr=False, learning_rate=1e-2)
    batch = _on_policy(clip, batch)
    clip.learn(batch)
    plain.learn(batch)
    for a, b in zip(_weights(clip).values(), _weights(plain).values()):
        assert torch.allclose(a, b, atol=1e-6)
    drift = {}
    for name, learner in (("clip", clip), ("plain", plain)):
        for _ in range(30):
            learner.learn(batch)
        T, N = batch.batch_size
        with torch.no_grad():
            log_prob, _, _ = learner.net.evaluate(batch["obs"].reshape(T * N, 4), batch["action"].reshape(T * N))
        drift[name] = (log_prob.view(T, N) - batch["log_prob"]).abs().mean().item()
    assert drift["clip"] < 0.5 * drift["plain"], drift
