package broker

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/sqldb"
)

// sqlView reads watermill-sql's tables of a topic in PostgreSQL or MySQL: the messages past the
// group's row in the offsets table, in the order the group's consumers read them. It takes no
// lock, so it never waits for a consumer that holds the group's row; remove deletes a
// message's row.
type sqlView struct {
	db      *sql.DB
	dialect sqldb.Dialect
	group   string
	topic   string
	schema  wsql.SchemaAdapter // decodes rows as the subscriber does
}

// pgPos locates a message of a PostgreSQL queue: its table's key.
type pgPos struct{ tx, offset int64 }

// tables returns the quoted names of the topic's messages and offsets tables, and whether each
// exists. Topics are checked by checkSQLTopic: they contain no quote.
func (v *sqlView) tables(ctx context.Context) (messages, offsets string, haveMessages, haveOffsets bool, err error) {
	if v.dialect == sqldb.Postgres {
		messages, offsets = `"watermill_`+v.topic+`"`, `"watermill_offsets_`+v.topic+`"`
		err = v.db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL`, messages, offsets).
			Scan(&haveMessages, &haveOffsets)
		return messages, offsets, haveMessages, haveOffsets, err
	}
	messages, offsets = "`watermill_"+v.topic+"`", "`watermill_offsets_"+v.topic+"`"
	rows, err := v.db.QueryContext(ctx, `SELECT table_name FROM information_schema.tables
		WHERE table_schema = DATABASE() AND table_name IN (?, ?)`, "watermill_"+v.topic, "watermill_offsets_"+v.topic)
	if err != nil {
		return messages, offsets, false, false, err
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			return messages, offsets, false, false, err
		}
		switch name {
		case "watermill_" + v.topic:
			haveMessages = true
		case "watermill_offsets_" + v.topic:
			haveOffsets = true
		}
	}
	return messages, offsets, haveMessages, haveOffsets, rows.Err()
}

func (v *sqlView) list(ctx context.Context, limit int) ([]entry, error) {
	messages, offsets, haveMessages, haveOffsets, err := v.tables(ctx)
	if err != nil {
		return nil, fmt.Errorf("look up the tables of topic %q: %w", v.topic, err)
	}
	if !haveMessages {
		return nil, nil
	}
	var query string
	var args []any
	switch {
	case v.dialect == sqldb.Postgres && haveOffsets:
		// The subscriber's order and position: (transaction_id, offset) past the group's row.
		query = `SELECT m."offset", m.transaction_id, m.uuid, m.payload, m.metadata FROM ` + messages + ` m
			WHERE NOT EXISTS (SELECT 1 FROM ` + offsets + ` g WHERE g.consumer_group = $1)
			OR EXISTS (SELECT 1 FROM ` + offsets + ` g WHERE g.consumer_group = $1
				AND (m.transaction_id, m."offset") > (g.last_processed_transaction_id, COALESCE(g.offset_acked, 0)))
			ORDER BY m.transaction_id, m."offset" LIMIT $2`
		args = []any{v.group, limit}
	case v.dialect == sqldb.Postgres:
		query = `SELECT "offset", transaction_id, uuid, payload, metadata FROM ` + messages +
			` ORDER BY transaction_id, "offset" LIMIT $1`
		args = []any{limit}
	case haveOffsets:
		query = "SELECT `offset`, `uuid`, `payload`, `metadata` FROM " + messages +
			" WHERE `offset` > COALESCE((SELECT offset_acked FROM " + offsets + " WHERE consumer_group = ?), 0)" +
			" ORDER BY `offset` LIMIT ?"
		args = []any{v.group, limit}
	default:
		query = "SELECT `offset`, `uuid`, `payload`, `metadata` FROM " + messages + " ORDER BY `offset` LIMIT ?"
		args = []any{limit}
	}
	rows, err := v.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("read topic %q: %w", v.topic, err)
	}
	defer func() { _ = rows.Close() }()
	var out []entry
	for rows.Next() {
		r, err := v.schema.UnmarshalMessage(rows)
		if err != nil {
			return nil, fmt.Errorf("read topic %q: %w", v.topic, err)
		}
		var pos any = r.Offset
		if v.dialect == sqldb.Postgres {
			tx, _ := r.ExtraData["transaction_id"].(int64)
			pos = pgPos{tx: tx, offset: r.Offset}
		}
		out = append(out, entry{msg: r.Msg, pos: pos})
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read topic %q: %w", v.topic, err)
	}
	return out, nil
}

func (v *sqlView) remove(ctx context.Context, e entry) error {
	var err error
	if p, ok := e.pos.(pgPos); ok {
		_, err = v.db.ExecContext(ctx, `DELETE FROM "watermill_`+v.topic+`" WHERE transaction_id = $1::text::xid8 AND "offset" = $2`,
			strconv.FormatInt(p.tx, 10), p.offset)
	} else {
		_, err = v.db.ExecContext(ctx, "DELETE FROM `watermill_"+v.topic+"` WHERE `offset` = ?", e.pos)
	}
	if err != nil {
		return fmt.Errorf("delete message %q from topic %q: %w", e.msg.UUID, v.topic, err)
	}
	return nil
}

func (v *sqlView) close() error { return nil }
