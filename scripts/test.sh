#!/usr/bin/env bash
# Vets and tests the packages given (go package patterns, as `go test` takes them) in two
# streams at once, each one package at a time:
#   - the packages whose tests load the database servers: the conformance matrix, the SQL
#     queues, verify's and the ordering test's consumer processes, the router's and the
#     stores' tests. They share PostgreSQL (300 connections, scripts/services.sh) and the two
#     cores, and two of them at once would overload it (each holds 45 to 75 connections at its
#     peak), so they take turns;
#   - go vet, then every other package: the broker adapters, which talk to no database
#     server, the packages without a service, the examples (a few connections each) and the
#     console's browser test.
# The first stream's output comes as it goes, the second's once it ends; the exit status is a
# failure if either failed.
# Usage: scripts/test.sh [go test flags --] packages...   GO selects the go command.
set -euo pipefail
GO=${GO:-go}

flags=()
if [[ " $* " == *" -- "* ]]; then
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
fi

mod=$("$GO" list -m | head -1)
pkgs=$("$GO" list "$@")
heavy=()
light=()
while read -r pkg; do
  case "${pkg#"$mod"}" in
  "" | /broker | /broker/sqlqueue | /cmd/onceflow | /conformance | /console | /dedup | \
    /internal/groupcommit | /internal/sqllock | /onceflowtest | /ordering | /outbox | /sqldb | \
    /sqldb/postgres | /bench/cmd/onceflow-bench)
    heavy+=("$pkg") ;;
  *) light+=("$pkg") ;;
  esac
done <<<"$pkgs"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() { # packages...
  [ $# -gt 0 ] || return 0
  "$GO" test -count=1 -p 1 "${flags[@]}" "$@"
}

(
  "$GO" vet "$@" && run "${light[@]}"
) >"$out/light" 2>&1 &
light_pid=$!
heavy_status=0
run "${heavy[@]}" || heavy_status=$?
light_status=0
wait "$light_pid" || light_status=$?
cat "$out/light"
if [ "$light_status" -ne 0 ] || [ "$heavy_status" -ne 0 ]; then
  echo "FAIL: go vet and the light packages exited $light_status, the packages that load the databases $heavy_status" >&2
  exit 1
fi
