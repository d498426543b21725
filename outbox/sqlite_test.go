package outbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/outbox"
)

// The embedded default: the relay sends to a queue file whose consumer writes the application
// database for each delivery. The relay must not hold the application database's write lock
// while it publishes to the queue file, or the consumer's writes wait for it (and with a
// destination that holds a lock of its own while its consumer writes, as the queue's subscriber
// did before it had leases, the two would wait for each other until SQLite's busy timeout,
// 30 s, broke the tie).
func TestRelay_SQLiteQueueDestinationConsumedIntoTheSameDatabaseDoesNotStall(t *testing.T) {
	t.Parallel()
	e := setup(t, testsvc.Databases()[0], outbox.Config{})
	ctx := context.Background()
	_, err := e.db.Exec(`CREATE TABLE shipments (id TEXT NOT NULL PRIMARY KEY)`)
	require.NoError(t, err)

	queue, err := sqlitequeue.Open(ctx, "sqlite://"+filepath.Join(t.TempDir(), "queue.db"), sqlitequeue.Config{ConsumerGroup: "shipping"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = queue.Close() })
	sub, err := queue.Subscriber()
	require.NoError(t, err)
	deliveries, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	consumed := make(chan error, 1)
	const n = 60
	go func() {
		for range n {
			msg, ok := <-deliveries
			if !ok {
				consumed <- errors.New("subscription ended")
				return
			}
			tx, err := e.db.BeginTxx(msg.Context(), nil)
			if err == nil {
				_, err = tx.Exec(`INSERT INTO shipments (id) VALUES (?)`, msg.UUID)
				if err == nil {
					err = tx.Commit()
				} else {
					_ = tx.Rollback()
				}
			}
			if err != nil {
				consumed <- err
				return
			}
			msg.Ack()
		}
		consumed <- nil
	}()

	r := start(t, relayConfig(e, e.db, queue.Publisher()))
	began := time.Now()
	e.commitN(t, "order", n)
	select {
	case err := <-consumed:
		require.NoError(t, err)
	case <-time.After(waitTimeout):
		t.Fatalf("the shipments were not all consumed within %s", waitTimeout)
	}
	require.Less(t, time.Since(began), 5*time.Second, "writers waited for each other")
	require.NoError(t, r.stop(t))
	var rows int
	require.NoError(t, e.db.Get(&rows, `SELECT COUNT(*) FROM shipments`))
	require.Equal(t, n, rows)
}
