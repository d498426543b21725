package dedup

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// DefaultPositionsTable is the table of a Positions whose PositionsConfig names none.
const DefaultPositionsTable = "onceflow_positions"

// PositionsConfig configures Positions. The zero value is valid.
type PositionsConfig struct {
	// Table is the name of the positions table, a plain SQL identifier. Defaults to
	// DefaultPositionsTable.
	Table string
	// Now returns the current time. Defaults to time.Now.
	Now func() time.Time
}

// Positions records, for each handler and partition of an ordered log (a Kafka topic), the
// offset of the last message the handler applied, in the same transaction as the handler's
// writes. It takes the place of one dedup row per message where the broker delivers each
// partition in order: a message at or below the recorded offset is a duplicate, and a
// consumer that takes a partition over resumes after it. It is safe for concurrent use.
type Positions struct {
	db    *sqldb.DB
	table string
	now   func() time.Time
	lock  string // handler, topic, partition, now: upsert that locks the row
	read  string // handler, topic, partition (MySQL: after the upsert)
	set   string // offset, now, handler, topic, partition
	// advance: offset, now, handler, topic, partition, offset, previous: Set where the
	// position is below offset and at or above previous.
	advance string
	load    string // handler, topic
}

// NewPositions returns the Positions of db. It does not touch the database: call Migrate first.
func NewPositions(db *sqldb.DB, cfg PositionsConfig) (*Positions, error) {
	if db == nil || db.DB == nil {
		return nil, errors.New("dedup.NewPositions: db is nil")
	}
	if cfg.Table != "" {
		if err := sqldb.CheckIdentifier("Table", cfg.Table); err != nil {
			return nil, fmt.Errorf("dedup.NewPositions: %w", err)
		}
	}
	p := &Positions{db: db, table: cmp.Or(cfg.Table, DefaultPositionsTable), now: cfg.Now}
	if p.now == nil {
		p.now = time.Now
	}
	t := db.Dialect.Quote(p.table)
	where := ` WHERE handler = ? AND topic = ? AND partition_id = ?`
	switch db.Dialect {
	case sqldb.Postgres:
		p.lock = `INSERT INTO ` + t + ` AS p (handler, topic, partition_id, applied, updated_at) VALUES ($1, $2, $3, -1, $4)
ON CONFLICT (handler, topic, partition_id) DO UPDATE SET applied = p.applied RETURNING p.applied`
	case sqldb.SQLite:
		p.lock = `INSERT INTO ` + t + ` (handler, topic, partition_id, applied, updated_at) VALUES (?1, ?2, ?3, -1, ?4)
ON CONFLICT (handler, topic, partition_id) DO UPDATE SET applied = applied RETURNING applied`
	case sqldb.MySQL:
		p.lock = `INSERT INTO ` + t + ` (handler, topic, partition_id, applied, updated_at) VALUES (?, ?, ?, -1, ?)
ON DUPLICATE KEY UPDATE applied = applied`
		p.read = `SELECT applied FROM ` + t + where + ` FOR UPDATE`
	default:
		return nil, fmt.Errorf("dedup.NewPositions: db.Dialect: unsupported dialect %q (want postgres, mysql or sqlite)", db.Dialect)
	}
	p.set = db.Rebind(`UPDATE ` + t + ` SET applied = ?, updated_at = ?` + where)
	p.advance = db.Rebind(`UPDATE ` + t + ` SET applied = ?, updated_at = ?` + where + ` AND applied < ? AND applied >= ?`)
	p.load = db.Rebind(`SELECT partition_id, applied FROM ` + t + ` WHERE handler = ? AND topic = ? AND applied >= 0`)
	return p, nil
}

// Table returns the name of the positions table.
func (p *Positions) Table() string { return p.table }

// Migrate creates the table if it does not exist. It is idempotent.
func (p *Positions) Migrate(ctx context.Context) error {
	err := createSmallTable(ctx, p.db, p.table, func(idType string) string {
		return `handler      ` + idType + ` NOT NULL,
	topic        ` + idType + ` NOT NULL,
	partition_id INTEGER NOT NULL,
	applied      BIGINT NOT NULL,
	updated_at   BIGINT NOT NULL,
	PRIMARY KEY (handler, topic, partition_id)`
	})
	if err != nil {
		return fmt.Errorf("dedup: migrate positions table %s: %w", p.table, err)
	}
	return nil
}

// Lock takes, in tx, the position of handler in partition of topic, and returns the offset
// of the last message applied there, -1 when none. The row stays locked until tx ends: a
// second consumer of the partition (the one it moved to at a rebalance) waits for tx, then
// sees what tx recorded, so no offset is applied twice.
func (p *Positions) Lock(ctx context.Context, tx sqlx.ExtContext, handler, topic string, partition int32) (int64, error) {
	if err := checkValue("handler", handler, MaxHandlerLen); err != nil {
		return 0, err
	}
	if err := checkValue("topic", topic, 255); err != nil {
		return 0, err
	}
	now := p.now().UnixMicro()
	var applied int64
	var err error
	if p.read == "" {
		err = tx.QueryRowxContext(ctx, p.lock, handler, topic, partition, now).Scan(&applied)
	} else if _, err = tx.ExecContext(ctx, p.lock, handler, topic, partition, now); err == nil {
		err = tx.QueryRowxContext(ctx, p.read, handler, topic, partition).Scan(&applied)
	}
	if err != nil {
		return 0, fmt.Errorf("dedup: lock the position of %s in %s/%d (%s): %w", textcol.Quote(handler), textcol.Quote(topic), partition, p.table, err)
	}
	return applied, nil
}

// Set records offset, in tx, as the last applied by handler in partition of topic. Call it
// after Lock, in the same transaction.
func (p *Positions) Set(ctx context.Context, tx sqlx.ExtContext, handler, topic string, partition int32, offset int64) error {
	r, err := tx.ExecContext(ctx, p.set, offset, p.now().UnixMicro(), handler, topic, partition)
	if err == nil {
		var n int64
		if n, err = r.RowsAffected(); err == nil && n != 1 {
			err = fmt.Errorf("%d rows updated, want 1 (Set without Lock?)", n)
		}
	}
	if err != nil {
		return fmt.Errorf("dedup: set the position of %s in %s/%d to %d (%s): %w", textcol.Quote(handler), textcol.Quote(topic), partition, offset, p.table, err)
	}
	return nil
}

// Advance records offset, in tx, as the last applied by handler in partition of topic, and
// locks the position until tx ends, if the offset recorded there is below offset and at or
// above previous: the next message of the partition, when nothing before it is left
// unapplied. It reports whether it did; when it did not (the position is missing, or at or
// above offset, or below previous), nothing changed, and Lock tells why. It is Lock and Set in
// one statement, for the common case.
func (p *Positions) Advance(ctx context.Context, tx sqlx.ExtContext, handler, topic string, partition int32, offset, previous int64) (bool, error) {
	r, err := tx.ExecContext(ctx, p.advance, offset, p.now().UnixMicro(), handler, topic, partition, offset, previous)
	var n int64
	if err == nil {
		n, err = r.RowsAffected()
	}
	if err != nil {
		return false, fmt.Errorf("dedup: advance the position of %s in %s/%d to %d (%s): %w", textcol.Quote(handler), textcol.Quote(topic), partition, offset, p.table, err)
	}
	return n == 1, nil
}

// Load returns, for each partition of topic where handler applied a message, the offset of
// the last one: where a consumer that takes the partition over resumes (after it).
func (p *Positions) Load(ctx context.Context, handler, topic string) (map[int32]int64, error) {
	rows, err := p.db.QueryContext(ctx, p.load, handler, topic)
	if err != nil {
		return nil, fmt.Errorf("dedup: load the positions of %s in %s (%s): %w", textcol.Quote(handler), textcol.Quote(topic), p.table, err)
	}
	defer rows.Close()
	out := map[int32]int64{}
	for rows.Next() {
		var part int32
		var applied int64
		if err := rows.Scan(&part, &applied); err != nil {
			return nil, fmt.Errorf("dedup: load the positions of %s in %s (%s): %w", textcol.Quote(handler), textcol.Quote(topic), p.table, err)
		}
		out[part] = applied
	}
	if err := rows.Err(); err != nil && !errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("dedup: load the positions of %s in %s (%s): %w", textcol.Quote(handler), textcol.Quote(topic), p.table, err)
	}
	return out, nil
}

// PositionOf returns the position of msg in its partition, which duplicate detection by offset
// keeps, or a permanent error (processor.Permanent) for a message that has none: its broker has
// no partitions.
func PositionOf(msg *messagedata.MessageData) (messagedata.Position, error) {
	pos, ok, err := messagedata.PositionOf(msg)
	switch {
	case err != nil:
		return pos, processor.Permanent(fmt.Errorf("message position: %w", err))
	case !ok:
		return pos, processor.Permanent(fmt.Errorf("message has no position in an ordered log (headers %s and %s are empty): duplicate detection by offsets needs a broker with partitions",
			messagedata.HeaderPartition, messagedata.HeaderOffset))
	}
	return pos, nil
}
