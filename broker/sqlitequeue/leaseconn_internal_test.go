package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// synchronousOf returns PRAGMA synchronous of conn.
func synchronousOf(t *testing.T, conn *sql.Conn) int {
	t.Helper()
	var level int
	require.NoError(t, conn.QueryRowContext(context.Background(), `PRAGMA synchronous`).Scan(&level))
	return level
}

// Claims and settlements commit with synchronous=NORMAL on a connection of their own; the
// connection never goes back to the pool, whose connections (publishes) keep FULL.
func TestLeaseConn_ClaimsRelaxSynchronousAndPublishesKeepFull(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(t.TempDir(), "queue.db"))
	require.NoError(t, err)
	defer func() { require.NoError(t, db.Close()) }()
	q, err := New(db, Config{ConsumerGroup: "g"})
	require.NoError(t, err)
	require.NoError(t, q.Publisher().Publish("t", message.NewMessage("m", nil)))

	subCtx, cancel := context.WithCancel(ctx)
	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(subCtx, "t")
	require.NoError(t, err)
	m := <-msgs
	require.Equal(t, "m", m.UUID)
	// Checked while the subscription runs: its end may drop the connection (leaseConn.run).
	q.leases.mu.Lock()
	require.NotNil(t, q.leases.conn, "the claim took the lease connection")
	require.Equal(t, 1, synchronousOf(t, q.leases.conn), "NORMAL on the lease connection")
	q.leases.mu.Unlock()
	m.Ack()
	cancel()
	for range msgs { // ends once the acknowledgement is committed
	}

	backlog, err := q.Backlog(ctx, "t", "g")
	require.NoError(t, err)
	require.Zero(t, backlog, "the acknowledgement is committed")

	require.NoError(t, q.Close())
	// Every connection the pool has left, the one the queue used included were it given back,
	// is FULL: hold them all at once to see each.
	open := db.Stats().OpenConnections
	conns := make([]*sql.Conn, 0, open)
	for range open {
		conn, err := db.Conn(ctx)
		require.NoError(t, err)
		conns = append(conns, conn)
	}
	for i, conn := range conns {
		require.Equal(t, synchronousFull, synchronousOf(t, conn), "pool connection %d of %d", i, open)
		require.NoError(t, conn.Close())
	}
}

// A URL that asks for another synchronous than FULL keeps it for claims and settlements too.
func TestLeaseConn_KeepsASynchronousOtherThanFull(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, c := range []struct {
		pragma string
		want   int
	}{{"OFF", 0}, {"EXTRA", 3}} {
		db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(t.TempDir(), "queue.db")+"?_pragma=synchronous("+c.pragma+")")
		require.NoError(t, err)
		conn, lowered, err := openLeaseConn(ctx, db.DB.DB)
		require.NoError(t, err)
		require.False(t, lowered, c.pragma)
		require.Equal(t, c.want, synchronousOf(t, conn), c.pragma)
		discard(conn)
		require.NoError(t, db.Close())
	}
}

// In a pool of one connection the lease connection is not held between transactions: a
// publisher and a subscriber of the queue both go on, and the connection goes back to the pool
// with synchronous=FULL.
func TestLeaseConn_APoolOfOneConnectionIsNotHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(t.TempDir(), "queue.db"))
	require.NoError(t, err)
	defer func() { require.NoError(t, db.Close()) }()
	db.SetMaxOpenConns(1)
	q, err := New(db, Config{ConsumerGroup: "g", BatchSize: 1})
	require.NoError(t, err)
	defer func() { require.NoError(t, q.Close()) }()

	sub, err := q.Subscriber()
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	for i := range 3 {
		id := fmt.Sprintf("m%d", i)
		require.NoError(t, q.Publisher().Publish("t", message.NewMessage(id, nil)))
		select {
		case m := <-msgs:
			require.Equal(t, id, m.UUID)
			m.Ack()
		case <-time.After(10 * time.Second):
			t.Fatalf("message %s not delivered within 10 s", id)
		}
	}
	require.NoError(t, sub.Close())
	backlog, err := q.Backlog(ctx, "t", "g")
	require.NoError(t, err)
	require.Zero(t, backlog, "the acknowledgements are committed")
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	require.Equal(t, synchronousFull, synchronousOf(t, conn), "the pool's one connection")
	require.NoError(t, conn.Close())
}
