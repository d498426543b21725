package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// The variants of the dedup-at-scale benchmark.
const (
	scaleEmpty = "empty"       // a dedup table with no key
	scaleFull  = "10m"         // the table with the loaded keys
	scalePurge = "10m+purge"   // the same while SQLStore.Purge deletes expired keys
	scaleV7    = "10m-uuidv7"  // the loaded table, new messages with time-ordered ids (UUIDv7)
	scaleTable = "scale_dedup" // the loaded table, kept between runs for -reuse
)

// ScaleResults is what bench/results/scale.json holds.
type ScaleResults struct {
	Date     string            `json:"date"`
	Machine  Machine           `json:"machine"`
	Versions map[string]string `json:"versions"`
	Config   map[string]any    `json:"config"`
	// LoadSeconds is how long loading the keys took (0 when an earlier load was reused).
	LoadSeconds float64 `json:"load_seconds"`
	// TableBytes is the size of the loaded table with its indexes.
	TableBytes int64        `json:"table_bytes"`
	Entries    []ScaleEntry `json:"entries"`
	Medians    []ScaleEntry `json:"medians"`
	Targets    []Target     `json:"targets"`
}

// ScaleEntry is one measurement of the dedup-at-scale benchmark.
type ScaleEntry struct {
	Entry
	// Keys is the number of keys in the dedup table when the measurement started (an
	// estimate from the planner's statistics for the loaded table).
	Keys int64 `json:"keys"`
	// PurgedPerS is the rate at which the concurrent purge deleted expired keys.
	PurgedPerS float64 `json:"purged_per_s,omitempty"`
}

func runScale(ctx context.Context, args []string) error {
	svc := defaultServices()
	fs := flag.NewFlagSet("scale", flag.ContinueOnError)
	keys := fs.Int64("keys", 10_000_000, "keys to load into the dedup table; half of them expired, for the purge")
	conc := fs.Int("concurrency", 16, "concurrent transactions (handler concurrency)")
	seconds := fs.Float64("seconds", 10, "seconds measured per cell")
	rounds := fs.Int("rounds", 3, "rounds, interleaved; the median is reported")
	reuse := fs.Bool("reuse", true, "reuse the loaded table of an earlier run when it holds at least -keys/2 keys")
	out := fs.String("out", "bench/results/scale.json", "results file")
	fs.StringVar(&svc.postgres, "postgres", svc.postgres, "PostgreSQL URL")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if os.Getenv("BENCH_QUICK") == "1" {
		*keys, *seconds, *rounds = min(*keys, 100_000), 2, 1
	}
	log := os.Stderr
	res := ScaleResults{
		Date: time.Now().UTC().Format(time.RFC3339), Machine: describeMachine(),
		Config: map[string]any{"keys": *keys, "concurrency": *conc, "seconds_per_cell": *seconds, "rounds": *rounds,
			"payload_bytes": 1024, "method": "the ExactlyOnce chain (Retry, Transaction, Deduplicate with dedup.SQLStore) and a processor inserting the business row, in concurrent goroutines, without broker"},
		Versions: versions(ctx, svc, []setup{{Database: "postgres"}}),
	}
	const schema = benchPrefix + "_scale"
	admin, err := sqldb.Open(ctx, svc.postgres)
	if err != nil {
		return err
	}
	defer admin.Close()
	if _, err := admin.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS `+schema); err != nil {
		return err
	}
	db, err := sqldb.Open(ctx, withSearchPath(svc.postgres, schema))
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxIdleConns(*conc + 4)

	have := tableRows(ctx, db, scaleTable)
	if !*reuse || have < *keys/2 {
		fmt.Fprintf(log, "loading %d keys into %s.%s ...\n", *keys, schema, scaleTable)
		start := time.Now()
		if err := loadKeys(ctx, db, scaleTable, *keys, log); err != nil {
			return fmt.Errorf("load keys: %w", err)
		}
		res.LoadSeconds = round2(time.Since(start).Seconds())
		fmt.Fprintf(log, "loaded in %.0f s\n", res.LoadSeconds)
	} else {
		fmt.Fprintf(log, "reusing %s.%s with about %d keys\n", schema, scaleTable, have)
	}
	_ = db.QueryRowxContext(ctx, `SELECT pg_total_relation_size($1)`, scaleTable).Scan(&res.TableBytes)
	full, err := dedup.New(db, dedup.Config{Table: scaleTable})
	if err != nil {
		return err
	}
	if err := full.Migrate(ctx); err != nil { // a no-op: the loaded table is what Migrate makes
		return err
	}

	payload := newPayload(1024)
	variants := []string{scaleEmpty, scaleFull, scalePurge, scaleV7}
	for round := 1; round <= *rounds; round++ {
		k := (round - 1) % len(variants)
		for _, v := range append(variants[k:], variants[:k]...) {
			if err := ctx.Err(); err != nil {
				return err
			}
			e := ScaleEntry{Entry: Entry{Name: "scale/" + v + fmt.Sprintf("/c%d", *conc), Broker: "none", Database: "postgres",
				Mode: v, Concurrency: *conc, Round: round, Tool: "chain-loop"}}
			if err := scaleCell(ctx, db, full, v, *conc, time.Duration(*seconds*float64(time.Second)), payload, &e); err != nil {
				e.Error = err.Error()
			}
			res.Entries = append(res.Entries, e)
			fmt.Fprintf(log, "round %d %-10s keys %9d  %7.0f msgs/s  purged %6.0f keys/s  cpu %s %s\n",
				round, v, e.Keys, e.MsgsPerS, e.PurgedPerS, formatCPU(e.CPU), e.Error)
		}
	}
	res.Machine.LoadAfter = loadAverage()
	var plain []Entry
	for _, e := range res.Entries {
		plain = append(plain, e.Entry)
	}
	for _, m := range medians(plain) {
		se := ScaleEntry{Entry: m}
		for _, e := range res.Entries {
			if e.Name == m.Name && e.Error == "" && e.MsgsPerS == m.MsgsPerS {
				se = e
			}
		}
		se.Round = 0
		res.Medians = append(res.Medians, se)
	}
	rate := func(v string) float64 {
		for _, m := range res.Medians {
			if m.Mode == v {
				return m.MsgsPerS
			}
		}
		return 0
	}
	for _, v := range []string{scaleFull, scalePurge, scaleV7} {
		if rate(v) > 0 && rate(scaleEmpty) > 0 {
			r := rate(v) / rate(scaleEmpty)
			res.Targets = append(res.Targets, Target{Setup: "postgres", Concurrency: *conc,
				Target: fmt.Sprintf("%s >= 90%% of the empty table's throughput", v), Ratio: round2(r), Want: 0.9, Met: r >= 0.9})
		}
	}
	fmt.Printf("\ndedup at scale (PostgreSQL, concurrency %d, median of %d rounds, %.1f GB table with its indexes):\n", *conc, *rounds, float64(res.TableBytes)/1e9)
	for _, m := range res.Medians {
		fmt.Printf("  %-10s %9d keys  %7.0f msgs/s  purge %6.0f keys/s  postgres %4.0f µs/msg  WAL %5.0f bytes/msg, %.2f full-page images/msg\n",
			m.Mode, m.Keys, m.MsgsPerS, m.PurgedPerS, m.CPUPerMsg["postgres"], m.WALBytesPerMsg, m.WALFPIPerMsg)
	}
	for _, t := range res.Targets {
		mark := "met"
		if !t.Met {
			mark = "NOT MET"
		}
		fmt.Printf("  %-45s %5.2f (want >= %.2f)  %s\n", t.Target, t.Ratio, t.Want, mark)
	}
	if err := writeJSON(*out, res); err != nil {
		return err
	}
	fmt.Fprintf(log, "wrote %s\n", *out)
	return nil
}

// tableRows returns the planner's estimate of the rows of table, or 0 when it does not exist.
func tableRows(ctx context.Context, db *sqldb.DB, table string) int64 {
	var n float64
	if err := db.QueryRowxContext(ctx, `SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)`, table).Scan(&n); err != nil {
		return 0
	}
	return int64(n)
}

// loadKeys creates table as dedup.SQLStore.Migrate does, filled with n keys of handler "bench"
// in random order, like message UUIDs: the even ones expired an hour ago, the odd ones live for
// the default retention. The keys go in with one INSERT ... SELECT generate_series before the
// primary key and the index are built, which is much faster than inserting into the indexes.
func loadKeys(ctx context.Context, db *sqldb.DB, table string, n int64, log io.Writer) error {
	now := time.Now()
	stmts := []string{
		`DROP TABLE IF EXISTS ` + table,
		`CREATE TABLE ` + table + ` (
	handler     VARCHAR(200) NOT NULL,
	message_id  VARCHAR(255) NOT NULL,
	message_ts  BIGINT       NOT NULL DEFAULT 0,
	internal_id VARCHAR(64),
	created_at  BIGINT       NOT NULL,
	expires_at  BIGINT       NOT NULL
)`,
		fmt.Sprintf(`INSERT INTO %s (handler, message_id, message_ts, created_at, expires_at)
SELECT 'bench', md5(i::text)::uuid::text, 0, %d, CASE WHEN i %% 2 = 0 THEN %d ELSE %d END
FROM generate_series(1, %d) AS i`, table, now.Add(-2*time.Hour).UnixMicro(), now.Add(-time.Hour).UnixMicro(),
			now.Add(dedup.DefaultRetention).UnixMicro(), n),
		`SET maintenance_work_mem = '512MB'`,
		`ALTER TABLE ` + table + ` ADD PRIMARY KEY (handler, message_id, message_ts)`,
		`CREATE INDEX ` + table + `_expires_at ON ` + table + ` (expires_at)`,
		`VACUUM ANALYZE ` + table,
	}
	conn, err := db.Conn(ctx) // one session, for SET
	if err != nil {
		return err
	}
	defer conn.Close()
	for _, stmt := range stmts {
		start := time.Now()
		if _, err := conn.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("%.60s...: %w", stmt, err)
		}
		fmt.Fprintf(log, "  %6.1f s  %.60s\n", time.Since(start).Seconds(), firstLine(stmt))
	}
	return nil
}

func firstLine(s string) string {
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

// scaleCell measures the ExactlyOnce chain against the dedup table of variant v.
func scaleCell(ctx context.Context, db *sqldb.DB, full *dedup.SQLStore, v string, c int, dur time.Duration, payload []byte, e *ScaleEntry) error {
	id := newID()
	tables := newCellTables(id)
	if err := tables.create(ctx, db); err != nil {
		return err
	}
	defer tables.drop(context.WithoutCancel(ctx), db)
	store := full
	e.Keys = tableRows(ctx, db, scaleTable)
	if v == scaleEmpty {
		var err error
		if store, err = dedup.New(db, dedup.Config{Table: tables.dedup}); err != nil {
			return err
		}
		if err := store.Migrate(ctx); err != nil {
			return err
		}
		e.Keys = 0
	}
	insert := effectInsert(db, tables.effects)
	retry, err := middleware.Retry{}.Middleware()
	if err != nil {
		return err
	}
	dedupe, err := middleware.Dedup{Store: store}.Middleware(db, "bench")
	if err != nil {
		return err
	}
	chain := middleware.Chain(middleware.Recover(), retry, middleware.Transaction{}.Middleware(middleware.Pool(db)), dedupe)(
		processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			tx, _ := middleware.CurrentTx(ctx)
			_, err := tx.ExecContext(ctx, insert, msg.ID, msg.Payload)
			return err
		}))

	var purged atomic.Int64
	purgeErr := make(chan error, 1)
	purgeCtx, stopPurge := context.WithCancel(ctx)
	defer stopPurge()
	if v == scalePurge {
		go func() {
			// One purge deletes every expired key in batches of 1000; there are millions, so it
			// runs for the whole measurement, and is stopped with it.
			res, err := full.Purge(purgeCtx, dedup.PurgeOptions{BatchSize: dedup.DefaultPurgeBatchSize})
			purged.Store(res.Deleted)
			if errors.Is(err, context.Canceled) {
				err = nil
			}
			purgeErr <- err
		}()
	} else {
		purgeErr <- nil
	}
	newID := watermill.NewUUID // random (version 4), as watermill makes them
	if v == scaleV7 {
		newID = func() string { return uuid.Must(uuid.NewV7()).String() }
	}
	start := time.Now()
	err = goLoop(ctx, db, c, dur, 0.15, &e.Entry, func(ctx context.Context) error {
		return chain.Process(ctx, &messagedata.MessageData{ID: newID(), Topic: "bench", Payload: payload})
	})
	stopPurge()
	if perr := <-purgeErr; perr != nil && err == nil {
		err = fmt.Errorf("purge: %w", perr)
	}
	if v == scalePurge {
		e.PurgedPerS = float64(int(float64(purged.Load()) / time.Since(start).Seconds()))
	}
	return err
}
