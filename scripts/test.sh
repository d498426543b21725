#!/usr/bin/env bash
# Runs the tests of the packages given (go package patterns, as `go test` takes them) in two
# streams at once, each one package at a time:
#   - the broker adapters that talk to no database server (RabbitMQ, NATS, Redis, Kafka, the
#     in-memory broker and the SQLite queue);
#   - every other package. Those share PostgreSQL (300 connections, scripts/services.sh), and
#     two of them at once would overload it (the conformance matrix, the SQL queues' tests and
#     verify's runs each hold 45 to 75 connections at their peak), so they take turns.
# The other packages' output comes as it goes, the broker adapters' once their stream ends; the
# exit status is a failure if either stream failed.
# Usage: scripts/test.sh [go test flags --] packages...   GO selects the go command.
set -euo pipefail
GO=${GO:-go}

flags=()
if [[ " $* " == *" -- "* ]]; then
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
fi

pkgs=$("$GO" list "$@")
brokers=()
others=()
while read -r pkg; do
  case "$pkg" in
  */broker/amqp | */broker/nats | */broker/redis | */broker/kafka | */broker/mem | */broker/sqlitequeue)
    brokers+=("$pkg") ;;
  *) others+=("$pkg") ;;
  esac
done <<<"$pkgs"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() { # packages...
  [ $# -gt 0 ] || return 0
  "$GO" test -count=1 -p 1 "${flags[@]}" "$@"
}

run "${brokers[@]}" >"$out/brokers" 2>&1 &
brokers_pid=$!
others_status=0
run "${others[@]}" || others_status=$?
brokers_status=0
wait "$brokers_pid" || brokers_status=$?
cat "$out/brokers"
if [ "$brokers_status" -ne 0 ] || [ "$others_status" -ne 0 ]; then
  echo "FAIL: tests of the broker adapters exited $brokers_status, the others $others_status" >&2
  exit 1
fi
