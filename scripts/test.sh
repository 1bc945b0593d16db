#!/usr/bin/env bash
# Builds everything and runs every test: CPU tests, the command line, and the GPU tests (which
# skip, each with its reason, on a machine without a GPU).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/build.sh"
cd "${MOK_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "$(nproc)"
