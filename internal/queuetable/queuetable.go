// Package queuetable is the storage format of the embedded SQLite queue: the names of a topic's
// tables, their schema, and the watermill-sql adapters over them. broker/sqlitequeue, the
// queue, and the outbox on SQLite, which writes its messages in the same form for its relay to
// read, share it; neither links the other.
package queuetable

import (
	"bytes"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Table and index name prefixes. SQLite keeps tables and indexes in one namespace; the prefixes
// differ from one another before any of them ends, so no name made for one topic can be a name
// made for another.
const (
	MessagesPrefix = "onceflow_queue_"
	OffsetsPrefix  = "onceflow_offsets_"
	LeasesPrefix   = "onceflow_leases_"
	DueIndexPrefix = "onceflow_due_"
	ClaimsPrefix   = "onceflow_claims_"
)

// MaxClaimSpan bounds the offsets one row of a claims table covers, from its first_offset to
// its last_offset: its settled bitmap is an INTEGER, 63 bits that SQLite's bit operators keep
// positive.
const MaxClaimSpan = 63

// DefaultBatchSize is the number of messages SchemaAdapter.SelectQuery reads at once when
// SchemaAdapter.BatchSize is zero, and the default window of the queue's subscriptions.
const DefaultBatchSize = 16

// MaxTopicLength bounds topic names, which become part of table names.
const MaxTopicLength = 200

// topicPattern is the set of topic names the queue accepts: the characters watermill-sql
// allows, and at least one of them.
var topicPattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

// ErrInvalidTopic reports a topic name the queue cannot store.
var ErrInvalidTopic = errors.New("sqlitequeue: invalid topic name")

// CheckTopic reports whether topic can name a queue topic: 1 to 200 characters, each a letter,
// digit, '-', '$', ':', '.' or '_'. The error wraps ErrInvalidTopic and names the topic.
func CheckTopic(topic string) error {
	if len(topic) > MaxTopicLength {
		return fmt.Errorf("%w: %q is longer than %d characters", ErrInvalidTopic, topic, MaxTopicLength)
	}
	if !topicPattern.MatchString(topic) {
		return fmt.Errorf("%w: %q must be 1 to %d letters, digits, '-', '$', ':', '.' or '_'", ErrInvalidTopic, topic, MaxTopicLength)
	}
	return nil
}

// Suffix maps a valid topic to the part of its table names after the prefix. SQLite
// compares identifiers case-insensitively, so an upper-case letter X becomes "^x": "Orders" and
// "orders" get different tables. '^' cannot occur in a topic, so the mapping is one-to-one.
func Suffix(topic string) string {
	if strings.IndexFunc(topic, isUpper) < 0 {
		return topic
	}
	var b strings.Builder
	for _, r := range topic {
		if isUpper(r) {
			b.WriteByte('^')
			r += 'a' - 'A'
		}
		b.WriteRune(r)
	}
	return b.String()
}

// TopicOfSuffix inverts Suffix.
func TopicOfSuffix(s string) string {
	if !strings.Contains(s, "^") {
		return s
	}
	var b strings.Builder
	upper := false
	for _, r := range s {
		switch {
		case r == '^':
			upper = true
			continue
		case upper && r >= 'a' && r <= 'z':
			r -= 'a' - 'A'
		}
		upper = false
		b.WriteRune(r)
	}
	return b.String()
}

func isUpper(r rune) bool { return r >= 'A' && r <= 'Z' }

// Quote returns name as a quoted SQLite identifier. Names made from valid topics contain no
// '"', but Quote doubles it anyway so that no name can end the quoting.
func Quote(name string) string { return `"` + strings.ReplaceAll(name, `"`, `""`) + `"` }

// MessagesTable returns the unquoted name of topic's messages table: "onceflow_queue_" and the
// topic, with each upper-case letter X written "^x" (SQLite table names ignore case).
func MessagesTable(topic string) string { return MessagesPrefix + Suffix(topic) }

// OffsetsTable returns the unquoted name of topic's offsets table: "onceflow_offsets_" and the
// topic, spelled as in MessagesTable.
func OffsetsTable(topic string) string { return OffsetsPrefix + Suffix(topic) }

// LeasesTable returns the unquoted name of topic's leases table: "onceflow_leases_" and the
// topic, spelled as in MessagesTable.
func LeasesTable(topic string) string { return LeasesPrefix + Suffix(topic) }

// ClaimsTable returns the unquoted name of topic's claims table: "onceflow_claims_" and the
// topic, spelled as in MessagesTable.
func ClaimsTable(topic string) string { return ClaimsPrefix + Suffix(topic) }

// LeasesSchema returns the statements that create topic's leases table, its index of due
// leases and its claims table, if missing:
//
//	"onceflow_leases_<topic>" (
//	    consumer_group TEXT    NOT NULL,
//	    "offset"       INTEGER NOT NULL,  -- of the message in "onceflow_queue_<topic>"
//	    deliveries     INTEGER NOT NULL,  -- how many times the group has been handed the message
//	    visible_at     INTEGER NOT NULL,  -- Unix milliseconds from which the lease may be claimed
//	    PRIMARY KEY (consumer_group, "offset")
//	)
//
// with the index "onceflow_due_<topic>" on (consumer_group, visible_at), and
//
//	"onceflow_claims_<topic>" (
//	    consumer_group TEXT    NOT NULL,
//	    first_offset   INTEGER NOT NULL,
//	    last_offset    INTEGER NOT NULL,  -- at most MaxClaimSpan-1 after first_offset
//	    visible_at     INTEGER NOT NULL,  -- Unix milliseconds at which the claim expires
//	    settled        INTEGER NOT NULL,  -- bit i set: the claim no longer holds first_offset+i
//	    PRIMARY KEY (consumer_group, first_offset)
//	)
//
// A row of the leases table is a message that its consumer group has claimed (its offset is at
// or below the group's cursor in the offsets table) and not acknowledged. A row of the claims
// table is a run of messages that the group claimed in one go, each for the first time: every
// offset from first_offset to last_offset whose bit in settled is clear is leased by it, with a
// delivery count of 1, until visible_at. Leased gives the condition that covers both.
func LeasesSchema(topic string) []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + Quote(LeasesTable(topic)) + ` (
	consumer_group TEXT    NOT NULL,
	"offset"       INTEGER NOT NULL,
	deliveries     INTEGER NOT NULL,
	visible_at     INTEGER NOT NULL,
	PRIMARY KEY (consumer_group, "offset")
) WITHOUT ROWID`,
		`CREATE INDEX IF NOT EXISTS ` + Quote(DueIndexPrefix+Suffix(topic)) + ` ON ` +
			Quote(LeasesTable(topic)) + ` (consumer_group, visible_at)`,
		`CREATE TABLE IF NOT EXISTS ` + Quote(ClaimsTable(topic)) + ` (
	consumer_group TEXT    NOT NULL,
	first_offset   INTEGER NOT NULL,
	last_offset    INTEGER NOT NULL,
	visible_at     INTEGER NOT NULL,
	settled        INTEGER NOT NULL,
	PRIMARY KEY (consumer_group, first_offset)
) WITHOUT ROWID`,
	}
}

// Leased returns the SQL condition that the message at offset, an SQL expression (such as a
// column of the messages table), is leased: it has a row in topic's leases table, or an
// unsettled place in a row of its claims table. group is a placeholder ("?", "?1") for the
// consumer group, which then appears twice in the condition, or empty for any group.
func Leased(topic, offset, group string) string {
	inGroup, claimInGroup := ``, ``
	if group != "" {
		inGroup = ` WHERE consumer_group = ` + group
		claimInGroup = `c.consumer_group = ` + group + ` AND `
	}
	return `(` + offset + ` IN (SELECT "offset" FROM ` + Quote(LeasesTable(topic)) + inGroup + `)
	OR EXISTS (SELECT 1 FROM ` + Quote(ClaimsTable(topic)) + ` AS c WHERE ` + claimInGroup +
		`c.first_offset BETWEEN ` + offset + ` - ` + strconv.Itoa(MaxClaimSpan-1) + ` AND ` + offset +
		` AND ` + offset + ` <= c.last_offset AND ((c.settled >> (` + offset + ` - c.first_offset)) & 1) = 0))`
}

// SchemaAdapter is the watermill-sql SchemaAdapter of the queue. Each topic has a table
//
//	"onceflow_queue_<topic>" (
//	    "offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
//	    uuid       TEXT NOT NULL,
//	    payload    BLOB,
//	    metadata   TEXT,   -- JSON object
//	    created_at TEXT NOT NULL  -- UTC, RFC 3339 with milliseconds
//	)
//
// AUTOINCREMENT never reuses an offset, even after rows are deleted, and SQLite runs one write
// transaction at a time, so offsets become visible in increasing order: a consumer that has
// seen offset n will never later find a new message below n. That is what lets a consumer
// group keep a single offset: the queue's cursor, or watermill-sql's acknowledged offset.
//
// The queue's Publisher writes through InsertQuery; its Subscriber reads the tables itself,
// without watermill-sql. The adapter is for watermill-sql subscribers over tables of this
// form (onceflow's outbox relay on SQLite keeps its outbox so).
//
// Topics must pass CheckTopic; callers of the queue's Publisher and Subscriber get that check
// for free. Table names are always quoted.
type SchemaAdapter struct {
	// BatchSize is the number of messages SelectQuery reads at once. Defaults to 16.
	BatchSize int
}

var _ wsql.SchemaAdapter = SchemaAdapter{}

// InsertChunk is the number of rows one INSERT statement carries: three parameters each, well
// under SQLite's limit of 32766 parameters.
const InsertChunk = 1000

// SchemaInitializingQueries returns the CREATE TABLE IF NOT EXISTS statement of topic's
// messages table.
func (s SchemaAdapter) SchemaInitializingQueries(topic string) []wsql.Query {
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + Quote(MessagesTable(topic)) + ` (
	"offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
	uuid       TEXT NOT NULL,
	payload    BLOB,
	metadata   TEXT,
	created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
)`}}
}

// InsertQuery returns one INSERT of msgs into topic's table, in their order. It fails for more
// than 1000 messages; the queue's Publisher splits larger calls.
func (s SchemaAdapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	if len(msgs) == 0 || len(msgs) > InsertChunk {
		return wsql.Query{}, fmt.Errorf("sqlitequeue: insert of %d messages (want 1 to %d)", len(msgs), InsertChunk)
	}
	args := make([]any, 0, 3*len(msgs))
	for _, msg := range msgs {
		metadata, err := json.Marshal(msg.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("sqlitequeue: marshal metadata of message %s: %w", msg.UUID, err)
		}
		args = append(args, msg.UUID, []byte(msg.Payload), string(metadata))
	}
	q := `INSERT INTO ` + Quote(MessagesTable(topic)) + ` (uuid, payload, metadata) VALUES ` +
		strings.TrimSuffix(strings.Repeat("(?, ?, ?), ", len(msgs)), ", ")
	return wsql.Query{Query: q, Args: args}, nil
}

func (s SchemaAdapter) batchSize() int {
	if s.BatchSize <= 0 {
		return DefaultBatchSize
	}
	return s.BatchSize
}

// SelectQuery returns the query for the next batch of consumerGroup: the messages after the
// offset that offsetsAdapter reports, in offset order.
func (s SchemaAdapter) SelectQuery(topic, consumerGroup string, offsetsAdapter wsql.OffsetsAdapter) wsql.Query {
	next := offsetsAdapter.NextOffsetQuery(topic, consumerGroup)
	q := `SELECT "offset", uuid, payload, metadata FROM ` + Quote(MessagesTable(topic)) +
		` WHERE "offset" > (` + next.Query + `) ORDER BY "offset" LIMIT ` + strconv.Itoa(s.batchSize())
	return wsql.Query{Query: q, Args: next.Args}
}

// UnmarshalMessage turns a row of SelectQuery into a message.
func (s SchemaAdapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	var r wsql.Row
	if err := row.Scan(&r.Offset, &r.UUID, &r.Payload, &r.Metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("sqlitequeue: scan message row: %w", err)
	}
	msg, err := NewMessage(string(r.UUID), r.Payload, r.Metadata)
	if err != nil {
		return wsql.Row{}, fmt.Errorf("sqlitequeue: message at offset %d: %w", r.Offset, err)
	}
	r.Msg = msg
	return r, nil
}

// SubscribeIsolationLevel returns sql.LevelDefault: SQLite transactions are always
// serializable, and the queue's transactions begin with BEGIN IMMEDIATE.
func (s SchemaAdapter) SubscribeIsolationLevel() sql.IsolationLevel { return sql.LevelDefault }

// NewMessage makes the message of a stored row whose metadata column (nil for NULL) is a JSON
// object of strings, as watermill-sql's publishers and the queue's write it; the SQL queue
// (broker/sqlqueue) reads its rows with it too. A value that is not a string (written by
// another producer) is kept as its JSON text, null as "". Its error reports metadata that is
// not a JSON object; the message then has no metadata.
func NewMessage(uuid string, payload, metadata []byte) (*message.Message, error) {
	msg := message.NewMessage(uuid, payload)
	if trimmed := bytes.TrimSpace(metadata); len(trimmed) == 0 || bytes.Equal(trimmed, []byte("null")) {
		return msg, nil
	}
	// The usual column, an object of strings, in one pass.
	if json.Unmarshal(metadata, &msg.Metadata) == nil {
		return msg, nil
	}
	clear(msg.Metadata)
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(metadata, &fields); err != nil {
		return msg, fmt.Errorf("metadata %q is not a JSON object: %w", truncate(string(metadata), 80), err)
	}
	for k, raw := range fields {
		var v string // null leaves it empty
		if err := json.Unmarshal(raw, &v); err != nil {
			v = string(raw)
		}
		msg.Metadata[k] = v
	}
	return msg, nil
}

// truncate shortens s to at most n bytes for an error message.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// OffsetsAdapter is the watermill-sql OffsetsAdapter of the queue. Each topic has a table
//
//	"onceflow_offsets_<topic>" (consumer_group TEXT PRIMARY KEY, offset_acked INTEGER NOT NULL)
//
// with one row per consumer group. For a watermill-sql subscriber it is the offset of the last
// message the group acknowledged. The queue's own Subscriber keeps its cursor there instead:
// every offset at or below it is acknowledged or has a lease (see Queue.Subscriber), so the
// acknowledged offset of a file written before the queue had leases is a valid cursor.
//
// It takes no row locks, because SQLite has none: consumers of one group are kept apart by the
// subscriber's transaction, which begins with BEGIN IMMEDIATE and so holds the database's write
// lock from before it reads the offset until it has written the new one.
type OffsetsAdapter struct{}

var _ wsql.OffsetsAdapter = OffsetsAdapter{}

// SchemaInitializingQueries returns the CREATE TABLE IF NOT EXISTS statement of topic's offsets
// table.
func (OffsetsAdapter) SchemaInitializingQueries(topic string) []wsql.Query {
	return []wsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + Quote(OffsetsTable(topic)) + ` (
	consumer_group TEXT NOT NULL PRIMARY KEY,
	offset_acked   INTEGER NOT NULL DEFAULT 0
)`}}
}

// NextOffsetQuery returns the query for consumerGroup's acknowledged offset, 0 if it has none.
func (OffsetsAdapter) NextOffsetQuery(topic, consumerGroup string) wsql.Query {
	return wsql.Query{
		Query: `SELECT COALESCE((SELECT offset_acked FROM ` + Quote(OffsetsTable(topic)) + ` WHERE consumer_group = ?), 0)`,
		Args:  []any{consumerGroup},
	}
}

// AckMessageQuery returns the upsert that records row's offset as consumerGroup's acknowledged
// offset. The offset never moves backwards.
func (OffsetsAdapter) AckMessageQuery(topic string, row wsql.Row, consumerGroup string) wsql.Query {
	return wsql.Query{
		Query: `INSERT INTO ` + Quote(OffsetsTable(topic)) + ` (consumer_group, offset_acked) VALUES (?, ?)
ON CONFLICT (consumer_group) DO UPDATE SET offset_acked = max(offset_acked, excluded.offset_acked)`,
		Args: []any{consumerGroup, row.Offset},
	}
}

// ConsumedMessageQuery returns no query: the write lock already keeps consumers apart.
func (OffsetsAdapter) ConsumedMessageQuery(topic string, row wsql.Row, consumerGroup string, consumerULID []byte) wsql.Query {
	return wsql.Query{}
}

// BeforeSubscribingQueries returns no query. (The queue's Subscriber records a new consumer
// group itself, and only when it is missing, so that subscribing to a topic whose tables and
// group exist needs no write lock.)
func (OffsetsAdapter) BeforeSubscribingQueries(topic, consumerGroup string) []wsql.Query {
	return nil
}
