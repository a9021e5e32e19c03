"""The shipped algorithms, one file each (``msrl.algorithms.<name>``): PPO, A2C, A3C, PG
(REINFORCE), BC, IQL, CQL and discrete CQL (offline), AWAC (offline then online), GAIL (imitation), DQN (and
Ape-X), C51, SAC, DDPG, TD3, IMPALA, PPO-LSTM, IMPALA-LSTM, multi-agent PPO, MAPPO, self-play
PPO, AlphaZero (self-play with a tree search), DreamerV3 (a world model), QMIX / VDN
(cooperative value decomposition) and MADDPG. Each is written
against ``msrl.api`` only; their pages are ``docs/algorithms/<name>.md``."""
