package main

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// Two runs with -demo publish pay-1 once and pay-2 twice each time; the ledger has one row
// of each, on every database.
func TestOnescreen_EachPaymentBookedOnceAcrossRuns(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			bookTwice(t, d.URL(t))
		})
	}
}

func bookTwice(t *testing.T, dbURL string) {
	queueFile := filepath.Join(t.TempDir(), "queue.db")
	for i := range 2 {
		ctx, stop := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- run(ctx, "sqlite://"+queueFile, dbURL, true) }()
		waitDrained(t, queueFile, int64(3*(i+1)), done)
		stop()
		require.NoError(t, <-done)

		db, err := sqldb.Open(context.Background(), dbURL)
		require.NoError(t, err)
		var rows []struct {
			ID    string `db:"payment_id"`
			Cents int64  `db:"cents"`
		}
		require.NoError(t, db.Select(&rows, `SELECT payment_id, cents FROM ledger ORDER BY payment_id`))
		require.NoError(t, db.Close())
		require.Len(t, rows, 2)
		require.Equal(t, "pay-1", rows[0].ID)
		require.EqualValues(t, 1250, rows[0].Cents)
		require.Equal(t, "pay-2", rows[1].ID)
		require.EqualValues(t, 990, rows[1].Cents)
	}
}

// waitDrained returns once want messages were published to payments and the handler's consumer
// group has acknowledged all of them.
func waitDrained(t *testing.T, queueFile string, want int64, done <-chan error) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute)
	for {
		select {
		case err := <-done:
			t.Fatalf("run returned early: %v", err)
		case <-time.After(20 * time.Millisecond):
		}
		q, err := sqlitequeue.Open(ctx, "sqlite://"+queueFile, sqlitequeue.Config{})
		require.NoError(t, err)
		published, err := q.Len(ctx, "payments")
		require.NoError(t, err)
		left, err := q.Backlog(ctx, "payments", sqlitequeue.DefaultConsumerGroup)
		require.NoError(t, err)
		require.NoError(t, q.Close())
		if published == want && left == 0 {
			return
		}
		require.True(t, time.Now().Before(deadline), "%d of %d messages left after a minute", left, published)
	}
}
