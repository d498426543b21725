package conformance_test

import (
	"context"
	"database/sql"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sync/semaphore"

	"github.com/onceflow/onceflow/conformance"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// brokers are the rows of the matrix: every broker onceflow supports, each with a URL per
// test (a fresh schema, database or file where the broker keeps its messages in one), and the
// scheme whose features it has. RabbitMQ is there twice: with classic queues, which say only
// whether a delivery is the first (the router counts the others in the database), and with
// quorum queues, which count every delivery.
var brokers = []struct {
	name   string
	scheme string
	url    func(t testing.TB) string
}{
	{"amqp", "amqp", testsvc.AMQPURL},
	{"amqp-quorum", "amqp", func(t testing.TB) string { return withQuery(t, testsvc.AMQPURL(t), "queue_type", "quorum") }},
	{"postgres", "postgres", freshPostgres},
	{"mysql", "mysql", freshMySQL},
	{"sqlite", "sqlite", func(t testing.TB) string { return "sqlite://" + filepath.Join(t.TempDir(), "queue.db") }},
	{"nats", "nats", testsvc.NATSURL},
	{"redis", "redis", testsvc.RedisURL},
	// An in-process Kafka cluster per test (or the one ONCEFLOW_TEST_KAFKA names), with
	// partitions of the test's topics moving a second after their member dies.
	{"kafka", "kafka", func(t testing.TB) string { return kafkatest.URL(t, "") }},
	{"mem", "mem", func(testing.TB) string { return "mem://" + testsvc.UniqueName("conformance") }},
}

// withQuery returns rawURL with the query parameter key set to value.
func withQuery(t testing.TB, rawURL, key, value string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("URL %q: %v", sqldb.Redact(rawURL), err)
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// databases are the columns: every database dialect.
var databases = []struct {
	name string
	url  func(t testing.TB) string
}{
	{"postgres", freshPostgres},
	{"mysql", freshMySQL},
	{"sqlite", func(t testing.TB) string { return "sqlite://" + filepath.Join(t.TempDir(), "app.db") }},
}

// matrixAll names the environment variable that runs TestConformance on the whole matrix,
// every broker x database in every commit mode (ONCEFLOW_CONFORMANCE=all, make
// test-conformance-full); by default each broker x database pair runs in one mode, the modes in
// turn, so that every broker still meets every database and every mode, and every database
// every mode.
const matrixAll = "ONCEFLOW_CONFORMANCE"

// TestConformance runs the conformance suite, but the Poison and Outage scenarios, for every
// broker crossed with every database, in the mode whose turn it is (in every commit mode with
// ONCEFLOW_CONFORMANCE=all): TestConformance/<broker>/<database>/<mode>/<scenario>.
func TestConformance(t *testing.T) {
	others := slices.DeleteFunc(slices.Clone(conformance.ScenarioNames), func(s string) bool {
		return s == conformance.ScenarioPoison || s == conformance.ScenarioOutage
	})
	all := os.Getenv(matrixAll) == "all"
	if !all {
		t.Logf("each broker x database pair runs in one commit mode; %s=all runs it in every mode", matrixAll)
	}
	for i, b := range brokers {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			for j, d := range databases {
				modes := conformance.Modes
				if !all {
					modes = []conformance.Mode{modes[(i+j)%len(modes)]}
				}
				t.Run(d.name, func(t *testing.T) {
					t.Parallel()
					weight := pgWeight(b.name, d.name)
					conformance.Run(t, conformance.Setup{
						BrokerURL:   func(t testing.TB) string { pgSlots.take(t, weight); return b.url(t) },
						DatabaseURL: func(t testing.TB) string { pgSlots.take(t, weight); return d.url(t) },
						Modes:       modes,
						Scenarios:   others,
					}, conformance.DefaultFeatures(b.scheme+"://"))
				})
			}
		})
	}
}

// poisonAll names the environment variable that runs the Poison scenario on the whole matrix
// (ONCEFLOW_CONFORMANCE_POISON=all, about 3 minutes); by default it runs on every broker with
// one database each, the databases in turn, in every mode.
const poisonAll = "ONCEFLOW_CONFORMANCE_POISON"

// TestConformance_Poison runs the Poison scenario, after the other scenarios so that its
// latencies are measured on a machine they do not share: every broker with the database and in
// the mode whose turn it is, so that each mode meets three brokers and every database (every
// database in every mode with ONCEFLOW_CONFORMANCE_POISON=all):
// TestConformance_Poison/<broker>/<database>/<mode>/Poison.
func TestConformance_Poison(t *testing.T) {
	all := os.Getenv(poisonAll) == "all"
	if !all {
		t.Logf("the Poison scenario runs on one database and in one mode per broker; %s=all runs it on every pair in every mode", poisonAll)
	}
	runPerBroker(t, conformance.ScenarioPoison, all, true, len(databases), poisonPGWeight)
}

// outageAll names the environment variable that runs the Outage scenario on the whole matrix,
// in every dedup mode (ONCEFLOW_CONFORMANCE_OUTAGE=all, make test-outage-full); by default it
// runs on every broker with one server database each, the two in turn, in every commit mode.
const outageAll = "ONCEFLOW_CONFORMANCE_OUTAGE"

// TestConformance_Outage runs the Outage scenario: every broker, in every mode, with the server
// database whose turn it is (every database with ONCEFLOW_CONFORMANCE_OUTAGE=all; SQLite, a
// file, has no connection to cut): TestConformance_Outage/<broker>/<database>/<mode>/Outage.
func TestConformance_Outage(t *testing.T) {
	all := os.Getenv(outageAll) == "all"
	if !all {
		t.Logf("the Outage scenario runs on one database per broker; %s=all runs it on every pair and dedup mode", outageAll)
	}
	runPerBroker(t, conformance.ScenarioOutage, all, false, 2 /* postgres, mysql */, pgWeight)
}

// runPerBroker runs scenario on every broker with the first n databases in turn, one per
// broker, in every mode, or in one mode per broker when oneMode is set (the modes change every n
// brokers, so that the pairs of a database and a mode are met in turn); on every database in
// every mode when all is set: <broker>/<database>/<mode>/<scenario>. weight is what a test holds
// of PostgreSQL's connections.
func runPerBroker(t *testing.T, scenario string, all, oneMode bool, n int, weight func(broker, db string) int64) {
	for i, b := range brokers {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			for j, d := range databases {
				if !all && j != i%n {
					continue
				}
				modes := conformance.Modes
				if !all && oneMode {
					modes = []conformance.Mode{modes[(i/n)%len(modes)]}
				}
				t.Run(d.name, func(t *testing.T) {
					t.Parallel()
					w := weight(b.name, d.name)
					conformance.Run(t, conformance.Setup{
						BrokerURL:   func(t testing.TB) string { pgSlots.take(t, w); return b.url(t) },
						DatabaseURL: func(t testing.TB) string { pgSlots.take(t, w); return d.url(t) },
						Modes:       modes,
						Scenarios:   []string{scenario},
					}, conformance.DefaultFeatures(b.scheme+"://"))
				})
			}
		})
	}
}

// PostgreSQL serves 100 connections, shared by every package that `make test` runs at the
// same time. A test of the matrix holds up to about 6 connections when PostgreSQL is its broker
// (its consumers, publishers and DLQ reader; the consumers of a group wait for their turn each
// on a connection of its own) and about 3 when it is its database. pgSlots bounds what the
// matrix holds at once to pgBudget.
const pgBudget = 24

func pgWeight(brokerName, dbName string) int64 {
	var w int64
	if brokerName == "postgres" {
		w += 6
	}
	if dbName == "postgres" {
		w += 3
	}
	return w
}

// poisonPGWeight is what a test of the Poison scenario holds: each of its consumer processes
// (two handlers of two consumers, four on RabbitMQ) holds up to 3 connections of its
// database, and about as many of a PostgreSQL queue.
func poisonPGWeight(brokerName, dbName string) int64 {
	consumers := int64(4)
	if strings.HasPrefix(brokerName, "amqp") {
		consumers = 8
	}
	var w int64
	if brokerName == "postgres" {
		w += 3 * consumers
	}
	if dbName == "postgres" {
		w += 2 * consumers
	}
	return min(w, pgBudget)
}

var pgSlots = &slots{sem: semaphore.NewWeighted(pgBudget)}

// slots lets each test take its weight of the budget once, before it opens a connection, and
// gives it back when the test ends. Taking the whole weight at once keeps two tests from each
// holding part of theirs while waiting for the rest.
type slots struct {
	sem   *semaphore.Weighted
	taken sync.Map // testing.TB -> struct{}
}

func (s *slots) take(t testing.TB, weight int64) {
	if weight == 0 {
		return
	}
	if _, loaded := s.taken.LoadOrStore(t, struct{}{}); loaded {
		return
	}
	if err := s.sem.Acquire(context.Background(), weight); err != nil {
		t.Fatalf("wait for PostgreSQL connections: %v", err)
	}
	t.Cleanup(func() { s.sem.Release(weight) })
}

// TestConformance_Environment runs the suite against the broker and database that the
// environment names, for users who check their own: ONCEFLOW_CONFORMANCE_BROKER (a broker URL)
// and ONCEFLOW_CONFORMANCE_DATABASE (a database URL, of an empty database or schema: each test
// creates and drops a schema or database of its own in it on PostgreSQL and MySQL, and uses a
// file of its own beside it on SQLite). It is skipped when they are not set.
func TestConformance_Environment(t *testing.T) {
	brokerURL, dbURL := os.Getenv("ONCEFLOW_CONFORMANCE_BROKER"), os.Getenv("ONCEFLOW_CONFORMANCE_DATABASE")
	if brokerURL == "" || dbURL == "" {
		t.Skip("set ONCEFLOW_CONFORMANCE_BROKER and ONCEFLOW_CONFORMANCE_DATABASE to run the suite against them")
	}
	conformance.Run(t, conformance.Setup{
		BrokerURL:   func(testing.TB) string { return brokerURL },
		DatabaseURL: func(t testing.TB) string { return freshDatabaseOn(t, dbURL) },
	}, conformance.DefaultFeatures(brokerURL))
}

// freshPostgres returns the URL of a new schema on the test PostgreSQL server, dropped when the
// test ends.
func freshPostgres(t testing.TB) string {
	return freshDatabaseOn(t, testsvc.PostgresURL(t))
}

// freshMySQL returns the URL of a new database on the test MariaDB server, dropped when the
// test ends.
func freshMySQL(t testing.TB) string {
	return freshDatabaseOn(t, testsvc.MySQLURL(t))
}

// admins are the connections that create and drop the tests' schemas and databases, one small
// pool per server: the matrix runs many tests at once, and PostgreSQL's connections are few.
var admins = struct {
	sync.Mutex
	m map[string]*sqldb.DB
}{m: map[string]*sqldb.DB{}}

func admin(t testing.TB, base string) *sqldb.DB {
	admins.Lock()
	defer admins.Unlock()
	if db, ok := admins.m[base]; ok {
		return db
	}
	db, err := sqldb.Open(context.Background(), base)
	if err != nil {
		testsvc.Unavailable(t, sqldb.Redact(base), err.Error())
	}
	db.SetMaxOpenConns(2)
	db.SetMaxIdleConns(2)
	admins.m[base] = db
	return db
}

// freshDatabaseOn returns the URL of a new, empty database next to base: a schema on
// PostgreSQL, a database on MySQL, a file in a temporary directory on SQLite. It is dropped when
// the test ends.
func freshDatabaseOn(t testing.TB, base string) string {
	t.Helper()
	u, err := url.Parse(base)
	if err != nil {
		t.Fatalf("database URL %q: %v", sqldb.Redact(base), err)
	}
	name := testsvc.UniqueName("cf")
	switch u.Scheme {
	case "sqlite", "sqlite3":
		return "sqlite://" + filepath.Join(t.TempDir(), "app.db")
	case "postgres", "postgresql":
		exec(t, admin(t, base), "CREATE SCHEMA "+name, "DROP SCHEMA "+name+" CASCADE")
		q := u.Query()
		q.Set("search_path", name)
		u.RawQuery = q.Encode()
	case "mysql", "mariadb":
		exec(t, admin(t, base), "CREATE DATABASE "+name, "DROP DATABASE IF EXISTS "+name)
		u.Path = "/" + name
	default:
		t.Fatalf("database URL %q: want postgres://, mysql:// or sqlite://", sqldb.Redact(base))
	}
	return u.String()
}

// exec runs create on db, and drop when the test ends.
func exec(t testing.TB, db *sqldb.DB, create, drop string) {
	t.Helper()
	if _, err := db.Exec(create); err != nil {
		t.Fatalf("%s: %v", create, err)
	}
	t.Cleanup(func() {
		if _, err := db.Exec(drop); err != nil && err != sql.ErrConnDone {
			t.Logf("%s: %v", drop, err)
		}
	})
}
