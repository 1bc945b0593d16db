#!/usr/bin/env bash
# The main job: build the mok program and run it. With no arguments: the tiny preset forward +
# backward on the best backend built for this machine, checked against the fp64 oracle.
# Any arguments go to `mok` (default: `run`); e.g. scripts/run.sh run --ep 4 --routing skewed:1.5
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/build.sh" mok >/dev/null
exec "${MOK_BUILD_DIR:-$root/build}/mok" "${@:-run}"
