#!/usr/bin/env bash
# The GPU check: what only a machine with a CUDA device can run, in one go, each part under its
# own timeout, a summary printed last.
#
#   bash bench/gpu_check.sh            # from the project root, on a machine with a CUDA GPU
#   bash bench/gpu_check.sh            # on a machine without one: the parts that need no GPU
#
# Installs msrl into a temporary folder first, so the machine's own Python (which must hold a CUDA
# build of torch) is untouched; on a machine without network access, put wheels of what it lacks
# into .whl/ first (`pip download --no-deps --only-binary=:all: -d .whl gymnasium tensordict
# pydantic ...`, for that machine's Python version; `bash bench/gpu_wheels.sh` makes it): they are
# installed from there, and from the parts of a larger bundle in PARTS (bench/gpu_wheels.sh --mujoco).
# Writes each part's log into $OUT (default: a temporary folder); with ARCHIVE=FILE also a .tar.gz
# of them, remade after each part (for a results channel that takes only a few files).
#
# Parts: the cross-device boundary tests (learner on cuda:0, actors on the CPU, under coarse,
# overlapped coarse, async_learner and single_learner_fine; multi_learner's all-reduce of CUDA
# gradients); the native envs' GPU kernels (CartPole, Pendulum, Tag) against their host build and
# the gpu_only tests (these three side by side on a GPU, the benchmarks after them alone); the
# capture tests (tests/test_capture.py: CUDA graphs on a GPU, the host tape on a CPU) and the
# eager-against-captured table (bench/bench_capture.py); the README's GPU job
# (configs/ppo_cartpole_gpu_only.yaml) trained to the end, captured (the default on CUDA) and, on
# a GPU, eager, its time split into steady iterations and the rest, and its first iterations
# profiled (bench/bench_first_iterations.py); the same eager / captured / compiled (torch.compile
# of the components' compile targets, alone and inside the capture) with kernels per iteration,
# the GPU job trained compiled, and the compile tests; with FULL=1 also the
# heterogeneous run (PPO CartPole, coarse, learner on cuda:0) to the end; with PONG=1 PPO on Pong
# with its learner on cuda:0 for PONG_S seconds (bench/bench_pong_learning.py); with MUJOCO=1
# HalfCheetah on MJWarp's kernels against gymnasium and PPO on it at 4,096 envs; with ALGOS=1
# AlphaZero's search with a 64x3 tower evaluating on cuda against the host, the Connect Four config
# trained on cuda:0, and DreamerV3's updates on cuda:0 (Pong from pixels, CartPole); the host-sync guard
# and each gpu_only job's ops per iteration (bench/bench_host_syncs.py). Without a GPU (no
# nvidia-smi, or torch without CUDA) the same script runs what needs none: the host-sync guard,
# the kernels' host build against their torch reference, the ops count and the GPU job on the CPU.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
T=$(mktemp -d)
py=${PYTHON:-python3}
W=${WHEELS:-.whl}  # wheels for this machine's Python (WHEELS=none: install none, the Python has them)
if ls "$W"/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target "$T/site" "$W"/*.whl || exit 1
fi
PARTS=${PARTS:-}  # a folder of wheels.tar.NN parts brought over several calls (bench/gpu_wheels.sh --mujoco)
if [ -n "$PARTS" ]; then
  mkdir -p "$T/joined"
  cat "$PARTS"/wheels.tar.[0-9][0-9] > "$T/wheels.tar" || exit 1
  if [ -f "$PARTS/wheels.tar.sha256" ] && [ "$(sha256sum "$T/wheels.tar" | cut -d' ' -f1)" != "$(cat "$PARTS/wheels.tar.sha256")" ]; then
    echo "the wheel parts in $PARTS do not join into the tar bench/gpu_wheels.sh made (a part missing or damaged)" >&2
    exit 1
  fi
  tar -xf "$T/wheels.tar" -C "$T/joined" && rm -f "$T/wheels.tar" || exit 1
  $py -m pip install -q --no-index --no-deps --no-compile --target "$T/site" "$T/joined"/*.whl || exit 1
fi
$py -m pip install -q --no-index --no-deps --no-build-isolation --target "$T/msrl" . || exit 1
export PYTHONPATH="$T/msrl:$T/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$T/msrl/bin:$PATH"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
if $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then GPU=1; else GPU=0; fi
[ "$GPU" = 1 ] || echo "no CUDA device: the parts that need none (CPU mode)"

mkdir -p "$T/rc"
ARCHIVE=${ARCHIVE:-}  # also keep a .tar.gz of $OUT there, remade after each part (a results channel that takes few files)
ONLY=${ONLY:-}  # a space-separated list of parts to run (default: all), e.g. ONLY="compile_bench compile_tests"
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local code=$?
  echo "$code" >"$T/rc/$name"
  { tail -n 12 "$OUT/$name.log"; echo "== $name: exit $code in $((SECONDS - t0)) s"; } >"$T/rc/$name.tail"
  cat "$T/rc/$name.tail"
  if [ -n "$ARCHIVE" ]; then tar -czf "$ARCHIVE.$name.tmp" -C "$OUT" . && mv -f "$ARCHIVE.$name.tmp" "$ARCHIVE"; fi
}
# the tests run side by side on a GPU (16 cores there; their figures are not timings); the
# benchmarks after them, one at a time, on an otherwise idle GPU
together() {  # together NAME SECONDS COMMAND... (started now, waited for by `wait`)
  part "$@" >/dev/null &
}
# the repository's pytest.ini options but its worker processes (pytest-xdist is not among the
# wheels; the parts below already run side by side)
PYTEST=($py -P -m pytest -q -o addopts= -m "not slow" -p no:cacheprovider -o faulthandler_timeout=100)
if $py -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=150); fi  # a hung test fails alone

# -P: the checkout's own msrl/ folder must not shadow the installed package
if [ "$GPU" = 1 ]; then
  together devices 200 "${PYTEST[@]}" -m "slow or not slow" tests/test_devices.py -k "not reaches_475" \
    tests/test_population.py::test_a_member_on_the_cpu_takes_the_learner_of_a_member_on_a_gpu
  together native_kernels 200 "${PYTEST[@]}" tests/test_native_envs.py tests/test_native_tag.py tests/test_gpu_only.py
  together capture 200 "${PYTEST[@]}" tests/test_capture.py
  together host_syncs 120 $py -P bench/bench_host_syncs.py --json "$OUT/host_syncs.json"
  wait
  for k in devices native_kernels capture host_syncs; do echo "== $k"; cat "$T/rc/$k.tail"; done
else
  part native_kernels 240 "${PYTEST[@]}" tests/test_native_envs.py tests/test_native_tag.py tests/test_gpu_only.py
  part capture 240 "${PYTEST[@]}" tests/test_capture.py
  part host_syncs 120 $py -P bench/bench_host_syncs.py --json "$OUT/host_syncs.json"
fi
if [ "$GPU" = 1 ]; then  # eager against captured iterations: ms, launches, GPU busy (issue 33's figures)
  part capture_bench 200 $py -P bench/bench_capture.py --jobs cartpole,pendulum --envs 16,4096 --json "$OUT/capture.json" --profiles "$OUT/profiles.txt"
else
  part capture_bench 240 $py -P bench/bench_capture.py --jobs cartpole --envs 16 --iterations 5 --json "$OUT/capture.json"
fi
part gpu_only_job 240 msrl train configs/ppo_cartpole_gpu_only.yaml "runs_dir=$T/runs" train.progress=false
# each iteration's training time (time_s): where a run's seconds go beyond its steady iterations
cp "$T/runs/ppo_cartpole_gpu_only/metrics.csv" "$OUT/gpu_only_job_metrics.csv" 2>/dev/null
part gpu_only_job_time 60 $py -P bench/time_breakdown.py "$T/runs/ppo_cartpole_gpu_only" --json "$OUT/gpu_only_job_time.json"
if [ "$GPU" = 1 ]; then  # the first iterations (warm-up, probe, capture) profiled, and the capture's stages timed
  part first_iterations 90 $py -P bench/bench_first_iterations.py
fi
# this host's own work per replayed iteration (the replay excluded): against the GPU's per-iteration time
part replay_host 90 $py -P bench/bench_replay_host.py --iterations 1000 --repeats 1
if [ "$GPU" = 1 ]; then  # Tag in the shape of the WarpDrive figure; the GPU job op by op (what the capture gains end to end)
  part capture_bench_tag 150 $py -P bench/bench_capture.py --jobs tag110 --envs 100 --iterations 3 --json "$OUT/capture_tag.json" --profiles "$OUT/profiles_tag.txt"
  # the same captured with TF32 matrix products (train.float32_matmul_precision=high, an opt-in)
  part capture_bench_tag_tf32 90 $py -P bench/bench_capture.py --jobs tag110_tf32 --envs 100 --iterations 3 --modes graph \
    --json "$OUT/capture_tag_tf32.json"
  part gpu_only_job_eager 120 msrl train configs/ppo_cartpole_gpu_only.yaml "runs_dir=$T/runs" train.progress=false \
    distribution_policy.capture.main=eager
fi
# torch.compile (distribution_policy.compile.main=inductor): the GPU job's iteration eager, captured,
# compiled and compiled inside the capture (ms, kernels launched and run, GPU busy); Tag in
# WarpDrive's shape captured and compiled; the GPU job trained to the end compiled and captured;
# the compile tests (compiled equals eager to float tolerance, captured on a GPU)
if [ "$GPU" = 1 ]; then
  part compile_bench 240 $py -P bench/bench_capture.py --jobs cartpole --envs 16,4096 --modes eager,graph,compiled,compiled_eager \
    --json "$OUT/compile.json" --profiles "$OUT/profiles_compile.txt"
  part compile_bench_tag 200 $py -P bench/bench_capture.py --jobs tag110 --envs 100 --iterations 3 --modes graph,compiled \
    --json "$OUT/compile_tag.json"
else
  part compile_bench 400 $py -P bench/bench_capture.py --jobs cartpole --envs 16 --iterations 5 \
    --modes eager,compiled_eager --json "$OUT/compile.json"
fi
if [ "$GPU" = 1 ]; then  # (on the CPU the suite runs the tests; the job would train compiled for minutes)
  part gpu_only_job_compiled 240 msrl train configs/ppo_cartpole_gpu_only.yaml "runs_dir=$T/runs_compiled" \
    train.progress=false distribution_policy.compile.main=inductor
  part gpu_only_job_compiled_time 60 $py -P bench/time_breakdown.py "$T/runs_compiled/ppo_cartpole_gpu_only" \
    --json "$OUT/gpu_only_job_compiled_time.json"
  part compile_tests 400 "${PYTEST[@]}" tests/test_compile.py
fi
if [ "${PONG:-0}" = 1 ] && [ "$GPU" = 1 ]; then  # Pong: actors on the CPU (ale-py's vector env), the learner on cuda:0,
  # for PONG_S seconds (default 480): env steps per second and the return reached (issue 49's GPU part)
  PONG_S=${PONG_S:-480}
  part pong_cuda_learner $((PONG_S + 180)) $py -P bench/bench_pong_learning.py --runs-dir "$T/pong" --out "$OUT" \
    --hours "$($py -c "print($PONG_S / 3600)")" distribution_policy.name=single_learner_coarse runtime=local \
    distribution_policy.devices.learner=cuda:0 env.num_envs=64 env.num_workers=8 train.torch_threads=4
  cp "$T/pong/ppo_pong/metrics.csv" "$OUT/pong_cuda_learner_metrics.csv" 2>/dev/null
fi
if [ "${MUJOCO:-0}" = 1 ] && [ "$GPU" = 1 ]; then  # MuJoCo on MJWarp's kernels on the GPU (env.kwargs.physics=warp):
  # each step against gymnasium's from the same state, then PPO at 4,096 envs under gpu_only (env steps/s,
  # the return reached); needs warp-lang and mujoco-warp importable: their wheels (~150 MB) exceed one
  # call's 64 MiB, so they come in parts over several calls (bench/gpu_wheels.sh --mujoco, PARTS=)
  part mujoco_warp_check 400 $py -P -m msrl.envs.native.check --env halfcheetah --physics warp --device cuda \
    --num-envs 64 --steps 200 --start-step 900
  part mujoco_warp_ppo 600 msrl train configs/ppo_halfcheetah_gpu.yaml "runs_dir=$T/runs" train.progress=false \
    train.total_env_steps=20000000
  cp "$T/runs/ppo_halfcheetah_gpu/metrics.csv" "$OUT/mujoco_warp_ppo_metrics.csv" 2>/dev/null
  part mujoco_warp_ppo_time 60 $py -P bench/time_breakdown.py "$T/runs/ppo_halfcheetah_gpu" --json "$OUT/mujoco_warp_ppo_time.json"
fi
if [ "${ALGOS:-0}" = 1 ] && [ "$GPU" = 1 ]; then  # AlphaZero and DreamerV3 on a GPU (issue 71's GPU figures)
  # the Connect Four search (64 and 256 games, 100 simulations) with a 64x3 tower evaluating its
  # leaves on cuda, then on the host (one thread), float32 and bfloat16: microseconds a leaf
  part alphazero_search 300 bash -c "for d in cuda cpu; do for t in float32 bfloat16; do $py -P bench/bench_alphazero.py \
    search connect_four --games 64 256 --simulations 100 --rounds 3 --tower 64x3 --dtype \$t --device \$d || exit 1; done; done"
  # inference_dtype auto reads the device: an H100 (compute capability 9.0) computes bfloat16 natively
  part alphazero_native_bf16 60 $py -c "import sys; from msrl.device import native_bfloat16 as n; \
    print('cuda', n('cuda'), 'cpu', n('cpu')); sys.exit(0 if n('cuda') else 1)"
  # the Connect Four config (its 64x3 tower; inference_dtype auto: bfloat16 on cuda) trained on
  # cuda:0, the games and their search on the host: positions/s (metrics.csv's charts/SPS) and where
  # the seconds went
  part alphazero_train 300 msrl train configs/alphazero_connect_four.yaml "runs_dir=$T/runs" name=alphazero_cuda \
    distribution_policy.devices.main=cuda:0 train.total_env_steps=30720 train.progress=false
  cp "$T/runs/alphazero_cuda/metrics.csv" "$OUT/alphazero_train_metrics.csv" 2>/dev/null
  part alphazero_train_time 60 $py -P bench/time_breakdown.py "$T/runs/alphazero_cuda" --json "$OUT/alphazero_train_time.json"
  # DreamerV3 XS at RLlib's ratio (one update of 16 x 64 per env step) on cuda:0: seconds an update
  # while learning, from Pong's 64x64 frames (the figure the CPU's 7.98 s "belongs to a GPU") and CartPole
  part dreamerv3_pong 360 $py -P bench/bench_dreamerv3.py --env pong --budget 1300 --train-ratio 1024 --device cuda:0 \
    --json "$OUT/dreamerv3_pong_cuda.json"
  part dreamerv3_cartpole 300 $py -P bench/bench_dreamerv3.py --env cartpole --model-size XS --train-ratio 1024 \
    --budget 1500 --device cuda:0 --json "$OUT/dreamerv3_cartpole_cuda.json"
fi
if [ "${FULL:-0}" = 1 ] && [ "$GPU" = 1 ]; then  # the heterogeneous run to the end (about a minute on an H100)
  part coarse_cuda_learner 300 msrl train configs/ppo_cartpole.yaml distribution_policy.name=single_learner_coarse \
    runtime=local distribution_policy.devices.learner=cuda:0 "runs_dir=$T/runs" train.progress=false
fi

echo "== summary"
status=0
for f in "$T"/rc/*; do
  case $f in *.tail|"$T/rc/*") continue;; esac  # (no part ran: ONLY named none)
  code=$(cat "$f")
  echo "$(basename "$f"): exit $code"
  [ "$code" = 0 ] || status=1
done
exit $status
