// Package ordercheck verifies per-key ordering by its effects: a processor records every
// message it applies as a row of an "applied" table, whose auto-increment id gives the order
// of application, and Tally counts, per key, the sequences that are missing, applied more than
// once, or applied after a later sequence of the same key.
//
// The id order is the application order within a key because the in-order interceptor holds
// the key's lock from before the processor runs until the commit: the next transaction of the
// key allocates its ids after that commit.
package ordercheck

import (
	"context"
	"fmt"
	"sort"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/sqldb"
)

// Create creates the applied table if it is missing. table must be a plain identifier.
func Create(ctx context.Context, db *sqldb.DB, table string) error {
	if err := sqldb.CheckIdentifier("table", table); err != nil {
		return err
	}
	id := map[sqldb.Dialect]string{
		sqldb.Postgres: "BIGSERIAL PRIMARY KEY",
		sqldb.MySQL:    "BIGINT AUTO_INCREMENT PRIMARY KEY",
		sqldb.SQLite:   "INTEGER PRIMARY KEY AUTOINCREMENT",
	}[db.Dialect]
	t := db.Dialect.Quote(table)
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+t+` (
	id         `+id+`,
	run_id     VARCHAR(64)  NOT NULL,
	order_key  VARCHAR(255) NOT NULL,
	seq        BIGINT       NOT NULL,
	message_id VARCHAR(255) NOT NULL,
	consumer   INTEGER      NOT NULL)`); err != nil {
		return fmt.Errorf("create %s: %w", table, err)
	}
	return nil
}

// Record inserts one applied message in tx, the transaction of its processing.
func Record(ctx context.Context, tx sqlx.ExtContext, table, run, key string, seq uint64, messageID string, consumer int) error {
	_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO `+table+` (run_id, order_key, seq, message_id, consumer) VALUES (?, ?, ?, ?, ?)`),
		run, key, int64(seq), messageID, consumer)
	return err
}

// Result is what Tally found.
type Result struct {
	Keys       int `json:"keys"`         // keys expected
	Expected   int `json:"expected"`     // (key, sequence) pairs expected
	Applied    int `json:"applied"`      // rows recorded
	Missing    int `json:"missing"`      // expected pairs without a row
	Duplicated int `json:"duplicated"`   // rows beyond the first of a pair
	OutOfOrder int `json:"out_of_order"` // rows applied after a higher sequence of their key
	Unexpected int `json:"unexpected"`   // rows of a key or sequence not expected
	// First describes the first violation found, for failure messages; empty when OK.
	First string `json:"first_violation,omitempty"`
	// Late are the rows counted in OutOfOrder, in the order of application.
	Late []Late `json:"late,omitempty"`
}

// Late is a message applied after a later sequence of its key.
type Late struct {
	MessageID string `json:"message_id"`
	Key       string `json:"key"`
	Seq       int64  `json:"seq"`
	// After is the highest sequence of the key applied before it.
	After int64 `json:"after"`
}

// OK reports whether every expected sequence was applied once, in order, and nothing else.
func (r Result) OK() bool {
	return r.Missing == 0 && r.Duplicated == 0 && r.OutOfOrder == 0 && r.Unexpected == 0
}

// Progress returns the number of distinct expected pairs applied so far.
func (r Result) Progress() int { return r.Expected - r.Missing }

// Row is one applied message.
type Row struct {
	ID        int64  `db:"id"`
	Key       string `db:"order_key"`
	Seq       int64  `db:"seq"`
	MessageID string `db:"message_id"`
}

// Tally reads the rows of run and checks them against want: every key of want must have the
// sequences 1..want[key], each applied once, in increasing order of id.
func Tally(ctx context.Context, db *sqldb.DB, table, run string, want map[string]uint64) (Result, error) {
	var rows []Row
	if err := db.SelectContext(ctx, &rows, db.Rebind(`SELECT id, order_key, seq, message_id FROM `+db.Dialect.Quote(table)+` WHERE run_id = ?`), run); err != nil {
		return Result{}, fmt.Errorf("read %s: %w", table, err)
	}
	return Check(rows, want), nil
}

// Check is Tally on rows already read.
func Check(rows []Row, want map[string]uint64) Result {
	sort.Slice(rows, func(i, j int) bool { return rows[i].ID < rows[j].ID })
	r := Result{Keys: len(want), Applied: len(rows)}
	for _, n := range want {
		r.Expected += int(n)
	}
	note := func(format string, args ...any) {
		if r.First == "" {
			r.First = fmt.Sprintf(format, args...)
		}
	}
	type keyState struct {
		seen map[int64]bool
		max  int64
	}
	keys := map[string]*keyState{}
	for _, row := range rows {
		n, ok := want[row.Key]
		if !ok || row.Seq < 1 || uint64(row.Seq) > n {
			r.Unexpected++
			note("unexpected row: key %q sequence %d (id %d)", row.Key, row.Seq, row.ID)
			continue
		}
		ks := keys[row.Key]
		if ks == nil {
			ks = &keyState{seen: map[int64]bool{}}
			keys[row.Key] = ks
		}
		switch {
		case ks.seen[row.Seq]:
			r.Duplicated++
			note("key %q: sequence %d applied twice (again at id %d)", row.Key, row.Seq, row.ID)
		case row.Seq < ks.max:
			r.OutOfOrder++
			r.Late = append(r.Late, Late{MessageID: row.MessageID, Key: row.Key, Seq: row.Seq, After: ks.max})
			note("key %q: sequence %d applied after sequence %d (id %d)", row.Key, row.Seq, ks.max, row.ID)
		}
		ks.seen[row.Seq] = true
		ks.max = max(ks.max, row.Seq)
	}
	for key, n := range want {
		ks := keys[key]
		for seq := int64(1); seq <= int64(n); seq++ {
			if ks == nil || !ks.seen[seq] {
				r.Missing++
				note("key %q: sequence %d never applied", key, seq)
			}
		}
	}
	return r
}
