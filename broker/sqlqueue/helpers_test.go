package sqlqueue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// receiveWithin bounds every wait for a message. A PostgreSQL queue hands out a message only
// once every older transaction on the server has ended, those of other tests included.
const receiveWithin = 30 * time.Second

// fast are timings that keep the tests short.
var fast = sqlqueue.Config{PollInterval: 10 * time.Millisecond, RetryInterval: 100 * time.Millisecond, AckTimeout: 20 * time.Second}

// env is one test's database: a fresh PostgreSQL schema or MariaDB database.
type env struct {
	t       *testing.T
	dialect string
	url     string
	db      *sqldb.DB
	// direct makes the env's subscriptions settle directly (redelivery.WithDirectSettle).
	direct bool
}

// databases are the servers every behaviour test runs on.
var databases = []struct {
	name string
	url  func(testing.TB) string
}{
	{"postgres", testsvc.PostgresSchemaURL},
	{"mysql", testsvc.MySQLDatabaseURL},
}

// forEachDatabase runs test as a parallel subtest on PostgreSQL and on MariaDB with a consumer
// that settles directly (redelivery.WithDirectSettle, as the router does), and on PostgreSQL
// also with one that does not, whose acks and nacks the subscription watches for. The two
// ways of learning of a settlement share every statement of the dialect, so the second runs
// on one database.
func forEachDatabase(t *testing.T, test func(t *testing.T, e *env)) {
	for i, d := range databases {
		forEachMode(t, d.name+"-", i == 0, func(t *testing.T, direct bool) {
			e := newEnv(t, d.name, d.url(t))
			e.direct = direct
			test(t, e)
		})
	}
}

// The settling helpers every test of the package uses: testsvc's.
var (
	forEachMode = testsvc.ForEachSettleMode
	ack         = testsvc.Ack
	nack        = testsvc.Nack
	nackAfter   = testsvc.NackAfter
)

// context returns the context to subscribe with: one that promises redelivery.Settle when the
// env settles directly.
func (e *env) context() context.Context {
	if e.direct {
		return redelivery.WithDirectSettle(context.Background())
	}
	return context.Background()
}

func newEnv(t *testing.T, dialect, url string) *env {
	return &env{t: t, dialect: dialect, url: url, db: openDB(t, url)}
}

// openDB opens a pool on url, closed when the test ends.
func openDB(t testing.TB, url string) *sqldb.DB {
	t.Helper()
	db, err := sqldb.Open(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// queue returns the queue of the env's database for cfg, with the timings of fast where cfg
// sets none.
func (e *env) queue(cfg sqlqueue.Config) *sqlqueue.Queue {
	e.t.Helper()
	return e.queueOn(e.db, cfg)
}

// queueOn is queue over the pool db of the env's database.
func (e *env) queueOn(db *sqldb.DB, cfg sqlqueue.Config) *sqlqueue.Queue {
	e.t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = fast.PollInterval
	}
	if cfg.RetryInterval == 0 {
		cfg.RetryInterval = fast.RetryInterval
	}
	if cfg.AckTimeout == 0 {
		cfg.AckTimeout = fast.AckTimeout
	}
	q, err := sqlqueue.New(db.DB.DB, db.Dialect, cfg)
	require.NoError(e.t, err)
	return q
}

// subscriber returns a new Subscriber of q, closed when the test ends.
func (e *env) subscriber(q *sqlqueue.Queue) *sqlqueue.Subscriber {
	s := q.Subscriber()
	e.t.Cleanup(func() { _ = s.Close() })
	return s
}

// subscribe subscribes a new Subscriber of q to topic.
func (e *env) subscribe(q *sqlqueue.Queue, topic string) (*sqlqueue.Subscriber, <-chan *message.Message) {
	e.t.Helper()
	s := e.subscriber(q)
	ch, err := s.Subscribe(e.context(), topic)
	require.NoError(e.t, err)
	return s, ch
}

// publish publishes n messages "<prefix>-000".. to topic with q's publisher, one per call, and
// returns their UUIDs in order.
func (e *env) publish(q *sqlqueue.Queue, topic, prefix string, n int) []string {
	e.t.Helper()
	pub := e.publisher(q, topic)
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%03d", prefix, i)
		m := message.NewMessage(ids[i], []byte(fmt.Sprintf("payload %d \x00\xff", i)))
		m.Metadata.Set("i", fmt.Sprint(i))
		require.NoError(e.t, pub.Publish(topic, m))
	}
	return ids
}

// publisher returns a publisher of q, with the tables of topic created.
func (e *env) publisher(q *sqlqueue.Queue, topic string) message.Publisher {
	e.t.Helper()
	pub, err := q.NewPublisher()
	require.NoError(e.t, err)
	require.NoError(e.t, q.EnsureTopic(context.Background(), topic))
	return pub
}

// receive returns the next message of ch, failing the test after receiveWithin.
func receive(t testing.TB, ch <-chan *message.Message) *message.Message {
	t.Helper()
	return testsvc.Receive(t, ch, receiveWithin)
}

// topic returns a fresh topic name.
func topic() string { return testsvc.UniqueName("t") }

// quote quotes name as an identifier of the env's dialect.
func (e *env) quote(name string) string { return e.db.Dialect.Quote(name) }

// messagesTable returns the quoted name of topic's messages table.
func (e *env) messagesTable(topic string) string { return e.quote("watermill_" + topic) }

// leasesTable returns the quoted name of topic's lease table.
func (e *env) leasesTable(topic string) string { return e.quote("onceflow_leases_" + topic) }
