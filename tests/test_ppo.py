"""PPO's components: continuous actions, the gradient hook, the buffer's checks."""

import pytest
import torch

from msrl.algorithms.ppo import ALGORITHM, PPOConfig
from msrl.policy import load_policy
from msrl.run.job import Job, JobSpec
from msrl.runtime.replica import build_trainers


def pendulum_spec(policy="single"):
    hp = PPOConfig(num_steps=8, update_epochs=2, num_minibatches=2)
    return JobSpec(ALGORITHM, hp, "Pendulum-v1", 4, load_policy(policy), seed=0, total_env_steps=1000)


def test_gaussian_policy_on_a_box_action_space_runs_through_both_policies():
    for policy in ("single", "single_learner_coarse"):
        job = Job(pendulum_spec(policy))
        job.reset()
        m = job.train_step()
        assert set(m) >= {"losses/policy_loss", "losses/entropy"}
        actor = job.component("actor")
        action, log_prob, value = actor.act(torch.zeros(4, 3))
        assert action.shape == (4, 1) and action.dtype == torch.float32 and log_prob.shape == (4,) and value.shape == (4,)
        det, _, _ = actor.act(torch.zeros(4, 3), deterministic=True)
        assert torch.equal(det, actor.act(torch.zeros(4, 3), deterministic=True)[0])
        job.close()


def test_gaussian_program_matches_eager_bitwise():
    spec = pendulum_spec()
    eager = build_trainers(spec)[("main", 0)]
    eager.reset()
    ref = [{k: float(v) for k, v in eager.train_step().items()} for _ in range(3)]
    job = Job(spec)
    job.reset()
    assert [job.train_step() for _ in range(3)] == ref
    job.close()


def test_the_gradient_point_sees_every_gradient_before_the_step():
    from msrl.api import collective_scope

    trainer = build_trainers(pendulum_spec())[("main", 0)]
    trainer.reset()
    learner = trainer.learner
    seen = []

    def hook(grads):
        seen.append(len(grads))
        for g in grads:
            g.zero_()  # an all-reduce would average here; zero grads make the step a no-op

    before = {k: v.clone() for k, v in learner.get_weights().items()}
    with collective_scope(learner, "gradients", hook):
        trainer.train_step()
    assert seen == [len(learner.parameters)] * 4  # 2 epochs x 2 minibatches
    after = learner.get_weights()
    # Adam with zero gradients and zero moments leaves the weights unchanged
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_finite_loss_is_refused():
    trainer = build_trainers(pendulum_spec())[("main", 0)]
    with pytest.raises(FloatingPointError, match="loss is nan; the optimiser step was not taken"):
        trainer.learner.apply_gradients(torch.tensor(float("nan"), requires_grad=True))


def test_buffer_checks_its_keys_and_fill():
    trainer = build_trainers(pendulum_spec())[("main", 0)]
    buf = trainer.buffer
    with pytest.raises(KeyError, match="takes exactly"):
        buf.insert(obs=torch.zeros(4, 3))
    with pytest.raises(RuntimeError, match="holds 0 of 8 steps"):
        buf.gather()


def test_categorical_log_prob_entropy_matches_torch_distributions():
    from msrl.rl.distributions import categorical_log_prob_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 5, generator=g) * 3
    logits[0] = torch.tensor([0.0, -float("inf"), -1e4, 2.0, -1e4])  # probabilities of 0
    action = torch.randint(0, 5, (512,), generator=g)
    log_prob, entropy = categorical_log_prob_entropy(logits, action)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(log_prob, dist.log_prob(action), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, dist.entropy(), rtol=0, atol=1e-5)
    assert torch.isfinite(entropy).all()


@pytest.mark.parametrize("shape", [(8, 2), (1, 3), (300, 18)])
def test_sample_categorical_is_torch_multinomial_bitwise(shape):
    from msrl.rl.distributions import sample_categorical

    g = torch.Generator().manual_seed(1)
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(50):
        probs = torch.softmax(torch.randn(shape, generator=g) * 4, dim=-1)
        probs[0, 0] = 0.0  # an impossible action is never drawn
        a = sample_categorical(probs, ours)
        assert a.shape == shape[:1] and a.dtype == torch.int64
        assert torch.equal(a, torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
        assert (a[0] != 0).item()
    assert torch.equal(ours.get_state(), theirs.get_state())  # the same draws consumed
