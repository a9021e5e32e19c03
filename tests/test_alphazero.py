"""AlphaZero (``algorithms/alphazero.py``): the PUCT search against the pseudocode of Silver et al.
2018, the replay's outcomes, the loss (Eq. 1), where the search's evaluations run under each
policy, exact resume, bad input; and (slow) tic-tac-toe learned to never lose to the solver."""

import math
import zlib

import numpy as np
import pytest
import torch

pyspiel = pytest.importorskip("pyspiel")

import msrl  # noqa: E402
from msrl.algorithms import alphazero  # noqa: E402
from msrl.algorithms.alphazero import AlphaZeroConfig, PUCTSearch, alphazero_loss  # noqa: E402
from msrl.api import BuildContext  # noqa: E402
from msrl.config import load_config  # noqa: E402
from msrl.envs import env_spec  # noqa: E402
from msrl.errors import ConfigError  # noqa: E402
from msrl.graph import NodeKind  # noqa: E402
from msrl.policy import load_policy  # noqa: E402
from msrl.run.job import Job, JobSpec  # noqa: E402

GAME = pyspiel.load_game("tic_tac_toe")
CONFIG = "configs/alphazero_tictactoe.yaml"


def _state(moves):
    state = GAME.new_initial_state()
    for a in moves:
        state.apply_action(a)
    return state


def _uniform_search(state, simulations, hp=None):
    """The search at ``state`` with a network that knows nothing (equal logits, value 0)."""
    search = PUCTSearch(9, hp or AlphaZeroConfig(), noise=False)
    search.begin([state], ())
    for _ in range(simulations):
        search.step(np.zeros((1, 9), np.float32), np.zeros(1, np.float32))
    return search


@pytest.mark.parametrize("puct_q", ["signed", "unit"])
def test_puct_selects_by_the_pseudocodes_score(puct_q):
    """The first simulation follows the largest prior (every count 0); the second, after the
    first leaf's value came back signed for the player who chose it, the largest
    ``Q + c(s) P sqrt(N(s)) / (1 + N(s, a))``, ``Q`` in ``[-1, 1]`` or mapped to ``[0, 1]``
    (0 while unvisited either way)."""
    hp = AlphaZeroConfig(puct_q=puct_q)
    logits = np.log(np.array([[1, 2, 3, 4, 9, 4, 3, 2, 1]], np.float32))
    prior = np.exp(logits[0]) / np.exp(logits[0]).sum()
    search = PUCTSearch(9, hp, noise=False)
    search.begin([_state([])], ())
    search.step(logits, np.array([0.3], np.float32))  # expands the root; selects
    assert [st.history() for st in search.path_states(0)] == [[], [4]]
    # the leaf (o to move) is worth +0.5 to o: -0.5 to x, who chose the centre
    search.step(np.zeros((1, 9), np.float32), np.array([0.5], np.float32))
    assert search.edge_visits[0, 0].sum() + 1 == 2 and search.edge_value[0, 0, 4] == -0.5
    c = math.log((1 + 2 + hp.c_base) / hp.c_base) + hp.c_init
    q4 = -0.5 if puct_q == "signed" else 0.25
    score = [c * prior[a] * math.sqrt(2) / (1 + (a == 4)) + (q4 if a == 4 else 0.0) for a in range(9)]
    assert search.path_states(0)[1].history() == [int(np.argmax(score))]


def test_the_search_takes_a_win_in_one_and_blocks_a_loss_in_one():
    """With a network that knows nothing, the finished games' exact outcomes steer the visits."""
    win = _uniform_search(_state([0, 3, 1, 4]), 200)  # x to move: 2 completes the top row
    assert win.visit_counts()[0].argmax() == 2
    block = _uniform_search(_state([0, 3, 1]), 300)  # o to move: only 2 stops x's top row
    assert block.visit_counts()[0].argmax() == 2


def test_the_root_counts_one_visit_per_evaluation_after_its_own():
    search = _uniform_search(_state([]), 25)
    assert search.visit_counts().sum() == 24 and search.edge_visits[0, 0].sum() + 1 == 25
    pi, move, player = search.result()
    assert pi.dtype == np.float32 and math.isclose(pi.sum(), 1.0, rel_tol=1e-6)
    assert move[0] == search.visit_counts()[0].argmax() and player[0] == 0


def test_root_noise_and_temperature_moves_come_from_each_games_generator():
    hp = AlphaZeroConfig(temperature_moves=2)
    states = [_state([]), _state([0, 4])]  # ply 0 (drawn by the visits) and ply 2 (the most visited)
    runs = []
    for seed in range(8):
        search = PUCTSearch(9, hp, noise=True)
        search.begin(states, [np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])])
        for _ in range(30):
            search.step(np.zeros((2, 9), np.float32), np.zeros(2, np.float32))
        prior = search.prior[0, 0]
        assert math.isclose(prior.sum(), 1.0) and not np.allclose(prior, 1 / 9)  # Dirichlet noise mixed in
        pi, move, _ = search.result()
        assert move[1] == search.visit_counts()[1].argmax()
        runs.append((move[0], tuple(pi[0])))
    assert len({m for m, _ in runs}) > 1  # the first ply's moves vary with the generator
    again = PUCTSearch(9, hp, noise=True)
    again.begin(states, [np.random.default_rng([0, 0]), np.random.default_rng([0, 1])])
    for _ in range(30):
        again.step(np.zeros((2, 9), np.float32), np.zeros(2, np.float32))
    assert (again.result()[1][0], tuple(again.result()[0][0])) == runs[0]


def _reference_search(state, hp, net, simulations, rng):
    """The pseudocode's search written node by node (a dict of children per node, a Python loop
    over the legal moves), one game: the root's visit counts ``(A,)``."""
    A = state.num_distinct_actions()

    def node(st, chooser):
        return {"state": st, "chooser": chooser, "player": st.current_player(), "prior": None, "kids": {}, "n": 0, "w": 0.0}

    root = node(state.clone(), -1)
    path = [root]
    for sim in range(simulations + 1):
        leaf = path[-1]
        if leaf["player"] < 0:
            outcome = np.asarray(leaf["state"].returns(), np.float64)
        else:
            logits, value = net(leaf["state"])
            legal = leaf["state"].legal_actions()
            z = logits[legal].astype(np.float64)
            p = np.exp(z - z.max())
            leaf["prior"], leaf["legal"] = np.zeros(A), legal
            leaf["prior"][legal] = p / p.sum()
            if leaf is root and rng is not None:
                eps = hp.root_exploration_fraction
                leaf["prior"][legal] = (1 - eps) * leaf["prior"][legal] + eps * rng.dirichlet([hp.dirichlet_alpha] * len(legal))
            outcome = np.zeros(2)
            outcome[leaf["player"]], outcome[1 - leaf["player"]] = value, -value
        for nd in path:
            nd["n"] += 1
            if nd["chooser"] >= 0:
                nd["w"] += outcome[nd["chooser"]]
        if sim == simulations:
            break
        nd, path = root, [root]
        while nd["prior"] is not None and nd["player"] >= 0:
            c = math.log((1 + nd["n"] + hp.c_base) / hp.c_base) + hp.c_init
            scores = []
            for a in nd["legal"]:
                kid = nd["kids"].get(a)
                n = kid["n"] if kid else 0
                q = (kid["w"] / n if hp.puct_q == "signed" else 0.5 * kid["w"] / n + 0.5) if n else 0.0
                scores.append((q + c * nd["prior"][a] * math.sqrt(nd["n"]) / (1 + n), -a))
            a = -max(scores)[1]
            if a not in nd["kids"]:
                st = nd["state"].clone()
                st.apply_action(a)
                nd["kids"][a] = node(st, nd["player"])
                path.append(nd["kids"][a])
                break
            nd = nd["kids"][a]
            path.append(nd)
    counts = np.zeros(A)
    for a, kid in root["kids"].items():
        counts[a] = kid["n"]
    return counts


@pytest.mark.parametrize("game, puct_q, noise", [("connect_four", "signed", True), ("connect_four", "unit", False),
                                                 ("tic_tac_toe", "signed", False), ("tic_tac_toe", "unit", True)])
def test_the_batched_search_visits_as_the_pseudocodes_search_node_by_node(game, puct_q, noise):
    """Every game's tree in shared arrays, selected and backed up as array operations: the same
    visit counts, game by game, as the search written node by node, with a network whose output
    is a fixed function of the position (some games finish inside the trees)."""
    g = pyspiel.load_game(game)
    A, hp = g.num_distinct_actions(), AlphaZeroConfig(num_simulations=60, puct_q=puct_q)

    def net(st):
        r = np.random.default_rng(zlib.crc32(st.history_str().encode()))
        return (r.normal(size=A) * 2).astype(np.float32), np.float32(np.tanh(r.normal()))

    rng = np.random.default_rng(0)
    states = []
    for _ in range(6):
        st = g.new_initial_state()
        for _ in range(int(rng.integers(0, 6 if game == "tic_tac_toe" else 25))):
            if st.is_terminal():
                break
            st.apply_action(int(rng.choice(st.legal_actions())))
        if st.is_terminal():
            st = g.new_initial_state()
        states.append(st)
    search = PUCTSearch(A, hp, noise=noise)
    leaves = search.begin(states, [np.random.default_rng([7, i]) for i in range(6)] if noise else ())
    sims = 150  # past num_simulations: the trees grow
    for _ in range(sims):
        out = [net(st) for st in (search.path_states(i)[-1] for i in range(6))]
        assert leaves.shape == (6, int(np.prod(g.observation_tensor_shape())) + A)
        leaves = search.step(np.stack([o[0] for o in out]), np.array([o[1] for o in out]))
    out = [net(st) for st in (search.path_states(i)[-1] for i in range(6))]
    search.step(np.stack([o[0] for o in out]), np.array([o[1] for o in out]))
    assert (search.player < 0).any()  # finished games inside the trees
    for i, st in enumerate(states):
        want = _reference_search(st, hp, net, sims, np.random.default_rng([7, i]) if noise else None)
        assert np.array_equal(search.visit_counts()[i], want), (i, search.visit_counts()[i], want)


def _buffer(n_envs=2, **hp):
    ctx = BuildContext(AlphaZeroConfig(buffer_size=16, batch_size=4, **hp), env_spec("openspiel/tic_tac_toe", n_envs),
                       0, 1, n_envs, 100, 0, torch.device("cpu"))
    return alphazero.AlphaZeroBuffer(ctx)


def _step(buf, i, player, reward, done):
    obs = torch.full((2, 36), float(i))
    buf.insert(obs=obs, policy=torch.full((2, 9), 1 / 9), player=torch.tensor(player), reward=torch.tensor(reward),
               terminated=torch.tensor(done), truncated=torch.tensor([False, False]))


def test_the_replay_fills_in_each_positions_outcome_when_its_game_ends():
    buf = _buffer()
    _step(buf, 0, [0, 0], [0.0, 0.0], [False, False])
    _step(buf, 1, [1, 1], [0.0, 0.0], [False, False])
    _step(buf, 2, [0, 0], [1.0, 0.0], [True, False])  # game 0: player 0's third move wins it
    assert buf.size == 3 and len(buf.games[1]) == 3 and buf.games[0] == []
    stored = buf.storage[:3]
    assert stored["obs"][:, 0].tolist() == [0.0, 1.0, 2.0] and stored["outcome"].tolist() == [1.0, -1.0, 1.0]
    saved = buf.state_dict()
    twin = _buffer()
    twin.load_state_dict(saved)
    _step(twin, 3, [1, 1], [0.0, -1.0], [False, True])  # game 1: a losing last move (a game that pays its mover -1)
    assert twin.size == 7 and twin.storage["outcome"][3:7].tolist() == [1.0, -1.0, 1.0, -1.0]


def test_an_empty_replay_says_what_to_raise():
    with pytest.raises(RuntimeError, match="learning_starts"):
        _buffer().sample_many(2)


def test_the_loss_is_eq_1_without_its_l2_term():
    torch.manual_seed(0)
    logits, value = torch.randn(5, 9), torch.tanh(torch.randn(5))
    pi = torch.softmax(torch.randn(5, 9), -1)
    pi[0] = torch.zeros(9)
    pi[0, 3] = 1.0  # a one-hot target: its zeros contribute nothing
    z = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0])
    value_loss, policy_loss = alphazero_loss(logits, value, pi, z)
    assert torch.allclose(value_loss, ((z - value) ** 2).mean())
    assert torch.allclose(policy_loss, -(pi * torch.log_softmax(logits, -1)).sum(-1).mean())


def _spec(policy="single", replicas=None, placement=None, inference=None, num_envs=4, **hp):
    pol = load_policy(policy).with_overrides(replicas=replicas, placement=placement, inference=inference)
    hparams = AlphaZeroConfig(**{**dict(num_simulations=4, plies_per_iteration=5, buffer_size=256, batch_size=8,
                                        updates_per_iteration=2, learning_starts=40, hidden_sizes=(8,)), **hp})
    return JobSpec(alphazero.ALGORITHM, hparams, "openspiel/tic_tac_toe", num_envs, pol, seed=5, total_env_steps=5_000)


def _run(spec, iterations=4):
    job = Job(spec)
    try:
        job.reset()
        metrics = [{k: float(v) for k, v in job.train_step().items()} for _ in range(iterations)]
        weights = {k: v.clone() for k, v in job.component("learner").get_weights().items()}
        return metrics, weights, job.fragment_graph
    finally:
        job.close()


@pytest.mark.parametrize("net", [{}, dict(network="resnet", channels=4, residual_blocks=1)], ids=["mlp", "resnet"])
def test_under_fine_the_env_replicas_search_and_the_central_actor_evaluates_their_leaves(net):
    """The search's calls stay with the games; each simulation's leaves go to the central
    replica and their evaluations come back (a gather and a scatter inside the simulation loop),
    bitwise what one process computes -- with either torso."""
    a = _run(_spec(**net))
    metrics, weights, fg = _run(_spec("single_learner_fine", {"env": 2}, **net))
    assert any(".conv1." in k for k in weights) == bool(net)
    assert all(torch.equal(a[1][k], weights[k]) for k in weights) and a[0] == metrics
    edges = {(b.value, b.comm_kind) for b in fg.boundaries if b.method == "train_step"}
    assert {("leaves", NodeKind.GATHER), ("logits", NodeKind.SCATTER), ("value", NodeKind.SCATTER)} <= edges
    roles = {f.name: f.spec.roles for f in fg.fragments}
    assert roles["env"] == ("env",) and "actor" in roles["learner"]


def test_bfloat16_inference_evaluates_under_autocast_and_fine_stays_bitwise():
    """``inference_dtype: bfloat16``: the leaf evaluations come back float32, near float32's but
    not equal to them (computed in bfloat16), illegal moves at ILLEGAL_LOGIT exactly; a run
    under fine (the central replica evaluating the gathered leaves) ends bitwise where single's
    ends, and elsewhere than float32's."""
    from msrl.envs.openspiel_env import game_of, observe

    torch.manual_seed(0)
    net = alphazero.policy_value_net(AlphaZeroConfig(network="resnet", channels=16, residual_blocks=2),
                                     "openspiel/connect_four")
    states, rng = [], np.random.default_rng(0)
    for _ in range(32):
        s = game_of("connect_four").new_initial_state()
        for _ in range(int(rng.integers(0, 20))):
            if not s.is_terminal():
                s.apply_action(int(rng.choice(s.legal_actions())))
        states.append(s if not s.is_terminal() else game_of("connect_four").new_initial_state())
    obs = torch.from_numpy(np.stack([observe(s, 7) for s in states]))
    (l32, v32), (l16, v16) = alphazero.infer(net, obs), alphazero.infer(net, obs, "bfloat16")
    legal = obs[:, -7:] > 0.5
    assert l16.dtype == v16.dtype == torch.float32 and not torch.equal(v16, v32)
    assert bool((l16[~legal] == alphazero.ILLEGAL_LOGIT).all()) and bool((~legal).any())
    assert torch.allclose(l16[legal], l32[legal], atol=0.05) and torch.allclose(v16, v32, atol=0.02)
    tower = dict(network="resnet", channels=4, residual_blocks=1, num_simulations=24)
    single = _run(_spec(inference_dtype="bfloat16", **tower))
    metrics, weights, _ = _run(_spec("single_learner_fine", {"env": 2}, inference_dtype="bfloat16", **tower))
    assert all(torch.equal(single[1][k], weights[k]) for k in weights) and single[0] == metrics
    float32 = _run(_spec(**tower))[1]
    assert not all(torch.equal(float32[k], weights[k]) for k in weights)


@pytest.mark.parametrize("native", [True, False], ids=["native", "emulated"])
def test_inference_dtype_auto_follows_the_hardware_and_emulated_bfloat16_warns(monkeypatch, native):
    """``auto`` is bfloat16 where the device computes it in hardware and float32 elsewhere, the
    actor's evaluations in that dtype; an explicit ``bfloat16`` stays bfloat16 and warns where it
    is emulated (naming the setting and the alternatives), float32 never warns; no other dtype."""
    import warnings

    monkeypatch.setattr(alphazero, "native_bfloat16", lambda device: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert alphazero.inference_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
        assert alphazero.inference_dtype("float32", "cpu") == "float32"
        assert alphazero.inference_dtype("bfloat16", "cpu") == "bfloat16"
    said = [str(w.message) for w in caught]
    assert (said == []) if native else (len(said) == 1 and "algorithm.hparams.inference_dtype=auto or float32" in said[0])
    ctx = BuildContext(AlphaZeroConfig(inference_dtype="auto"), env_spec("openspiel/tic_tac_toe", 1),
                       0, 1, 1, 100, 0, torch.device("cpu"))
    assert alphazero.AlphaZeroActor(ctx).dtype == ("bfloat16" if native else "float32")
    with pytest.raises(ValueError, match="float32, bfloat16 or auto"):
        alphazero.inference_dtype("float16", "cpu")
    with pytest.raises(ValueError, match="inference_dtype\\(\\) resolves auto"):
        alphazero.infer(alphazero.AlphaZeroActor(ctx).net, torch.zeros(1, 36), "auto")
    with pytest.raises(ConfigError, match="inference_dtype.*'float32', 'bfloat16' or 'auto'"):
        load_config(CONFIG, ["algorithm.hparams.inference_dtype=half"])


def test_native_bfloat16_reads_the_cpus_flags(monkeypatch):
    """An x86 CPU computes bfloat16 in hardware with AVX512_BF16 or AMX and emulates it without
    both (oneDNN converting at every product: 2.3x to 25.8x slower than float32); a CUDA device
    only where torch sees one; another device type never."""
    import platform

    from msrl.device import native_bfloat16

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for avx512_bf16, amx in [(True, False), (False, True), (False, False)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert native_bfloat16("cpu") is (avx512_bf16 or amx)
        assert native_bfloat16(torch.device("cpu")) is (avx512_bf16 or amx)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert native_bfloat16("cuda") is False and native_bfloat16("meta") is False


def test_dynamic_batching_serves_the_searches_with_the_replay_in_its_own_fragment():
    """Central inference with dynamic batching: each env replica's search runs free and its
    leaves are evaluated in whatever batch forms; the replay, which the learner samples, sits
    in a fragment of its own (sharded per client, its samples could not combine)."""
    with pytest.raises(Exception, match="run it lockstep by dropping distribution_policy.inference"):
        Job(_spec("single_learner_fine", {"env": 2}, inference={"max_batch": 2, "timeout_ms": 5}))
    metrics, _, fg = _run(_spec("single_learner_fine", {"env": 2}, {"buffer": "replay"},
                                inference={"max_batch": 2, "timeout_ms": 5}), iterations=4)
    losses = [v for m in metrics for k, v in m.items() if k.startswith("losses/")]
    assert losses and all(math.isfinite(v) for v in losses)
    assert "replay" in {f.name for f in fg.fragments}


def test_anneal_lr_lowers_the_learning_rate_linearly_over_the_runs_updates():
    """5,000 env steps of 4 games x 5 plies: 250 iterations, learning from the 2nd (40 positions):
    249 updates, the k-th (from 0) at ``(1 - k / 249)`` of the base rate; without ``anneal_lr``
    the rate stays."""
    for anneal in (True, False):
        job = Job(_spec(anneal_lr=anneal))
        try:
            job.reset()
            learner = job.component("learner")
            assert learner.num_learns == 249
            rates = []
            for _ in range(5):
                job.train_step()
                rates.append(learner.optimizer.param_groups[0]["lr"])
        finally:
            job.close()
        assert learner.learns == 4
        expected = [1e-3 * (1 - k / 249) for k in (0, 0, 1, 2, 3)] if anneal else [1e-3] * 5
        assert rates == expected


def test_a_run_resumes_exactly(tmp_path):
    """The games, the search generators and the replay's unfinished games come back from the
    checkpoint: a run stopped and resumed ends where one straight run ends."""
    common = ["algorithm.hparams.num_simulations=4", "algorithm.hparams.plies_per_iteration=5",
              "algorithm.hparams.learning_starts=40", "algorithm.hparams.batch_size=8", "algorithm.hparams.hidden_sizes=[8]",
              "algorithm.hparams.eval_interval=0", "env.num_envs=4", "train.progress=false", "eval.episodes=1"]
    straight = msrl.train(load_config(CONFIG, [*common, f"runs_dir={tmp_path / 'a'}", "train.total_env_steps=160"]))
    first = msrl.train(load_config(CONFIG, [*common, f"runs_dir={tmp_path / 'b'}", "train.total_env_steps=60",
                                            "train.checkpoint_every=1"]))
    resumed = msrl.train(resume=first.run_dir, train__total_env_steps=160)
    assert straight.env_steps == resumed.env_steps == 160
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"]
            for r in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_residual_torso_reads_the_board_planes_and_masks_illegal_moves():
    """``network: resnet``: the board's (C, H, W) planes from the flat observation, logits of
    illegal moves at ILLEGAL_LOGIT, values in (-1, 1); a game without planes is one clear error."""
    from msrl.envs.openspiel_env import game_of, observe

    hp = AlphaZeroConfig(network="resnet", channels=8, residual_blocks=2)
    torch.manual_seed(0)
    net = alphazero.policy_value_net(hp, "openspiel/connect_four")
    assert net.board_shape == (3, 6, 7)
    state = game_of("connect_four").new_initial_state()
    for a in [3] * 6:  # column 3 full
        state.apply_action(a)
    obs = torch.from_numpy(np.stack([observe(state, 7), observe(game_of("connect_four").new_initial_state(), 7)]))
    logits, value = net(obs)
    assert logits.shape == (2, 7) and value.shape == (2,) and bool((value.abs() < 1).all())
    assert logits[0, 3] == alphazero.ILLEGAL_LOGIT and bool((logits[1] > alphazero.ILLEGAL_LOGIT).all())
    with pytest.raises(ConfigError, match=r"network: resnet convolves the board's \(C, H, W\) planes; "
                                          r"openspiel/mancala's observation tensor is \(16,\) \(use network: mlp\)"):
        alphazero.policy_value_net(hp, "openspiel/mancala")
    with pytest.raises(ConfigError, match="env.id must be openspiel/<game> .got 'CartPole-v1'."):
        alphazero.policy_value_net(hp, "CartPole-v1")
    with pytest.raises(ValueError, match=r"board_shape \(3, 6, 6\): a residual torso needs the \(C, H, W\) of the "
                                         r"observation's first 126 entries"):
        alphazero.PolicyValueNet(133, 7, board_shape=(3, 6, 6))


def test_a_game_it_cannot_search_is_one_clear_error():
    with pytest.raises(ConfigError, match="alphazero searches OpenSpiel games in the process that steps them: "
                                          "env.id must be openspiel/<game> and env.engine sync"):
        Job(JobSpec(alphazero.ALGORITHM, AlphaZeroConfig(), "openspiel/tic_tac_toe", 2, load_policy("single"), seed=0,
                    total_env_steps=100, env_engine="process"))
    with pytest.raises(ValueError, match="eval_opponents: 'minimax' is not one of random, mcts, solver"):
        AlphaZeroConfig(eval_opponents=("minimax",))


@pytest.mark.parametrize("kwargs, message", [
    ("{opponent: minimax}", "eval.env_kwargs: opponent: 'minimax' is not one of random, mcts, solver"),
    ("{oponent: random}", "eval.env_kwargs: oponent: an unexpected keyword argument 'oponent' for "
                          "openspiel/tic_tac_toe. Did you mean 'opponent'?"),
])
def test_a_bad_evaluation_kwarg_is_one_line_before_any_work(kwargs, message):
    from msrl.config import build_job_spec

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_job_spec(load_config(CONFIG, [f"eval.env_kwargs={kwargs}"]))


def test_msrls_evaluation_plays_the_network_against_the_configs_opponent(tmp_path):
    """``eval.env_kwargs: {opponent: random}``: the final evaluation's returns are the network's
    results (+1, 0, -1) against a random player, seats alternating."""
    result = msrl.train(load_config(CONFIG, [f"runs_dir={tmp_path}", "train.total_env_steps=128", "eval.episodes=6",
                                             "train.progress=false", "algorithm.hparams.eval_interval=0"]))
    assert len(result.eval_returns) == 6 and set(result.eval_returns) <= {-1.0, 0.0, 1.0}


def test_evaluation_play_uses_the_search():
    """play_match: a network that knows nothing, searching 60 simulations a move, beats a random
    player in most games (the finished games' exact outcomes steer its search)."""
    net = alphazero.PolicyValueNet(36, 9, (8,))
    rates = alphazero.play_match(net, "tic_tac_toe", "random", AlphaZeroConfig(num_simulations=60), games=10, seed=0)
    assert math.isclose(sum(rates.values()), 1.0) and rates["win"] >= 0.6


@pytest.mark.slow
def test_alphazero_learns_tic_tac_toe_and_never_loses_to_the_solver(tmp_path):
    """The shipped config (single, seed 1): after training, the learner's network with its search
    draws every game against the solver (both colours) and beats a random player."""
    result = msrl.train(load_config(CONFIG, [f"runs_dir={tmp_path}", "train.progress=false", "eval.episodes=2"]))
    ckpt = torch.load(result.run_dir / "checkpoints" / "latest.pt", weights_only=False)
    net = alphazero.PolicyValueNet(36, 9, (128, 128))
    net.load_state_dict(ckpt["actor_weights"])
    hp = AlphaZeroConfig()
    solver = alphazero.play_match(net, "tic_tac_toe", "solver", hp, games=20, seed=0)
    assert solver["loss"] == 0.0, solver
    assert alphazero.play_match(net, "tic_tac_toe", "random", hp, games=20, seed=0)["win"] >= 0.8


@pytest.mark.parametrize("policy, replicas, twin", [
    ("single_learner_fine", "env=2", ["distribution_policy.name=single"]),
    ("single_learner_coarse", "actor=2", ["distribution_policy.name=single_learner_coarse",
                                          "distribution_policy.replicas.actor=2"]),
])
def test_on_ray_processes_it_learns_what_it_learns_in_one_process_bitwise(tmp_path, policy, replicas, twin):
    """The searching replicas as Ray processes (the games, their trees and generators in each;
    under fine the leaves cross to the central process every simulation) end with the weights one
    process ends with: under fine, ``single``'s; under coarse x2, coarse x2 as threads."""
    common = ["algorithm.hparams.num_simulations=4", "algorithm.hparams.plies_per_iteration=5",
              "algorithm.hparams.learning_starts=40", "algorithm.hparams.batch_size=8", "algorithm.hparams.hidden_sizes=[8]",
              "algorithm.hparams.eval_interval=0", "env.num_envs=4", "train.progress=false", "eval.episodes=1",
              "train.total_env_steps=120", "train.checkpoint_every=6"]
    kind, n = replicas.split("=")
    ray = msrl.train(load_config(CONFIG, [*common, f"distribution_policy.name={policy}",
                                          f"distribution_policy.replicas.{kind}={n}", "runtime=ray",
                                          f"runs_dir={tmp_path / 'ray'}"]))
    local = msrl.train(load_config(CONFIG, [*common, *twin, "runtime=local", f"runs_dir={tmp_path / 'local'}"]))
    assert ray.env_steps == local.env_steps == 120
    a, b = (torch.load(r.run_dir / "checkpoints" / "latest.pt", weights_only=False)["actor_weights"] for r in (local, ray))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
