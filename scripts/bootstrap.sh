#!/usr/bin/env bash
# Installs the Debian packages mok builds and tests with, when they are missing: a C++20 compiler,
# CMake, Ninja, GoogleTest, and python3 with venv (scripts/test.sh installs torch and pytest from
# PyPI into a virtual environment when python3 lacks them). CUDA (nvcc, NCCL) is optional and never installed here: mok finds it under
# /usr/local/cuda when it is there and builds the CPU backend alone when it is not.
set -euo pipefail

missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v make >/dev/null || missing+=(make)
[[ -f /usr/include/gtest/gtest.h ]] || missing+=(libgtest-dev)
[[ -f /usr/include/gmock/gmock.h ]] || missing+=(libgmock-dev)
command -v python3 >/dev/null || missing+=(python3)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)

if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
