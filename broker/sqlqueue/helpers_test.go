package sqlqueue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

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
}

// forEachDatabase runs test as a parallel subtest on PostgreSQL and on MariaDB.
func forEachDatabase(t *testing.T, test func(t *testing.T, e *env)) {
	for _, d := range []struct {
		name string
		url  func(testing.TB) string
	}{
		{"postgres", testsvc.PostgresSchemaURL},
		{"mysql", testsvc.MySQLDatabaseURL},
	} {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			test(t, newEnv(t, d.name, d.url(t)))
		})
	}
}

func newEnv(t *testing.T, dialect, url string) *env {
	db, err := sqldb.Open(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return &env{t: t, dialect: dialect, url: url, db: db}
}

// queue returns the queue of the env's database for cfg, with the timings of fast where cfg
// sets none.
func (e *env) queue(cfg sqlqueue.Config) *sqlqueue.Queue {
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
	q, err := sqlqueue.New(e.db.DB.DB, e.db.Dialect, cfg)
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
	ch, err := s.Subscribe(context.Background(), topic)
	require.NoError(e.t, err)
	return s, ch
}

// publish publishes n messages "<prefix>-000".. to topic with q's publisher, one per call, and
// returns their UUIDs in order.
func (e *env) publish(q *sqlqueue.Queue, topic, prefix string, n int) []string {
	e.t.Helper()
	pub, err := q.NewPublisher()
	require.NoError(e.t, err)
	require.NoError(e.t, q.EnsureTopic(context.Background(), topic))
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s-%03d", prefix, i)
		m := message.NewMessage(ids[i], []byte(fmt.Sprintf("payload %d \x00\xff", i)))
		m.Metadata.Set("i", fmt.Sprint(i))
		require.NoError(e.t, pub.Publish(topic, m))
	}
	return ids
}

// receive returns the next message of ch, failing the test after receiveWithin.
func receive(t testing.TB, ch <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		require.True(t, ok, "subscription closed before a message arrived")
		return m
	case <-time.After(receiveWithin):
		t.Fatalf("no message within %s", receiveWithin)
		return nil
	}
}

// requireNothing checks that ch hands out nothing for d.
func requireNothing(t testing.TB, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m, ok := <-ch:
		if ok {
			t.Fatalf("message %s arrived, want none", m.UUID)
		}
	case <-time.After(d):
	}
}

// topic returns a fresh topic name.
func topic() string { return testsvc.UniqueName("t") }
