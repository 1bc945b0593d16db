# shellcheck shell=bash
# Sourced by the command-line tests: expect(), expect_error(), pass()/fail() and their counts.
failures=0
passes=0

pass() {
  echo "ok:   $*"
  passes=$((passes + 1))
}

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# indent: standard input, each line indented, under a FAIL line.
indent() { sed 's/^/    /'; }

# expect CODE PATTERN -- COMMAND...: runs COMMAND, checks its exit code and that its output
# (stdout and stderr together) matches PATTERN.
expect() {
  local code="$1" pattern="$2"
  shift 3
  local output status
  output=$("$@" 2>&1)
  status=$?
  if [[ $status -ne $code ]] || ! grep -qE -- "$pattern" <<<"$output"; then
    fail "$* -> exit $status (want $code), output lacks /$pattern/ or differs:"
    indent <<<"$output" | tail -n 15
  else
    pass "$*"
  fi
}

# expect_error PATTERN -- COMMAND...: a refused command line: exit status 2, nothing on stdout, and
# exactly one line on stderr, which matches PATTERN (anchor it to check the whole line).
expect_error() {
  local pattern="$1"
  shift 2
  local stdout stderr status err_file
  err_file=$(mktemp)
  stdout=$("$@" 2>"$err_file")
  status=$?
  stderr=$(<"$err_file")
  rm -f "$err_file"
  if [[ $status -ne 2 || -n "$stdout" ]] || [[ $(wc -l <<<"$stderr") -ne 1 ]] ||
     ! grep -qE -- "$pattern" <<<"$stderr"; then
    fail "$* -> exit $status (want 2), stdout '${stdout:0:80}', stderr (want one line /$pattern/):"
    indent <<<"$stderr" | tail -n 15
  else
    pass "$*"
  fi
}
