#!/usr/bin/env bash
# Wheels for the GPU check on a machine without network access (Python 3.12, x86-64 Linux, torch,
# CuPy, grpcio, networkx, PyYAML, TensorBoard, matplotlib and tqdm already there), made here where
# pip reaches PyPI, pinned to the versions this checkout is tested with.
#
#   bash bench/gpu_wheels.sh            # .whl/: gymnasium, tensordict, pydantic, ale-py, OpenSpiel and their needs (~23 MB)
#   bash bench/gpu_wheels.sh --mujoco   # also MuJoCo, MuJoCo Warp and Warp (~190 MB in all)
#
# A machine that takes at most 64 MiB per call cannot take Warp's wheel (149 MB) at once: with
# --mujoco the wheels go into one tar, split into parts of PART_MB (default 50) MiB, one folder each
# (.whl.1/ ... .whl.K/). Each call but the last brings one folder and stashes it outside the
# checkout; the last brings the last part and runs the check, which joins them (PARTS=):
#
#   call k < K:  carry [".whl.k"]   command: mkdir -p /tmp/msrl_parts && cp .whl.k/* /tmp/msrl_parts/
#   call K:      carry [".whl.K"]   command: cp .whl.K/* /tmp/msrl_parts/ && PARTS=/tmp/msrl_parts WHEELS=none \
#                                            MUJOCO=1 ONLY="mujoco_warp_check mujoco_warp_ppo mujoco_warp_ppo_time" \
#                                            bash bench/gpu_check.sh
#
# (the machine must stay warm between the calls: make them one after the other). The folders are
# ignored by git (.gitignore: /.whl*/).
set -eu
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
PART_MB=${PART_MB:-50}
BASE=(gymnasium==1.4.0 farama-notifications==0.0.6 cloudpickle==3.1.3 tensordict==0.15.3 pyvers==0.2.3
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 google-crc32c==1.9.0 ale-py==0.12.1
      open_spiel==2.0.2 absl-py==2.5.1)  # (OpenSpiel's games and bots need absl-py of its requirements)
MUJOCO=(mujoco==3.14.0 mujoco-warp==3.14.0 warp-lang==1.19.0 etils==1.15.0 glfw==2.11.0
        pyopengl==3.1.10)
case "${1:-}" in
  "") wanted=("${BASE[@]}") ;;
  --mujoco) wanted=("${BASE[@]}" "${MUJOCO[@]}") ;;
  *) echo "usage: bash bench/gpu_wheels.sh [--mujoco]" >&2; exit 2 ;;
esac
download() {  # download DIR: the wanted wheels for that machine's Python, no dependencies (named above)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --abi "cp${PY_VERSION/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$1" "${wanted[@]}"
}
rm -rf .whl .whl.[0-9]*
if [ "${1:-}" = "" ]; then
  download .whl
  du -sh .whl
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download "$tmp/wheels"
tar -cf "$tmp/wheels.tar" -C "$tmp/wheels" .
split -b "${PART_MB}m" -d -a 2 "$tmp/wheels.tar" "$tmp/wheels.tar."
k=0
for part in "$tmp"/wheels.tar.[0-9][0-9]; do
  k=$((k + 1))
  mkdir -p ".whl.$k"
  mv "$part" ".whl.$k/"
done
sha256sum "$tmp/wheels.tar" | awk '{print $1}' > ".whl.$k/wheels.tar.sha256"
echo "$k parts of $(du -h "$tmp/wheels.tar" | cut -f1): .whl.1/ ... .whl.$k/ (bring them over $k calls, in order)"
