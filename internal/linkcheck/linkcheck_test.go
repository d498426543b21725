package linkcheck_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/sqldb"
)

// The packages of the database drivers and broker clients, and of onceflow's packages that
// register them: each path and the packages under it.
var (
	mysqlPkgs    = []string{"github.com/go-sql-driver/mysql", "github.com/onceflow/onceflow/sqldb/mysql"}
	sqlitePkgs   = []string{"modernc.org/", "github.com/onceflow/onceflow/sqldb/sqlite", "github.com/onceflow/onceflow/broker/sqlitequeue"}
	postgresPkgs = []string{"github.com/jackc/pgx", "github.com/onceflow/onceflow/sqldb/postgres"}
	natsPkgs     = []string{"github.com/nats-io/", "github.com/ThreeDotsLabs/watermill-nats", "github.com/onceflow/onceflow/broker/nats"}
	redisPkgs    = []string{"github.com/redis/", "github.com/ThreeDotsLabs/watermill-redisstream", "github.com/onceflow/onceflow/broker/redis"}
	amqpPkgs     = []string{"github.com/rabbitmq/", "github.com/ThreeDotsLabs/watermill-amqp", "github.com/onceflow/onceflow/broker/amqp"}
	kafkaPkgs    = []string{"github.com/twmb/", "github.com/onceflow/onceflow/broker/kafka"}
	otherPkgs    = []string{"github.com/onceflow/onceflow/broker/sqlqueue", "github.com/onceflow/onceflow/broker/mem", "github.com/onceflow/onceflow/broker/all"}
)

// deps returns the packages that pkgs link, as go list -deps lists them.
func deps(t *testing.T, pkgs ...string) []string {
	t.Helper()
	gobin, err := exec.LookPath("go")
	require.NoError(t, err, "the go command lists the dependencies")
	out, err := exec.Command(gobin, append([]string{"list", "-deps"}, pkgs...)...).Output()
	if ee, ok := err.(*exec.ExitError); ok {
		t.Fatalf("go list -deps %s: %v\n%s", strings.Join(pkgs, " "), err, ee.Stderr)
	}
	require.NoError(t, err)
	list := strings.Fields(string(out))
	t.Logf("go list -deps %s: %d packages", strings.Join(pkgs, " "), len(list))
	return list
}

// requireNone fails t for every package of list that is one of the packages, or under one of
// the paths, of the groups.
func requireNone(t *testing.T, list []string, groups ...[]string) {
	t.Helper()
	var found []string
	for _, p := range list {
		for _, group := range groups {
			for _, path := range group {
				path = strings.TrimSuffix(path, "/")
				if p == path || strings.HasPrefix(p, path+"/") {
					found = append(found, p)
				}
			}
		}
	}
	require.Empty(t, found, "linked packages that the program does not use")
}

// requireNoName fails t for every package of list whose path has one of the words in it.
func requireNoName(t *testing.T, list []string, words ...string) {
	t.Helper()
	var found []string
	for _, p := range list {
		for _, w := range words {
			if strings.Contains(strings.ToLower(p), w) {
				found = append(found, p)
			}
		}
	}
	require.Empty(t, found, "packages named %v", words)
}

func TestPostgresProgram_LinksNoOtherDriverAndNoBrokerClient(t *testing.T) {
	t.Parallel()
	list := deps(t, "./testdata/postgres")
	require.Contains(t, list, "github.com/jackc/pgx/v5/stdlib")
	requireNone(t, list, mysqlPkgs, sqlitePkgs, natsPkgs, redisPkgs, amqpPkgs, kafkaPkgs, otherPkgs)
	requireNoName(t, list, "mysql", "sqlite", "nats", "redis", "amqp", "kafka")
}

func TestRabbitMQProgram_LinksNoOtherBrokerAndNoOtherDriver(t *testing.T) {
	t.Parallel()
	list := deps(t, "./testdata/rabbitmq")
	require.Contains(t, list, "github.com/onceflow/onceflow/broker/amqp")
	require.Contains(t, list, "github.com/jackc/pgx/v5/stdlib")
	requireNone(t, list, mysqlPkgs, sqlitePkgs, natsPkgs, redisPkgs, kafkaPkgs, otherPkgs)
	requireNoName(t, list, "mysql", "sqlite", "nats", "redis", "kafka")
}

func TestKafkaProgram_LinksNoOtherBrokerAndNoOtherDriver(t *testing.T) {
	t.Parallel()
	list := deps(t, "./testdata/kafka")
	require.Contains(t, list, "github.com/onceflow/onceflow/broker/kafka")
	require.Contains(t, list, "github.com/twmb/franz-go/pkg/kgo")
	require.Contains(t, list, "github.com/jackc/pgx/v5/stdlib")
	// The in-process cluster of the tests is not linked.
	requireNone(t, list, mysqlPkgs, sqlitePkgs, natsPkgs, redisPkgs, amqpPkgs, otherPkgs,
		[]string{"github.com/twmb/franz-go/pkg/kfake", "github.com/onceflow/onceflow/broker/kafka/kafkatest", "github.com/onceflow/onceflow/internal/kafkatest"})
	requireNoName(t, list, "mysql", "sqlite", "nats", "redis", "amqp", "rabbitmq")
}

// The packages a user's code imports, and those they import, link no driver and no client:
// the program chooses them.
func TestCorePackages_LinkNoDriverAndNoBrokerClient(t *testing.T) {
	t.Parallel()
	const mod = "github.com/onceflow/onceflow"
	list := deps(t, mod, mod+"/processor", mod+"/messagedata", mod+"/middleware", mod+"/dedup",
		mod+"/ordering", mod+"/converter", mod+"/sqldb", mod+"/broker")
	requireNone(t, list, mysqlPkgs, sqlitePkgs, postgresPkgs, natsPkgs, redisPkgs, amqpPkgs, kafkaPkgs, otherPkgs)
}

// The outbox's relay reads its tables as the SQL queues read a topic, so it links their code,
// but no database driver and no broker client.
func TestOutbox_LinksTheQueuesButNoDriverAndNoBrokerClient(t *testing.T) {
	t.Parallel()
	list := deps(t, "github.com/onceflow/onceflow/outbox")
	require.Contains(t, list, "github.com/onceflow/onceflow/broker/sqlqueue")
	require.Contains(t, list, "github.com/onceflow/onceflow/broker/sqlitequeue")
	requireNone(t, list, mysqlPkgs, postgresPkgs, natsPkgs, redisPkgs, amqpPkgs, kafkaPkgs,
		[]string{"modernc.org/", "github.com/onceflow/onceflow/sqldb/sqlite", "github.com/onceflow/onceflow/broker/all"})
}

// This test binary links sqldb and broker and none of the drivers or schemes.
func TestOpen_MissingDriverNamesTheImport(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for rawURL, pkg := range map[string]string{
		"postgres://app:S3cret@127.0.0.1:1/orders":   "github.com/onceflow/onceflow/sqldb/postgres",
		"postgresql://app:S3cret@127.0.0.1:1/orders": "github.com/onceflow/onceflow/sqldb/postgres",
		"mysql://app:S3cret@127.0.0.1:1/orders":      "github.com/onceflow/onceflow/sqldb/mysql",
		"mariadb://app:S3cret@127.0.0.1:1/orders":    "github.com/onceflow/onceflow/sqldb/mysql",
		"sqlite:///tmp/app.db":                       "github.com/onceflow/onceflow/sqldb/sqlite",
	} {
		_, err := sqldb.Open(ctx, rawURL)
		require.ErrorContains(t, err, `driver is registered: import _ "`+pkg+`"`, rawURL)
		require.NotContains(t, err.Error(), "S3cret")
	}
	for rawURL, pkg := range map[string]string{
		"amqp://app:S3cret@127.0.0.1:1/":           "github.com/onceflow/onceflow/broker/amqp",
		"amqps://app:S3cret@127.0.0.1:1/":          "github.com/onceflow/onceflow/broker/amqp",
		"nats://app:S3cret@127.0.0.1:1":            "github.com/onceflow/onceflow/broker/nats",
		"redis://app:S3cret@127.0.0.1:1/0":         "github.com/onceflow/onceflow/broker/redis",
		"kafka://127.0.0.1:1,127.0.0.1:2/":         "github.com/onceflow/onceflow/broker/kafka",
		"postgres://app:S3cret@127.0.0.1:1/orders": "github.com/onceflow/onceflow/broker/sqlqueue",
		"mariadb://app:S3cret@127.0.0.1:1/orders":  "github.com/onceflow/onceflow/broker/sqlqueue",
		"sqlite:///tmp/queue.db":                   "github.com/onceflow/onceflow/broker/sqlitequeue",
		"mem://tests":                              "github.com/onceflow/onceflow/broker/mem",
	} {
		_, err := broker.Open(ctx, rawURL, broker.Options{})
		require.ErrorContains(t, err, `is not linked into this program: import _ "`+pkg+`" (or "github.com/onceflow/onceflow/broker/all" for every scheme)`, rawURL)
		require.NotContains(t, err.Error(), "S3cret")
	}
}
