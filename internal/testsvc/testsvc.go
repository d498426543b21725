// Package testsvc gives tests the real services they run against: PostgreSQL, MariaDB/MySQL,
// RabbitMQ, NATS and Redis on loopback, and SQLite files in a temporary directory.
//
// A test that needs an unreachable service fails when the environment variable CI is "true",
// and is skipped with a message naming the service otherwise, so that a newcomer without the
// services can still run `make test`.
//
// Addresses default to the project's loopback services and can be overridden with
// ONCEFLOW_TEST_POSTGRES, ONCEFLOW_TEST_MYSQL, ONCEFLOW_TEST_AMQP, ONCEFLOW_TEST_NATS and
// ONCEFLOW_TEST_REDIS. Kafka is not a loopback service: package internal/kafkatest starts an
// in-process cluster, or uses the one ONCEFLOW_TEST_KAFKA names.
package testsvc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/onceflow/onceflow/sqldb"
	// The tests open databases of every dialect.
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// Default service URLs.
const (
	DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable&connect_timeout=60"
	DefaultMySQLURL    = "mysql://root@127.0.0.1:3306/test"
	DefaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultNATSURL     = "nats://127.0.0.1:4222"
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
)

// InCI reports whether the tests run under CI (CI=true), where missing services are failures.
func InCI() bool { return os.Getenv("CI") == "true" }

func urlFor(env, def string) string {
	if v := os.Getenv(env); v != "" {
		return v
	}
	return def
}

// PostgresURL returns the URL of the test PostgreSQL server, after checking it is reachable.
func PostgresURL(t testing.TB) string {
	return reachable(t, "PostgreSQL", urlFor("ONCEFLOW_TEST_POSTGRES", DefaultPostgresURL))
}

// MySQLURL returns the URL of the test MySQL/MariaDB server, after checking it is reachable.
func MySQLURL(t testing.TB) string {
	return reachable(t, "MariaDB", urlFor("ONCEFLOW_TEST_MYSQL", DefaultMySQLURL))
}

// AMQPURL returns the URL of the test RabbitMQ server, after checking it is reachable.
func AMQPURL(t testing.TB) string {
	return reachable(t, "RabbitMQ", urlFor("ONCEFLOW_TEST_AMQP", DefaultAMQPURL))
}

// NATSURL returns the URL of the test NATS server, after checking it is reachable.
func NATSURL(t testing.TB) string {
	return reachable(t, "NATS", urlFor("ONCEFLOW_TEST_NATS", DefaultNATSURL))
}

// RedisURL returns the URL of the test Redis server, after checking it is reachable.
func RedisURL(t testing.TB) string {
	return reachable(t, "Redis", urlFor("ONCEFLOW_TEST_REDIS", DefaultRedisURL))
}

var (
	reachMu    sync.Mutex
	reachCache = map[string]error{}
)

// reachable dials the host of rawURL once per process and skips or fails t when it does not
// answer.
func reachable(t testing.TB, service, rawURL string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("%s test URL %q: %v", service, sqldb.Redact(rawURL), err)
	}
	reachMu.Lock()
	err, seen := reachCache[u.Host]
	if !seen {
		var conn net.Conn
		conn, err = net.DialTimeout("tcp", u.Host, 2*time.Second)
		if err == nil {
			_ = conn.Close()
		}
		reachCache[u.Host] = err
	}
	reachMu.Unlock()
	if err != nil {
		Unavailable(t, service, fmt.Sprintf("%s unreachable: %v", u.Host, err))
	}
	return rawURL
}

// Unavailable fails t under CI and skips it otherwise, naming the service and why.
func Unavailable(t testing.TB, service, why string) {
	t.Helper()
	if InCI() {
		t.Fatalf("%s is required under CI=true: %s", service, why)
	}
	t.Skipf("skipping: %s is not available (%s); start it or run under CI to make this a failure", service, why)
}

// UniqueName returns a short random identifier with prefix, valid as an SQL identifier, topic
// or queue name.
func UniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}

// Postgres returns a connection to a fresh schema on the test PostgreSQL server; the schema is
// dropped when the test ends.
func Postgres(t testing.TB) *sqldb.DB {
	t.Helper()
	base := PostgresURL(t)
	ctx := context.Background()
	admin, err := sqldb.Open(ctx, base)
	if err != nil {
		Unavailable(t, "PostgreSQL", err.Error())
	}
	schema := UniqueName("t")
	if _, err := admin.ExecContext(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	u, _ := url.Parse(base)
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	db, err := sqldb.Open(ctx, u.String())
	if err != nil {
		t.Fatalf("open PostgreSQL schema %s: %v", schema, err)
	}
	t.Cleanup(func() {
		_ = db.Close()
		_, _ = admin.ExecContext(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		_ = admin.Close()
	})
	return db
}

// PostgresOldTransactions describes the transactions on the test PostgreSQL server that began
// more than age ago, in every database, or says there are none. A PostgreSQL queue hands out no
// message written after the oldest transaction still running on the server (broker/sqlqueue):
// a test that waits in vain for a message names them in its failure.
func PostgresOldTransactions(t testing.TB, age time.Duration) string {
	t.Helper()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, PostgresURL(t))
	if err != nil {
		return "PostgreSQL's transactions: " + err.Error()
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, `SELECT pid, datname, COALESCE(state, ''), COALESCE(application_name, ''),
	round(extract(epoch FROM now() - xact_start)::numeric, 1)::text, left(query, 120)
FROM pg_stat_activity WHERE xact_start < now() - make_interval(secs => $1) AND pid <> pg_backend_pid()
ORDER BY xact_start`, age.Seconds())
	if err != nil {
		return "PostgreSQL's transactions: " + err.Error()
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var pid int
		var db, state, app, secs, query string
		if err := rows.Scan(&pid, &db, &state, &app, &secs, &query); err != nil {
			return "PostgreSQL's transactions: " + err.Error()
		}
		fmt.Fprintf(&b, "\n  pid %d, database %s, %s for %s s, application %q: %s", pid, db, state, secs, app, query)
	}
	if err := rows.Err(); err != nil {
		return "PostgreSQL's transactions: " + err.Error()
	}
	if b.Len() == 0 {
		return fmt.Sprintf("no transaction on PostgreSQL older than %s", age)
	}
	return fmt.Sprintf("transactions on PostgreSQL older than %s:%s", age, b.String())
}

// PostgresSchemaURL returns the URL of a fresh schema on the test PostgreSQL server, for tests
// that open their own connections (several processes, the command-line tool); the schema is
// dropped when the test ends.
func PostgresSchemaURL(t testing.TB) string {
	t.Helper()
	db := Postgres(t)
	var schema string
	if err := db.QueryRowx("SELECT current_schema()").Scan(&schema); err != nil {
		t.Fatalf("read schema: %v", err)
	}
	u, _ := url.Parse(PostgresURL(t))
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// MySQL returns a connection to a fresh database on the test MySQL/MariaDB server; the
// database is dropped when the test ends.
func MySQL(t testing.TB) *sqldb.DB {
	t.Helper()
	db, err := sqldb.Open(context.Background(), MySQLDatabaseURL(t))
	if err != nil {
		t.Fatalf("open MariaDB test database: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// MySQLDatabaseURL returns the URL of a fresh database on the test MySQL/MariaDB server; the
// database is dropped when the test ends.
func MySQLDatabaseURL(t testing.TB) string {
	t.Helper()
	base := MySQLURL(t)
	ctx := context.Background()
	admin, err := sqldb.Open(ctx, base)
	if err != nil {
		Unavailable(t, "MariaDB", err.Error())
	}
	name := UniqueName("t")
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		_, _ = admin.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+name)
		_ = admin.Close()
	})
	u, _ := url.Parse(base)
	u.Path = "/" + name
	return u.String()
}

// SQLite returns a fresh SQLite database in a temporary directory.
func SQLite(t testing.TB) *sqldb.DB {
	t.Helper()
	db, err := sqldb.Open(context.Background(), SQLiteURL(t))
	if err != nil {
		t.Fatalf("open SQLite: %v", err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// SQLiteURL returns the URL of a new SQLite file in a temporary directory.
func SQLiteURL(t testing.TB) string {
	t.Helper()
	return "sqlite://" + filepath.Join(t.TempDir(), "app.db")
}

// Database is a way to get a fresh database of one dialect.
type Database struct {
	// Name is the dialect's name, usable as a subtest name.
	Name string
	// Open returns a fresh database, cleaned up when the test ends.
	Open func(t testing.TB) *sqldb.DB
	// URL returns the URL of a fresh database, cleaned up when the test ends.
	URL func(t testing.TB) string
}

// Databases lists every dialect onceflow supports, for tests that must pass on all of them.
func Databases() []Database {
	return []Database{
		{Name: "sqlite", Open: SQLite, URL: SQLiteURL},
		{Name: "postgres", Open: Postgres, URL: PostgresSchemaURL},
		{Name: "mysql", Open: MySQL, URL: MySQLDatabaseURL},
	}
}

// Eventually polls cond every 10 ms until it returns true or timeout passes, then fails t with
// msg. It is the synchronisation for conditions that no channel announces, such as a row that
// another process commits.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: "+msg, append([]any{timeout}, args...)...)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Trim shortens s for messages.
func Trim(s string) string {
	if len(s) > 200 {
		return s[:200] + "…"
	}
	return strings.TrimSpace(s)
}
