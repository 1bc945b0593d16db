#!/usr/bin/env bash
# Lints the tree: shellcheck over every shell script, ruff (pyproject.toml's [tool.ruff]) over every
# Python file. Prints each finding, one a line, then a summary line; exits 1 on any finding. The
# test command runs it (ctest's "lint" test).
#
#   scripts/lint.sh [BUILD_DIR]
#
# ruff: version $ruff_version below, from PyPI, in the virtual environment scripts/test.sh uses for
# the Python tests ($MOK_PYTHON_ENV, default python-env in BUILD_DIR, else $MOK_BUILD_DIR, else
# build/), created when missing. shellcheck: installed with apt-get when missing. A linter that
# cannot be installed fails the check, except with MOK_SKIP_PYTHON=1 (no network: see
# scripts/test.sh), where it is skipped with the reason and the exit status is 77 (ctest: skipped).
set -uo pipefail
start_seconds=$SECONDS
ruff_version=0.17.5
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${1:-${MOK_BUILD_DIR:-$root/build}}
python_env=${MOK_PYTHON_ENV:-$build_dir/python-env}
cd "$root" || exit 1

skipped=()  # the reasons a linter did not run
findings=0
summary=()

# lint NAME COMMAND...: runs a linter that prints a finding a line on stdout; adds them to findings
# and sets count. A linter that fails without a finding (bad options, bad config) counts as one.
lint() {
  local name=$1 output status
  shift
  output=$("$@")
  status=$?
  count=$(grep -c . <<<"$output")
  [[ -n $output ]] && echo "$output"
  if ((status != 0 && count == 0)); then
    echo "lint: $name exited $status with no finding"
    count=1
  fi
  findings=$((findings + count))
}

# ---- shellcheck ---------------------------------------------------------------------------------
if ! command -v shellcheck >/dev/null; then
  echo "lint: shellcheck is missing: installing it with apt-get"
  sudo=()
  [[ $(id -u) -ne 0 ]] && sudo=(sudo)
  { "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends shellcheck; } >/dev/null 2>&1
fi
# The scripts: every *.sh outside hidden and build folders, and the CI entry point.
mapfile -t scripts < <({ find . -path './.*' -prune -o -path './build*' -prune -o -name '*.sh' -print
                         echo ./.ci/run; } | sed 's|^\./||' | sort)
if command -v shellcheck >/dev/null; then
  # -x follows `source`; the sourcing scripts name what they source (shellcheck source=...).
  lint shellcheck shellcheck -x -f gcc "${scripts[@]}"
  version=$(shellcheck --version | sed -n 's/^version: //p')
  summary+=("shellcheck $version: $count findings in ${#scripts[@]} scripts")
else
  skipped+=("shellcheck is missing and apt-get could not install it")
fi

# ---- ruff ---------------------------------------------------------------------------------------
ruff=$python_env/bin/ruff
if [[ $("$ruff" --version 2>/dev/null) != "ruff $ruff_version" ]]; then
  echo "lint: installing ruff $ruff_version from PyPI into $python_env"
  { [[ -x $python_env/bin/python ]] || "${MOK_PYTHON:-python3}" -m venv "$python_env"; } &&
    "$python_env/bin/python" -m pip install --quiet --progress-bar off "ruff==$ruff_version" >/dev/null
fi
if [[ $("$ruff" --version 2>/dev/null) == "ruff $ruff_version" ]]; then
  # Every Python file but those pyproject.toml, .gitignore and ruff's defaults exclude.
  python_files=$("$ruff" check --no-cache --show-files . 2>/dev/null | grep -c '\.py$')
  lint ruff "$ruff" check --no-cache --quiet --output-format concise .
  summary+=("ruff $ruff_version: $count findings in $python_files Python files")
else
  skipped+=("ruff $ruff_version could not be installed from PyPI into $python_env")
fi

# ---- summary: one line ------------------------------------------------------------------------
details=""
((${#summary[@]})) && printf -v details '%s; ' "${summary[@]}"
((${#skipped[@]})) && printf -v details '%snot run: %s; ' "$details" "${skipped[@]}"
details="(${details%; }), $((SECONDS - start_seconds)) s"
if ((findings)); then
  echo "lint: FAILED, $findings findings $details"
  exit 1
elif ((${#skipped[@]})) && [[ ${MOK_SKIP_PYTHON:-0} == 1 ]]; then
  echo "lint: skipped in part $details"
  # The shape scripts/test.sh reads a skip's reason from (a GoogleTest skip's).
  printf 'lint: Skipped\n'
  printf '%s (MOK_SKIP_PYTHON=1)\n' "${skipped[@]}"
  printf '[  SKIPPED ] lint\n'
  exit 77
elif ((${#skipped[@]})); then
  echo "lint: FAILED, a linter could not be installed (no network? MOK_SKIP_PYTHON=1 skips) $details"
  exit 1
fi
echo "lint: clean $details"
