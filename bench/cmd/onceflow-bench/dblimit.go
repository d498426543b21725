package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/sqldb"
)

// runDBLimit measures the database's own rate for the statements of an ExactlyOnce message:
// the dedup upsert onceflow runs and the business insert, in one transaction, with as many
// clients as the concurrency. On PostgreSQL db-limit is pgbench with a script of those
// statements; db-limit-go, and db-limit on the other databases, is a Go loop that runs them
// through the same SQLStore and driver as onceflow, without broker or router.
func (s *suite) runDBLimit(ctx context.Context, cl cell, e *Entry) error {
	st, v, c := cl.st, cl.variant, cl.c
	id := newID()
	dir := filepath.Join(s.svc.dir, id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	db, err := s.openDB(ctx, st, dir)
	if err != nil {
		return err
	}
	defer db.Close()
	// The database's limit, not a pool's: every client keeps its connection.
	db.SetMaxIdleConns(c + 2)
	tables := newCellTables(id)
	if err := tables.create(ctx, db); err != nil {
		return err
	}
	defer tables.drop(context.WithoutCancel(ctx), db)
	store, err := dedup.New(db, dedup.Config{Table: tables.dedup})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	dur := time.Duration(s.cfg.seconds * float64(time.Second))
	if st.Database == "postgres" && v == vDBLimit {
		e.Tool = "pgbench"
		return s.pgbench(ctx, db, tables, c, dur, s.payloads[cl.payload], e)
	}
	e.Tool = "go-loop"
	insert := effectInsert(db, tables.effects)
	return goLoop(ctx, db, c, dur, s.cfg.warmup, e, func(ctx context.Context) error {
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return err
		}
		msgID := watermill.NewUUID()
		if _, err := store.Record(ctx, tx, dedup.Key{Handler: "bench", MessageID: msgID}, ""); err != nil {
			_ = tx.Rollback()
			return err
		}
		if _, err := tx.ExecContext(ctx, insert, msgID, s.payloads[cl.payload]); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	})
}

// goLoop runs op in c goroutines for warmup×dur/(1-warmup) plus dur, and measures the rate of
// the last dur.
func goLoop(ctx context.Context, db *sqldb.DB, c int, dur time.Duration, warmup float64, e *Entry, op func(context.Context) error) error {
	var done atomic.Int64
	var stop atomic.Bool
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range c {
		wg.Go(func() {
			for !stop.Load() {
				if err := op(ctx); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					stop.Store(true)
					return
				}
				done.Add(1)
			}
		})
	}
	warm := time.Duration(float64(dur) * warmup / (1 - warmup))
	select {
	case <-time.After(warm):
	case <-ctx.Done():
	}
	n0, t0, cpu0, wal0 := done.Load(), time.Now(), sampleCPU(), serverWAL(ctx, db)
	select {
	case <-time.After(dur):
	case <-ctx.Done():
	}
	n1, t1, cpu1, wal1 := done.Load(), time.Now(), sampleCPU(), serverWAL(ctx, db)
	stop.Store(true)
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	elapsed := t1.Sub(t0).Seconds()
	e.Messages = int(n1 - n0)
	e.Seconds = round2(elapsed)
	e.MsgsPerS = float64(int(float64(n1-n0) / elapsed))
	e.CPU = cpuUse(cpu0, cpu1)
	e.CPUPerMsg = cpuPerMsg(e.CPU, elapsed, e.Messages)
	e.ConnsClosedIdle = db.Stats().MaxIdleClosed
	e.setWAL(wal0, wal1, int(n1-n0))
	return nil
}

// pgDedupUpsert is the statement dedup.SQLStore.Record runs on PostgreSQL (dedup/postgres.go),
// with the values pgbench supplies.
const pgDedupUpsert = `INSERT INTO %s AS d (handler, message_id, message_ts, internal_id, created_at, expires_at) VALUES ('bench', 'pgbench-' || :client_id || '-' || :r, 0, NULL, %d, %d) ON CONFLICT (handler, message_id, message_ts) DO UPDATE SET internal_id = EXCLUDED.internal_id, created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at WHERE d.expires_at <= EXCLUDED.created_at;`

var (
	pgbenchTPS = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)
	pgbenchTx  = regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`)
)

// pgbench runs pgbench with c clients for dur, over a script of the two statements of an
// ExactlyOnce message in one transaction, prepared as pgx prepares onceflow's. The payload is a
// literal of the same size in the prepared statement.
func (s *suite) pgbench(ctx context.Context, db *sqldb.DB, tables cellTables, c int, dur time.Duration, payload []byte, e *Entry) error {
	now := time.Now()
	script := fmt.Sprintf("\\set r random(1, 9000000000000000000)\nBEGIN;\n"+pgDedupUpsert+"\nINSERT INTO %s (message_id, payload) VALUES ('pgbench-' || :client_id || '-' || :r, '%s'::bytea);\nEND;\n",
		tables.dedup, now.UnixMicro(), now.Add(dedup.DefaultRetention).UnixMicro(), tables.effects, payload)
	f, err := os.CreateTemp(s.svc.dir, "pgbench-*.sql")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(script); err != nil {
		return err
	}
	_ = f.Close()
	secs := max(int(dur.Round(time.Second)/time.Second), 1)
	cmd := exec.CommandContext(ctx, "pgbench", "-n", "-M", "prepared", "-c", strconv.Itoa(c),
		"-j", strconv.Itoa(min(c, runtime.NumCPU())), "-T", strconv.Itoa(secs), "-f", f.Name(), s.svc.postgres)
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+benchSchema)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cpu0, wal0 := sampleCPU(), serverWAL(ctx, db)
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgbench: %w: %s", err, lastLines(out.String(), 3))
	}
	cpu1, wal1 := sampleCPU(), serverWAL(ctx, db)
	tps := pgbenchTPS.FindStringSubmatch(out.String())
	txs := pgbenchTx.FindStringSubmatch(out.String())
	if tps == nil || txs == nil {
		return fmt.Errorf("pgbench: no tps in its output: %s", lastLines(out.String(), 5))
	}
	rate, _ := strconv.ParseFloat(tps[1], 64)
	n, _ := strconv.Atoi(txs[1])
	e.Messages, e.MsgsPerS, e.Seconds = n, float64(int(rate)), float64(secs)
	e.CPU = cpuUse(cpu0, cpu1)
	e.CPUPerMsg = cpuPerMsg(e.CPU, cpu1.at.Sub(cpu0.at).Seconds(), n)
	e.setWAL(wal0, wal1, n)
	return nil
}

func lastLines(s string, n int) string {
	lines := bytes.Split(bytes.TrimSpace([]byte(s)), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte(" | ")))
}
