# Sourced by the command-line tests: expect() and its counts.
failures=0
passes=0

# expect CODE PATTERN -- COMMAND...: runs COMMAND, checks its exit code and that its output
# (stdout and stderr together) matches PATTERN.
expect() {
  local code="$1" pattern="$2"
  shift 3
  local output status
  output=$("$@" 2>&1)
  status=$?
  if [[ $status -ne $code ]] || ! grep -qE -- "$pattern" <<<"$output"; then
    echo "FAIL: $* -> exit $status (want $code), output lacks /$pattern/ or differs:"
    sed 's/^/    /' <<<"$output" | tail -n 15
    failures=$((failures + 1))
  else
    echo "ok:   $*"
    passes=$((passes + 1))
  fi
}
