"""PG (REINFORCE with a learned baseline, msrl.algorithms.pg): its loss against the estimator of
Sutton and Barto 2018, Section 13.4, written as loops over each env's episodes, and what its
learner does with a rollout that finishes no episode."""

import gymnasium
import pytest
import torch
from tensordict import TensorDict

from msrl.algorithms.pg import PGConfig, PGLearner, finished_episode_mask, reinforce_loss
from msrl.api import BuildContext, EnvSpec
from msrl.rl.networks import ActorCritic

OBS = gymnasium.spaces.Box(-1.0, 1.0, (3,))
ACTIONS = gymnasium.spaces.Discrete(2)


def _rollout(T, N, dones, truncs=(), seed=0):
    """A (T, N) rollout with episodes ending at the (t, n) of ``dones`` (terminated) and ``truncs``."""
    g = torch.Generator().manual_seed(seed)
    terminated = torch.zeros(T, N, dtype=torch.bool)
    truncated = torch.zeros(T, N, dtype=torch.bool)
    for t, n in dones:
        terminated[t, n] = True
    for t, n in truncs:
        truncated[t, n] = True
    return TensorDict({
        "obs": torch.randn(T, N, 3, generator=g),
        "action": torch.randint(0, 2, (T, N), generator=g),
        "reward": torch.rand(T, N, generator=g),
        "next_obs": torch.randn(T, N, 3, generator=g),
        "terminated": terminated,
        "truncated": truncated,
    }, batch_size=(T, N))


def _reference_loss(net, batch, gamma, baseline, norm_adv, vf_coef):
    """REINFORCE with baseline, one env and one episode at a time: G_t summed backwards from each
    episode's end (bootstrapped with V(s') where it was truncated), the steps of the episode each
    env's rollout cuts left out."""
    T, N = batch.batch_size
    steps = []  # (t, n, G_t)
    for n in range(N):
        end = None  # the last step of the current episode, scanning backwards
        G = 0.0
        for t in range(T - 1, -1, -1):
            if batch["terminated"][t, n] or batch["truncated"][t, n]:
                end = t
                G = 0.0
                if batch["truncated"][t, n] and baseline:
                    with torch.no_grad():
                        G = float(net.value(batch["next_obs"][t, n][None])[0])
            if end is None:
                continue  # an episode the rollout cuts: its return is unknown
            G = float(batch["reward"][t, n]) + gamma * G
            steps.append((t, n, G))
    obs = torch.stack([batch["obs"][t, n] for t, n, _ in steps])
    action = torch.stack([batch["action"][t, n] for t, n, _ in steps])
    returns = torch.tensor([G for _, _, G in steps])
    log_prob, _, value = net.evaluate(obs, action)
    weights = returns - value.detach() if baseline else returns
    if norm_adv:
        weights = (weights - weights.mean()) / (weights.std() + 1e-8)
    loss = -(weights * log_prob).mean()
    if baseline:
        loss = loss + vf_coef * ((returns - value) ** 2).mean()
    return loss, len(steps)


def test_finished_episode_mask_marks_the_steps_of_episodes_that_end_in_the_rollout():
    terminated = torch.tensor([[0, 0], [1, 0], [0, 0], [0, 0]], dtype=torch.bool)
    truncated = torch.tensor([[0, 0], [0, 0], [0, 1], [0, 0]], dtype=torch.bool)
    mask = finished_episode_mask(terminated, truncated)
    assert mask.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    with pytest.raises(ValueError, match=r"\(T, N\)"):
        finished_episode_mask(terminated.flatten(), truncated.flatten())


@pytest.mark.parametrize("baseline,norm_adv", [(True, True), (True, False), (False, True), (False, False)])
def test_reinforce_gradient_is_the_hand_computed_estimator(baseline, norm_adv):
    torch.manual_seed(0)
    net = ActorCritic(OBS, ACTIONS, (8,))
    # env 0: episodes end at t = 2 and t = 6 (t = 7 is cut); env 1: truncated at t = 4, then cut;
    # env 2: no episode ends (every step left out)
    batch = _rollout(8, 3, dones=[(2, 0), (6, 0)], truncs=[(4, 1)])
    loss, _, used = reinforce_loss(net, batch, gamma=0.9, baseline=baseline, norm_adv=norm_adv, vf_coef=0.5, ent_coef=0.0)
    grads = torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)
    ref, n = _reference_loss(net, batch, 0.9, baseline, norm_adv, 0.5)
    ref_grads = torch.autograd.grad(ref, list(net.parameters()), allow_unused=True)
    assert int(used) == n == 7 + 5
    assert torch.allclose(loss, ref, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            assert torch.allclose(g, r, atol=1e-5)


def _learner(**hp):
    spec = EnvSpec("test", OBS, ACTIONS, num_envs=2)
    ctx = BuildContext(PGConfig(hidden_sizes=(8,), **hp), spec, replica=0, num_replicas=1, total_num_envs=2,
                       total_env_steps=1000, seed=0, device=torch.device("cpu"))
    return PGLearner(ctx)


def test_a_rollout_that_finishes_no_episode_has_a_zero_gradient():
    learner = _learner()
    loss, terms, used = reinforce_loss(learner.net, _rollout(4, 2, dones=[]), gamma=0.99, baseline=True,
                                       norm_adv=True, vf_coef=0.5, ent_coef=0.01)
    assert int(used) == 0 and float(loss.detach()) == 0.0
    loss.backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in learner.net.parameters())
    metrics = learner.learn(_rollout(4, 2, dones=[(1, 0)]))
    assert float(metrics["charts/used_fraction"]) == 2 / 8

