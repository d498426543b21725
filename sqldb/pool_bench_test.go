package sqldb_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// BenchmarkConcurrentTransactions runs short write transactions (BEGIN, one INSERT, COMMIT)
// from 16 goroutines, as a handler with Concurrency 16 does, each waiting 500 µs between two
// transactions as a handler waits for its next delivery, on a pool as Open leaves it and on one
// with database/sql's own default of 2 idle connections. It reports msgs/s and reconnects/msg:
// how often a transaction needed a new connection because the pool had closed the one it
// returned.
func BenchmarkConcurrentTransactions(b *testing.B) {
	for _, d := range testsvc.Databases() {
		b.Run(d.Name, func(b *testing.B) {
			for _, pool := range []struct {
				name string
				idle int // 0: as Open leaves it
			}{{"open-default", 0}, {"database-sql-default-2-idle", 2}} {
				b.Run(pool.name, func(b *testing.B) {
					db := d.Open(b)
					if pool.idle > 0 {
						db.SetMaxIdleConns(pool.idle)
					}
					benchTransactions(b, db, 16)
				})
			}
		})
	}
}

func benchTransactions(b *testing.B, db *sqldb.DB, concurrency int) {
	ctx := context.Background()
	_, err := db.ExecContext(ctx, `CREATE TABLE bench_pool (id VARCHAR(64) NOT NULL, payload VARCHAR(255) NOT NULL)`)
	require.NoError(b, err)
	insert := db.Rebind(`INSERT INTO bench_pool (id, payload) VALUES (?, ?)`)
	closedBefore := db.Stats().MaxIdleClosed
	var next atomic.Int64
	var failures atomic.Int64
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for range concurrency {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					return
				}
				tx, err := db.BeginTxx(ctx, nil)
				if err != nil {
					failures.Add(1)
					continue
				}
				if _, err := tx.ExecContext(ctx, insert, fmt.Sprint(i), `{"amount":1}`); err != nil {
					_ = tx.Rollback()
					failures.Add(1)
					continue
				}
				if err := tx.Commit(); err != nil {
					failures.Add(1)
				}
				time.Sleep(500 * time.Microsecond) // the next delivery arrives

			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	require.Zero(b, failures.Load())
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(float64(db.Stats().MaxIdleClosed-closedBefore)/float64(b.N), "reconnects/msg")
}
