#!/usr/bin/env bash
# Formats the C++/CUDA sources with clang-format and the style in .clang-format, or (--check)
# only reports the files that are not formatted: exit 1 if any, 77 if clang-format is missing
# (ctest's "format" test counts that as skipped).
#
#   scripts/format.sh            format every tracked source in place
#   scripts/format.sh --check    list the unformatted files; change nothing
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if ! command -v clang-format >/dev/null; then
  echo "format: clang-format not found (apt-get install clang-format)"
  exit 77
fi
mapfile -t files < <(git ls-files 'src/*.cpp' 'src/*.hpp' 'src/*.cu' 'src/*.cuh' 'include/*.hpp' \
  'tools/*.cpp' 'tools/*.hpp' 'bench/*.cu' 'bench/*.hpp' 'tests/*.cpp' 'tests/*.hpp' 'tests/*.cu' \
  'tests/*.cuh')
if [[ ${1:-} == --check ]]; then
  unformatted=()
  for file in "${files[@]}"; do
    if ! clang-format --dry-run --Werror "$file" >/dev/null 2>&1; then unformatted+=("$file"); fi
  done
  if ((${#unformatted[@]})); then
    echo "format: ${#unformatted[@]} of ${#files[@]} files differ from .clang-format" \
      "(scripts/format.sh fixes them):"
    printf '  %s\n' "${unformatted[@]}"
    exit 1
  fi
  echo "format: all ${#files[@]} files follow .clang-format ($(clang-format --version))"
else
  clang-format -i "${files[@]}"
  echo "format: ${#files[@]} files formatted"
fi
