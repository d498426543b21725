package groupcommit_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/groupcommit"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// BenchmarkGroupCommit compares a transaction per message (Transaction + Deduplicate) with
// group commit (GroupCommit) on each database: concurrency goroutines, standing for a handler's
// subscriptions, each process one message after the other; the processor inserts one row
// through the transaction. It reports msgs/s and the allocations per message. "remote-call" adds 1 ms of waiting outside the
// database to every message, where per-message transactions run in parallel and a group's
// members one after the other.
//
// These measure the chain and the database only; the end-to-end suite (make bench) adds the
// broker.
func BenchmarkGroupCommit(b *testing.B) {
	for _, d := range testsvc.Databases() {
		b.Run(d.Name, func(b *testing.B) {
			for _, sc := range []struct {
				name        string
				concurrency int
				remote      time.Duration
			}{
				{"c1", 1, 0},
				{"c16", 16, 0},
				{"c16-remote-call-1ms", 16, time.Millisecond},
			} {
				for _, group := range []bool{false, true} {
					name := sc.name + "/per-message"
					if group {
						name = sc.name + "/group"
					}
					b.Run(name, func(b *testing.B) { benchChain(b, d, sc.concurrency, sc.remote, group) })
				}
			}
		})
	}
}

func benchChain(b *testing.B, d testsvc.Database, concurrency int, remote time.Duration, group bool) {
	db := d.Open(b)
	_, err := db.Exec(`CREATE TABLE bench_effects (id VARCHAR(255) NOT NULL, payload VARCHAR(255) NOT NULL)`)
	require.NoError(b, err)
	store, err := dedup.New(db, dedup.Config{})
	require.NoError(b, err)
	require.NoError(b, store.Migrate(context.Background()))
	insert := db.Rebind(`INSERT INTO bench_effects (id, payload) VALUES (?, ?)`)
	proc := processor.Func(func(ctx context.Context, m *messagedata.MessageData) error {
		if remote > 0 {
			time.Sleep(remote)
		}
		tx, _ := middleware.CurrentTx(ctx)
		_, err := tx.ExecContext(ctx, insert, m.ID, string(m.Payload))
		return err
	})
	var chain processor.Processor
	if group {
		gc, err := newGroupCommit(middleware.Pool(db), store, "bench", withConcurrency(concurrency))
		require.NoError(b, err)
		chain = middleware.Chain(middleware.Recover(), must(middleware.Retry{}.Middleware()), gc)(proc)
	} else {
		chain = middleware.Chain(middleware.Recover(), must(middleware.Retry{}.Middleware()), middleware.Transaction{}.Middleware(middleware.Pool(db)), must(middleware.Dedup{Store: store}.Middleware(nil, "bench")))(proc)
	}
	db.SetMaxOpenConns(concurrency + 4)
	db.SetMaxIdleConns(concurrency + 4)

	var next atomic.Int64
	var failures atomic.Int64
	b.ReportAllocs()
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
				m := &messagedata.MessageData{ID: fmt.Sprintf("msg-%d", i), Topic: "bench", Payload: []byte(`{"amount":1}`)}
				if err := chain.Process(context.Background(), m); err != nil {
					failures.Add(1)
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	require.Zero(b, failures.Load())
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
	checkApplied(b, db, b.N)
}

func checkApplied(b *testing.B, db *sqldb.DB, n int) {
	var rows int
	require.NoError(b, db.Get(&rows, `SELECT COUNT(*) FROM bench_effects`))
	require.Equal(b, n, rows)
}

// BenchmarkGroupCommit_Batch runs full groups of a batch processor that writes nothing, on
// each database: the messages join one lane 64 at a time, as a busy subscription's do, into a
// group that waits until it is full, and each group's transaction records their ids and
// commits. It measures the group's own cost per message on the client (testsvc.Cost: the
// process's CPU time, user and system, and its allocations).
func BenchmarkGroupCommit_Batch(b *testing.B) {
	const size = 64
	for _, d := range testsvc.Databases() {
		b.Run(d.Name, func(b *testing.B) {
			db := d.Open(b)
			store, err := dedup.New(db, dedup.Config{})
			require.NoError(b, err)
			require.NoError(b, store.Migrate(context.Background()))
			var processed atomic.Int64
			mw, err := newGroupCommit(middleware.Pool(db), store, "bench", batch(processor.BatchFunc(func(_ context.Context, msgs []*messagedata.MessageData) error {
				processed.Add(int64(len(msgs)))
				return nil
			})), func(c *groupcommit.Config) { c.MaxWait = 100 * time.Millisecond })
			require.NoError(b, err)
			j := mw(nil).(groupcommit.Joiner)
			msgs := make([]*messagedata.MessageData, b.N)
			for i := range msgs {
				msgs[i] = &messagedata.MessageData{ID: fmt.Sprintf("%08x-4c1d-9e3a-%012d", i*2654435761%(1<<32), i), Topic: "bench", Attempt: 1, Delivery: 1}
			}
			slots := make([]groupcommit.Slot, size)
			var failures atomic.Int64
			var wg sync.WaitGroup
			done := groupcommit.JoinedFunc(func(err error) {
				if err != nil {
					failures.Add(1)
				}
				wg.Done()
			})
			b.ReportAllocs()
			b.ResetTimer()
			start := time.Now()
			var cost testsvc.Cost
			cost.Start()
			for i := 0; i < b.N; i += size {
				n := min(size, b.N-i)
				wg.Add(n)
				for k := range n {
					slots[k] = groupcommit.Slot{}
					j.Join(context.Background(), msgs[i+k], 1, &slots[k], done)
				}
				wg.Wait()
			}
			cost.Stop()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
			cost.Report(b, b.N)
			require.Zero(b, failures.Load())
			require.Equal(b, int64(b.N), processed.Load())
		})
	}
}
