"""Installs msrl: the top-level folders become sub-packages of one ``msrl`` namespace."""

from setuptools import setup

setup(
    name="msrl",
    version="0.1.0",
    description="Distributed reinforcement learning on a fragmented dataflow graph",
    python_requires=">=3.10",
    packages=[
        "msrl",
        "msrl.api",
        "msrl.graph",
        "msrl.frontend",
        "msrl.config",
        "msrl.envs",
        "msrl.envs.native",
        "msrl.runtime",
        "msrl.runtime.programs",
        "msrl.runtime.transports",
        "msrl.run",
        "msrl.rl",
        "msrl.algorithms",
        "msrl.distribution_policies",
        "msrl.fragments",
        "msrl.cluster",
    ],
    package_dir={
        "msrl": "msrl",
        "msrl.algorithms": "algorithms",
        "msrl.distribution_policies": "distribution_policies",
        "msrl.fragments": "fragments",
        "msrl.cluster": "cluster",
    },
    package_data={"msrl.envs.native": ["*.cu", "*.cuh", "*.h"]},
    install_requires=[
        "torch>=2.2",
        "numpy>=1.24",
        "gymnasium>=1.1",
        "networkx>=3.0",
        "pyyaml>=6.0",
        "pydantic>=2.5",
        "tensordict>=0.5,<0.16",
        "tqdm>=4.60",
        "grpcio>=1.60",  # asynchronous boundaries between processes (cluster/grpc_transport.py)
        "tensorboard>=2.14",
        "google-crc32c>=1.5",  # TensorBoard's event checksums in C (msrl.run.metrics.use_native_crc32c)
        "matplotlib>=3.7",
        "ray[default]>=2.40",  # [default]: the Jobs client of msrl launch
        "psutil>=5.9",  # a replica's network interface by its address (msrl/runtime/wiring.py)
    ],
    extras_require={
        # the documentation site (mkdocs.yml): `pip install -e ".[docs]" && mkdocs serve`
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "griffe-pydantic>=1.1"],
        # cupy-cuda12x: the GPU build's set-up errors are tested where CuPy imports without a GPU
        # (the simulators too: the env engine and native MuJoCo tasks are tested against them)
        # stable-baselines3: tests/test_a2c_vs_sb3.py checks msrl's A2C update against SB3's
        # envpool: env.engine=envpool is tested (tests/test_config.py, the engine tests)
        # hypothesis: the codec's and the gRPC transport's fuzz tests
        # pytest-xdist: the suite runs in two worker processes (pytest.ini)
        "test": ["pytest>=7", "pytest-xdist>=3.5", "ruff==0.17.6", "stable-baselines3>=2.3", "cupy-cuda12x>=13",
                 "gymnasium[mujoco]>=1.1", "mjbatch>=0.1.4", "mujoco-warp==3.14.0", "ale-py>=0.10",
                 "opencv-python-headless>=4.8", "pettingzoo>=1.24", "mpe2>=0.0.1",
                 "envpool>=1.0", "hypothesis>=6.100", "minari[create,hdf5]>=0.5.4",
                 "open_spiel>=1.5"],
        # envpool: the env engine's peer in bench/bench_mujoco_envs.py
        "bench": ["stable-baselines3>=2.3", "envpool>=1.0", "scipy>=1.10"],
        # MuJoCo tasks (HalfCheetah-v5, ...) through the env engine, and the native batched ones
        # (mujoco-warp: their physics on the GPU, env.kwargs.physics=warp; pinned to the MuJoCo
        # release mjbatch pins, 3.14.0)
        "mujoco": ["gymnasium[mujoco]>=1.1", "mjbatch>=0.1.4", "mujoco-warp==3.14.0"],
        # offline RL: msrl collect writes Minari datasets, offline algorithms read them
        "offline": ["minari[create,hdf5]>=0.5.4"],
        # OpenSpiel's board games (openspiel/<game>: AlphaZero's self-play, MCTS and solver opponents)
        "games": ["open_spiel>=1.5"],
        # PettingZoo parallel envs (pettingzoo/<module>), MPE's among them
        "pettingzoo": ["pettingzoo>=1.24", "mpe2>=0.0.1"],
        # ALE games (ALE/Pong-v5, ...) with the atari preprocessing wrapper
        "atari": ["ale-py>=0.10", "opencv-python-headless>=4.8"],
        # the GPU build of native envs (CuPy + the CUDA headers NVRTC needs; CUDA 12 drivers)
        "gpu": ["cupy-cuda12x[ctk]>=13"],
        # RLlib, the peer of bench/bench_rllib.py (pins gymnasium 1.2.x: kept out of "bench")
        "rllib": ["ray[rllib]>=2.40"],
    },
    entry_points={"console_scripts": ["msrl=msrl.run.cli:main"]},
)
