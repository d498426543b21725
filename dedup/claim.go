package dedup

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/sqltx"
	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/sqldb"
)

// This file claims a handler name for one topic, so that two handlers of one name on two topics
// do not share their dedup keys.

// ErrHandlerTopic reports a handler name that another process uses for another topic: the two
// would share duplicate-detection keys, so that a message of one topic could be taken for a
// duplicate of a message of the other and never applied.
var ErrHandlerTopic = errors.New("handler name used for two topics")

// handlersTable returns the name of the table that records which topic each handler of the
// store consumes: the store's table with "_handlers", within 63 characters.
func handlersTable(table string) string { return besideTable(table, "_handlers") }

// besideTable returns the name of a table that goes with table: table and suffix, within 63
// characters (PostgreSQL's limit), the end of a long table replaced by its hash.
func besideTable(table, suffix string) string {
	if len(table)+len(suffix) <= 63 {
		return table + suffix
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(table))
	return fmt.Sprintf("%s_%08x%s", table[:63-len(suffix)-9], h.Sum32(), suffix)
}

// ClaimHandler records that handler consumes topic, and fails with an error wrapping
// ErrHandlerTopic, naming both topics, when the store has recorded handler for another topic
// before. Keys are made of the handler name and the message id, not the topic: a handler name
// must stay with one topic. The router calls it for each handler when it starts. It creates
// its table if needed.
func (s *SQLStore) ClaimHandler(ctx context.Context, handler, topic string) error {
	if err := checkKey(Key{Handler: handler, MessageID: topic}); err != nil {
		return fmt.Errorf("dedup: claim handler: %w", err)
	}
	d := s.db.Dialect
	t := d.Quote(handlersTable(s.table))
	textType := "VARCHAR(255)"
	opts := ""
	if d == sqldb.MySQL {
		textType = "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
		opts = " ENGINE=InnoDB"
	}
	create := `CREATE TABLE IF NOT EXISTS ` + t + ` (
	handler    ` + textType + ` NOT NULL PRIMARY KEY,
	topic      ` + textType + ` NOT NULL,
	claimed_at BIGINT NOT NULL
)` + opts
	var insert string
	switch d {
	case sqldb.MySQL:
		insert = `INSERT INTO ` + t + ` (handler, topic, claimed_at) VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE handler = handler`
	default:
		insert = s.db.Rebind(`INSERT INTO ` + t + ` (handler, topic, claimed_at) VALUES (?, ?, ?) ON CONFLICT (handler) DO NOTHING`)
	}
	var lock func(*sqlx.Tx) error
	if d == sqldb.Postgres {
		lock = func(tx *sqlx.Tx) error {
			_, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+pgLockKey+`)`, "migrate", handlersTable(s.table))
			return err
		}
	}
	if err := sqltx.Exec(ctx, s.db, []string{create}, lock); err != nil {
		return fmt.Errorf("dedup: create table %s: %w", handlersTable(s.table), err)
	}
	if _, err := s.db.ExecContext(ctx, insert, handler, topic, s.now().UnixMicro()); err != nil {
		return fmt.Errorf("dedup: claim handler %s for topic %s: %w", textcol.Quote(handler), textcol.Quote(topic), err)
	}
	var recorded string
	if err := s.db.QueryRowxContext(ctx, s.db.Rebind(`SELECT topic FROM `+t+` WHERE handler = ?`), handler).Scan(&recorded); err != nil {
		return fmt.Errorf("dedup: read the topic of handler %s: %w", textcol.Quote(handler), err)
	}
	if recorded != topic {
		return fmt.Errorf("%w: handler %q consumes topic %q here, but topic %q in %s of %s; "+
			"give one of them another Handler.Name (renaming makes every message new to it), or delete its row from %s if the old topic is gone",
			ErrHandlerTopic, handler, topic, recorded, handlersTable(s.table), s.db, handlersTable(s.table))
	}
	return nil
}

// Claim is a handler name and the topic it consumes, as a router recorded it (ClaimHandler).
type Claim struct {
	Handler string
	Topic   string
	// ClaimedAt is when the handler was first claimed for the topic.
	ClaimedAt time.Time
}

// Handlers returns the handlers claimed in the store's database, by name: every handler that
// records keys in the table and has run. It returns none when no router has run on it yet.
func (s *SQLStore) Handlers(ctx context.Context) ([]Claim, error) {
	name := handlersTable(s.table)
	if exists, err := s.db.TableExists(ctx, name); err != nil || !exists {
		return nil, err
	}
	rows, err := s.db.QueryContext(ctx, `SELECT handler, topic, claimed_at FROM `+s.db.Dialect.Quote(name)+` ORDER BY handler`)
	if err != nil {
		return nil, fmt.Errorf("dedup: read the handlers of %s: %w", s.table, err)
	}
	defer rows.Close()
	var out []Claim
	for rows.Next() {
		var c Claim
		var at int64
		if err := rows.Scan(&c.Handler, &c.Topic, &at); err != nil {
			return nil, fmt.Errorf("dedup: read the handlers of %s: %w", s.table, err)
		}
		c.ClaimedAt = time.UnixMicro(at)
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dedup: read the handlers of %s: %w", s.table, err)
	}
	return out, nil
}
