package main

import (
	"context"
	"errors"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/sqldb"
)

// startExpertSQLite starts the expert consumer of the embedded SQLite queue, which reads the
// queue file's tables with database/sql: a reader takes up to 64 messages past the consumer
// group's cursor (the offsets table), c workers apply each batch in one transaction of the
// application database, and after the commits the cursor advances past every batch committed
// without a gap before it. A crash loses nothing (the cursor is behind every message whose
// commit is not known) and duplicates nothing (a message read again finds its id recorded).
// SQLite has one writer at a time: the workers take turns for the application database, so
// that none sleeps in SQLite's busy handler.
func startExpertSQLite(ctx context.Context, t topic, c int, x *expertSQL, m *meter) (func() error, error) {
	q, err := sqldb.Open(ctx, t.brokerURL)
	if err != nil {
		return nil, err
	}
	messages, offsets := `"`+sqlitequeue.MessagesTable(t.name)+`"`, `"`+sqlitequeue.OffsetsTable(t.name)+`"`
	var cursor int64
	err = func() error {
		for _, qs := range [][]string{queries(sqlitequeue.SchemaAdapter{}.SchemaInitializingQueries(t.name)),
			queries(sqlitequeue.OffsetsAdapter{}.SchemaInitializingQueries(t.name))} {
			for _, stmt := range qs {
				if _, err := q.ExecContext(ctx, stmt); err != nil {
					return err
				}
			}
		}
		return q.QueryRowContext(ctx, `SELECT COALESCE((SELECT offset_acked FROM `+offsets+` WHERE consumer_group = ?), 0)`, consumerGroup).Scan(&cursor)
	}()
	if err != nil {
		_ = q.Close()
		return nil, err
	}
	read, err := q.PrepareContext(ctx, `SELECT "offset", uuid, payload, COALESCE(metadata, '') FROM `+messages+` WHERE "offset" > ? ORDER BY "offset" LIMIT ?`)
	if err != nil {
		_ = q.Close()
		return nil, err
	}
	advance := `INSERT INTO ` + offsets + ` (consumer_group, offset_acked) VALUES (?, ?)
ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = max(offset_acked, excluded.offset_acked)`

	type batch struct {
		seq  int
		last int64
		msgs []inMsg
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	batches, done := make(chan batch, c), make(chan batch, c)
	var readers, workers, advancer sync.WaitGroup
	readers.Go(func() { // the reader
		defer close(batches)
		for seq, pos := 0, cursor; runCtx.Err() == nil; {
			b := batch{seq: seq, last: pos}
			rows, err := read.QueryContext(runCtx, pos, expertBatch)
			if err == nil {
				for rows.Next() {
					var msg inMsg
					var metadata string
					if err = rows.Scan(&b.last, &msg.id, &msg.payload, &metadata); err != nil {
						break
					}
					msg.sent = sentAtJSON(metadata)
					b.msgs = append(b.msgs, msg)
				}
				err = errors.Join(err, rows.Err(), rows.Close())
			}
			if err != nil && runCtx.Err() == nil {
				m.fail(err)
			}
			if err != nil || len(b.msgs) == 0 {
				sleepCtx(runCtx, time.Millisecond)
				continue
			}
			select {
			case batches <- b:
				seq, pos = seq+1, b.last
			case <-runCtx.Done():
			}
		}
	})
	var turn sync.Mutex
	for range c {
		workers.Go(func() {
			for b := range batches {
				// The cursor cannot pass a batch that is not applied: try it again, until the
				// consumer stops (the batch is then read again by the next one).
				for applied := false; !applied; {
					turn.Lock()
					fresh, err := x.apply(context.Background(), b.msgs)
					turn.Unlock()
					switch {
					case err == nil:
						m.committed(fresh, len(b.msgs))
						done <- b
						applied = true
					case !sleepCtx(runCtx, 10*time.Millisecond):
						m.fail(err)
						return
					default:
						m.fail(err)
					}
				}
			}
		})
	}
	// The cursor is written at most every 20 ms: fewer writes of the queue file, which its
	// publishers need too, and a crash replays no more than those 20 ms (deduplicated).
	advancer.Go(func() {
		next, ready, written := 0, map[int]int64{}, cursor
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		write := func() {
			if cursor == written {
				return
			}
			if _, err := q.ExecContext(context.Background(), advance, consumerGroup, cursor); err != nil {
				m.fail(err) // the next write covers this one
				return
			}
			written = cursor
		}
		for {
			select {
			case b, open := <-done:
				if !open {
					write()
					return
				}
				ready[b.seq] = b.last
				for last, ok := ready[next]; ok; last, ok = ready[next] {
					delete(ready, next)
					next, cursor = next+1, last
				}
			case <-tick.C:
				write()
			}
		}
	})
	return func() error {
		cancel()
		readers.Wait()
		workers.Wait()
		close(done)
		advancer.Wait()
		return errors.Join(read.Close(), q.Close())
	}, nil
}

// queries returns the statements of watermill-sql queries that take no arguments.
func queries(qs []wsql.Query) []string {
	out := make([]string, len(qs))
	for i, q := range qs {
		out[i] = q.Query
	}
	return out
}

// sleepCtx waits for d or until ctx ends, and reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
