#!/usr/bin/env bash
# Starts the loopback services the integration tests use, when they are installed and down:
# PostgreSQL 5432, MariaDB 3306, RabbitMQ 5672, NATS (JetStream) 4222, Redis 6379.
# Usage: scripts/services.sh [check|start]   (default: start)
set -u
mode=${1:-start}

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_up() { # port name
  for _ in $(seq 1 60); do up "$1" && return 0; sleep 1; done
  echo "services: $2 did not come up on 127.0.0.1:$1" >&2
  return 1
}

start() { # port name command...
  local port=$1 name=$2; shift 2
  if up "$port"; then echo "services: $name up on 127.0.0.1:$port"; return 0; fi
  if [ "$mode" = check ]; then echo "services: $name DOWN on 127.0.0.1:$port" >&2; return 1; fi
  echo "services: starting $name"
  "$@" >/dev/null 2>&1 || echo "services: could not start $name with: $*" >&2
  wait_up "$port" "$name"
}

# make test budgets its PostgreSQL connections for 100 (scripts/test.sh), yet its peak passes
# that at times (verify's consumer processes beside the other tests of their package): the
# server must allow 300, as docker-compose.yml sets. A local cluster that allows fewer is raised
# to 300 and restarted.
pg_connections() { # cluster
  local n
  n=$(psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SHOW max_connections' 2>/dev/null) || return 0
  [ "${n:-0}" -ge 300 ] && return 0
  if [ "$mode" = check ]; then echo "services: PostgreSQL allows $n connections; make test needs 300" >&2; return 1; fi
  echo "services: PostgreSQL allows $n connections; setting max_connections = 300 and restarting it"
  psql -h 127.0.0.1 -U postgres -d postgres -qc 'ALTER SYSTEM SET max_connections = 300' &&
    pg_ctlcluster --skip-systemctl-redirect "$1" main restart >/dev/null 2>&1 && wait_up 5432 PostgreSQL
}

# make test-conformance-full runs every broker x database pair at once: its peak on MariaDB is
# 130 to 155 connections, around MariaDB's default limit of 151. The server must allow 300, as
# docker-compose.yml sets; a running server that allows fewer is raised, which needs no restart.
mariadb_connections() {
  local n
  n=$(mysql -h 127.0.0.1 -u root -N -e 'SELECT @@max_connections' 2>/dev/null) || return 0
  [ "${n:-0}" -ge 300 ] && return 0
  if [ "$mode" = check ]; then echo "services: MariaDB allows $n connections; the tests need 300" >&2; return 1; fi
  echo "services: MariaDB allows $n connections; setting max_connections = 300"
  mysql -h 127.0.0.1 -u root -e 'SET GLOBAL max_connections = 300'
}

status=0
if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  cluster=$(ls /etc/postgresql | head -1)
  start 5432 PostgreSQL pg_ctlcluster --skip-systemctl-redirect "$cluster" main start || status=1
  pg_connections "$cluster" || status=1
else
  up 5432 || { echo "services: PostgreSQL is not installed here" >&2; status=1; }
fi
if [ -x /usr/sbin/mariadbd ]; then
  start 3306 MariaDB start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || status=1
  mariadb_connections || status=1
else
  up 3306 || { echo "services: MariaDB is not installed here" >&2; status=1; }
fi
if command -v rabbitmq-server >/dev/null 2>&1; then
  start 5672 RabbitMQ rabbitmq-server -detached || status=1
else
  up 5672 || { echo "services: RabbitMQ is not installed here" >&2; status=1; }
fi
if [ -x /usr/sbin/nats-server ]; then
  start 4222 NATS start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log || status=1
else
  up 4222 || { echo "services: NATS is not installed here" >&2; status=1; }
fi
if command -v redis-server >/dev/null 2>&1; then
  start 6379 Redis redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || status=1
else
  up 6379 || { echo "services: Redis is not installed here" >&2; status=1; }
fi
exit $status
