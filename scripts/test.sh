#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suites, the command line, the GPU suites (which
# skip, each with its reason, without a GPU), the PyTorch front end's pytest suites (the CUDA
# ones skip without GPUs) and the benchmark baselines' (bench/baselines: the torch layers mok is
# timed against, checked on the CPU). Ends with ctest's and pytest's summaries, every skipped test with its
# reason, and the totals over both alone on the last line: "N passed, N failed, N skipped".
#
# Python: a python3 (or $MOK_PYTHON) that imports torch and pytest is used as it is; otherwise
# torch (the PyPI wheel, which runs on the CPU), pytest, transformers ($transformers_requirement,
# for mok.integrations.transformers' tests) and accelerate (which transformers loads a model under
# its expert parallelism with) are installed from PyPI into a virtual environment,
# $MOK_PYTHON_ENV (default: python-env in the build folder; about 4 GB, under two minutes where
# PyPI is fast). If that install fails, the command fails; where there is no network,
# MOK_SKIP_PYTHON=1 leaves the Python tests out, and the summary says so. An existing environment
# without transformers or accelerate gets them installed; if that fails, their tests skip with the
# reason. The transformers integration's tests then run a second time on the oldest transformers
# mok supports (the floor of $transformers_requirement, installed into the build folder).
set -euo pipefail
start_seconds=$SECONDS
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${MOK_BUILD_DIR:-$root/build}
mkdir -p "$build_dir"
build_dir=$(cd "$build_dir" && pwd)
export MOK_BUILD_DIR=$build_dir
"$root/scripts/bootstrap.sh"

# ---- a python that imports torch and pytest -----------------------------------------------------
python=""
python_skip_reason=""
transformers_requirement="transformers>=5.17,<6"
# accelerate: transformers loads a model under its own expert parallelism through it (the EP tests).
extra_requirements=(accelerate)
if [[ ${MOK_SKIP_PYTHON:-0} == 1 ]]; then
  python_skip_reason="MOK_SKIP_PYTHON=1"
  echo "python tests: left out ($python_skip_reason)"
else
  base_python=${MOK_PYTHON:-python3}
  python_env=${MOK_PYTHON_ENV:-$build_dir/python-env}
  if "$base_python" -c "import torch, pytest" 2>/dev/null; then
    python=$("$base_python" -c "import sys; print(sys.executable)")
  elif [[ -x $python_env/bin/python ]] && "$python_env/bin/python" -c "import torch, pytest" 2>/dev/null; then
    python=$python_env/bin/python
    if ! "$python" -c "import transformers, accelerate" 2>/dev/null; then
      echo "python tests: installing $transformers_requirement ${extra_requirements[*]} from PyPI into $python_env"
      "$python" -m pip install --quiet --progress-bar off "$transformers_requirement" "${extra_requirements[@]}" ||
        echo "python tests: transformers could not be installed; its tests will skip"
    fi
  else
    echo "python tests: $base_python does not import torch and pytest; installing them from PyPI into $python_env"
    install_start=$SECONDS
    if "$base_python" -m venv "$python_env" &&
      "$python_env/bin/python" -m pip install --quiet --progress-bar off torch pytest numpy \
        "$transformers_requirement" "${extra_requirements[@]}" &&
      "$python_env/bin/python" -c "import torch, pytest"; then
      python=$python_env/bin/python
      echo "python tests: installed torch $("$python" -c "import torch; print(torch.__version__)") in $((SECONDS - install_start)) s"
    else
      {
        echo "=================================================================================="
        echo "FAILED: torch and pytest could not be installed from PyPI into $python_env"
        echo "(network?). The Python tests cannot run, so the test command fails."
        echo "Without network, set MOK_SKIP_PYTHON=1 to leave them out."
        echo "=================================================================================="
      } >&2
      exit 1
    fi
  fi
fi

if [[ -n $python ]]; then
  export MOK_CMAKE_ARGS="${MOK_CMAKE_ARGS:-} -DMOK_BUILD_TORCH=ON -DPython3_EXECUTABLE=$python"
else
  export MOK_CMAKE_ARGS="${MOK_CMAKE_ARGS:-} -DMOK_BUILD_TORCH=OFF"
fi
"$root/scripts/build.sh"

# ---- ctest --------------------------------------------------------------------------------------
ctest_log=$build_dir/ctest.log
ctest_xml=$build_dir/ctest-junit.xml
rm -f "$ctest_xml"
ctest_status=0
(cd "$build_dir" && ctest --output-on-failure -j "$(nproc)" --output-junit "$ctest_xml") 2>&1 |
  tee "$ctest_log" || ctest_status=$?

# ---- pytest -------------------------------------------------------------------------------------
pytest_log=$build_dir/pytest.log
pytest_xml=$build_dir/pytest-junit.xml
rm -f "$pytest_xml"
pytest_status=0
if [[ -n $python ]]; then
  (cd "$root" && MOK_TORCH_LIBRARY="$build_dir/_mok_torch.so" PYTHONPATH="$root/python" \
    timeout "${MOK_PYTEST_TIMEOUT:-900}" "$python" -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$pytest_xml" python/tests bench/baselines) 2>&1 |
    tee "$pytest_log" || pytest_status=$?
fi

# ---- the transformers integration on the oldest transformers mok supports -----------------------
# The floor of $transformers_requirement, the GPU machine's release: its experts code differs from
# the newest's (5.17's eager loop refuses the expert-parallel sentinel id that 5.25's takes), so the
# integration's tests run on both. Installed once into the build folder; without network they are
# left out, with the reason.
floor_version=${transformers_requirement#*>=}
floor_version=${floor_version%%,*}
floor_xml=$build_dir/pytest-transformers-floor-junit.xml
floor_status=0
floor_ran=""
rm -f "$floor_xml"
if [[ -n $python ]]; then
  floor_dir=$build_dir/transformers-$floor_version
  if [[ ! -d $floor_dir/transformers ]] &&
    ! "$python" -m pip install --quiet --progress-bar off --target "$floor_dir" \
      "transformers==$floor_version"; then
    rm -rf "$floor_dir"
  fi
  if PYTHONPATH="$floor_dir" "$python" -c \
    "import sys, transformers; sys.exit(not (transformers.__version__ + '.').startswith('$floor_version.'))" \
    2>/dev/null; then
    floor_ran=ran
    (cd "$root" && MOK_TORCH_LIBRARY="$build_dir/_mok_torch.so" PYTHONPATH="$floor_dir:$root/python" \
      timeout "${MOK_PYTEST_TIMEOUT:-900}" "$python" -m pytest -q -rs -p no:cacheprovider \
      --junitxml="$floor_xml" python/tests/test_transformers_experts.py \
      python/tests/test_transformers_expert_parallel.py) 2>&1 |
      tee "$build_dir/pytest-transformers-floor.log" || floor_status=$?
  else
    echo "transformers $floor_version could not be installed: the integration's run on it is left out"
  fi
fi

# ---- summary ------------------------------------------------------------------------------------
echo
echo "==================================== summary ===================================="
echo "== ctest"
sed -n '/tests passed, .* tests failed out of/,$p' "$ctest_log"
echo "== pytest"
if [[ -n $python ]]; then
  if grep -q "short test summary info" "$pytest_log"; then
    sed -n '/short test summary info/,$p' "$pytest_log"
  else
    tail -n 1 "$pytest_log"
  fi
  ((pytest_status == 5)) && echo "pytest collected no test (exit 5): counted as a failure"
  if [[ -n $floor_ran ]]; then
    echo "== pytest, the transformers integration on transformers $floor_version"
    tail -n 1 "$build_dir/pytest-transformers-floor.log"
  fi
else
  echo "python tests: skipped ($python_skip_reason)"
fi
echo "== test command: $((SECONDS - start_seconds)) s"
# Counts from the JUnit files of both runners; a GoogleTest skip's reason is the text between its
# "Skipped" line and its "[  SKIPPED ]" line.
python3 - "$ctest_xml" "$ctest_status" "$pytest_xml" "$pytest_status" "${python:+ran}" \
  "$floor_xml" "$floor_status" "$floor_ran" "$floor_version" <<'PYTHON'
import collections
import re
import sys
import textwrap
import xml.etree.ElementTree as ElementTree

ctest_xml, ctest_status, pytest_xml, pytest_status, pytest_ran = sys.argv[1:6]
floor_xml, floor_status, floor_ran, floor_version = sys.argv[6:10]
counts = collections.Counter()
skip_reasons = collections.defaultdict(list)  # reason -> test names


def gtest_skip_reason(output):
    match = re.search(r": Skipped\n(.*?)\n?\[  SKIPPED \]", output or "", re.S)
    return match.group(1).strip() if match and match.group(1).strip() else "(no reason given)"


def test_name(case, runner):
    if runner.startswith("pytest"):  # module::test[parameters]
        return case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name")
    return case.get("name").split("  # GetParam()")[0]  # Suite.Test or Instance/Suite.Test/parameters


def read(path, runner, status):
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        root = None
    failed_before = counts["failed"]
    for case in root.iter("testcase") if root is not None else ():
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skipped = case.find("skipped")
            reason = skipped.get("message", "")
            if runner == "ctest" or not reason:
                reason = gtest_skip_reason(case.findtext("system-out"))
            skip_reasons[f"{runner}: {reason}"].append(test_name(case, runner))
        else:
            counts["passed"] += 1
    if status != "0" and counts["failed"] == failed_before:
        print(f"{runner} exited {status} with no failed test in {path}: counted as one failure")
        counts["failed"] += 1


read(ctest_xml, "ctest", ctest_status)
if pytest_ran:
    read(pytest_xml, "pytest", pytest_status)
if floor_ran:
    read(floor_xml, f"pytest (transformers {floor_version})", floor_status)
if skip_reasons:
    print("== skipped, and why")
    for reason, names in sorted(skip_reasons.items(), key=lambda item: -len(item[1])):
        print(f"{len(names)} x {reason}")
        print(textwrap.fill(", ".join(names), width=100, initial_indent="    ",
                            subsequent_indent="    ", break_long_words=False,
                            break_on_hyphens=False))
print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
sys.exit(1 if counts["failed"] else 0)
PYTHON
