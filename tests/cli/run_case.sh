#!/bin/sh
# Runs one row of tests/cli/cases.txt: its command in a fresh directory under the current one, with
# `locks` the binary under test and $src the source tree; standard output and error as one stream,
# then "exit=<status>". ctest matches the row's expressions against this output; an exit status other
# than the row's adds the line that the case's FAIL_REGULAR_EXPRESSION catches.
# Usage: run_case.sh LOCKS SOURCE_DIR EXIT_STATUS COMMAND
bin=$1 src=$2 want=$3 cmd=$4
exec 2>&1
dir=$(mktemp -d "$PWD/cli-case.XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
locks() { "$bin" "$@"; }
eval "$cmd"
status=$?
echo "exit=$status"
[ "$status" = "$want" ] || echo "run_case.sh: exit status $status, expected $want"
