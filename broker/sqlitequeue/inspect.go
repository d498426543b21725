package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/internal/queuetable"
)

// The inspection methods read the last committed state (see Concurrency in the package
// documentation). A message that a consumer group has leased (delivered, or nacked and waiting
// for its delay) counts as waiting for the group, like one after the group's cursor.

// Record is a message stored in the queue, with its place in the topic.
type Record struct {
	// Offset is the message's position in its topic: offsets increase in publishing order and
	// are never reused.
	Offset int64
	// CreatedAt is when the message was stored, in UTC with millisecond precision.
	CreatedAt time.Time
	// Message is the stored message, as a subscriber would receive it.
	Message *message.Message
}

// Topics returns the topics that have tables in the queue file, sorted.
func (q *Queue) Topics(ctx context.Context) ([]string, error) {
	if q.life.Closed() {
		return nil, ErrClosed
	}
	var names, topics []string
	if err := q.db.SelectContext(ctx, &names, `SELECT name FROM sqlite_schema WHERE type = 'table'`); err != nil {
		return nil, fmt.Errorf("sqlitequeue: list topics: %w", err)
	}
	for _, name := range names {
		if suffix, ok := strings.CutPrefix(name, queuetable.MessagesPrefix); ok {
			topics = append(topics, queuetable.TopicOfSuffix(suffix))
		}
	}
	slices.Sort(topics)
	return topics, nil
}

// Len returns the number of messages stored on topic, consumed or not; 0 for a topic that has
// never been used.
func (q *Queue) Len(ctx context.Context, topic string) (int64, error) {
	return q.count(ctx, topic, "", false)
}

// Backlog returns the number of messages of topic that consumerGroup has not acknowledged yet:
// those it has leased and those after its cursor. For a group that has never consumed topic,
// that is every message on it.
func (q *Queue) Backlog(ctx context.Context, topic, consumerGroup string) (int64, error) {
	return q.count(ctx, topic, consumerGroup, true)
}

func (q *Queue) count(ctx context.Context, topic, group string, waiting bool) (int64, error) {
	t, err := q.inspectTables(ctx, topic)
	if err != nil || !t.exist() {
		return 0, err
	}
	var n int64
	query := `SELECT count(*) FROM ` + quote(MessagesTable(topic)) + ` WHERE ` + t.where(topic, waiting)
	if err := q.db.QueryRowContext(ctx, query, group, 0).Scan(&n); err != nil {
		return 0, fmt.Errorf("sqlitequeue: count messages of topic %q: %w", topic, err)
	}
	return n, nil
}

// List returns up to limit messages of topic with offsets greater than after, in offset order.
// Pass 0 to start at the beginning and the last returned Offset to page on.
func (q *Queue) List(ctx context.Context, topic string, after int64, limit int) ([]Record, error) {
	return q.list(ctx, topic, "", false, after, limit)
}

// Waiting returns up to limit of the messages of topic that wait for consumerGroup, with
// offsets greater than after, in offset order: those Backlog counts. Pass 0 to start at the
// beginning and the last returned Offset to page on.
func (q *Queue) Waiting(ctx context.Context, topic, consumerGroup string, after int64, limit int) ([]Record, error) {
	return q.list(ctx, topic, consumerGroup, true, after, limit)
}

func (q *Queue) list(ctx context.Context, topic, group string, waiting bool, after int64, limit int) ([]Record, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("sqlitequeue: list topic %q: limit %d is not positive", topic, limit)
	}
	t, err := q.inspectTables(ctx, topic)
	if err != nil || !t.exist() {
		return nil, err
	}
	type stored struct {
		offset            int64
		uuid, createdAt   string
		payload, metadata []byte
	}
	result, err := q.db.QueryContext(ctx, `SELECT "offset", uuid, payload, metadata, created_at FROM `+
		quote(MessagesTable(topic))+` WHERE `+t.where(topic, waiting)+` ORDER BY "offset" LIMIT ?3`, group, after, limit)
	rows, err := dbqueue.Rows(result, err, func(s *stored) []any { return []any{&s.offset, &s.uuid, &s.payload, &s.metadata, &s.createdAt} })
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: list topic %q: %w", topic, err)
	}
	out := make([]Record, len(rows))
	for i, s := range rows {
		out[i].Offset = s.offset
		if out[i].Message, err = queuetable.NewMessage(s.uuid, s.payload, s.metadata); err != nil {
			return nil, fmt.Errorf("sqlitequeue: topic %q, offset %d: %w", topic, s.offset, err)
		}
		if out[i].CreatedAt, err = time.Parse(time.RFC3339Nano, s.createdAt); err != nil {
			return nil, fmt.Errorf("sqlitequeue: topic %q, offset %d: created_at %q: %w", topic, s.offset, s.createdAt, err)
		}
	}
	return out, nil
}

// Delete removes the message at offset from topic, for every consumer group, and reports
// whether it was there. A message that a consumer holds is removed too: the consumer's
// acknowledgement or nack of it then does nothing, and it is never delivered again.
func (q *Queue) Delete(ctx context.Context, topic string, offset int64) (bool, error) {
	t, err := q.inspectTables(ctx, topic)
	if err != nil || !t.exist() {
		return false, err
	}
	var n int64
	err = q.write(ctx, func(tx *sql.Tx) error {
		if n, err = dbqueue.Affected(tx.ExecContext(ctx, `DELETE FROM `+quote(MessagesTable(topic))+` WHERE "offset" = ?`, offset)); err != nil {
			return err
		}
		if t.leases {
			_, err = tx.ExecContext(ctx, `DELETE FROM `+quote(queuetable.LeasesTable(topic))+` WHERE "offset" = ?`, offset)
		}
		if err == nil && t.claims {
			_, err = tx.ExecContext(ctx, `UPDATE `+quote(queuetable.ClaimsTable(topic))+` SET settled = settled | (1 << (?1 - first_offset))
WHERE first_offset BETWEEN ?1 - `+strconv.Itoa(queuetable.MaxClaimSpan-1)+` AND ?1 AND last_offset >= ?1`, offset)
		}
		return err
	})
	if err != nil {
		return false, fmt.Errorf("sqlitequeue: delete offset %d of topic %q: %w", offset, topic, err)
	}
	return n == 1, nil
}

// Trim is broker.Broker.Trim of topic: it deletes, in transactions of at most dbqueue.TrimBatch
// rows, the messages at or below the cursor of every group that has subscribed to topic and
// leased by none, nothing when no group has, and returns how many. A topic that has no tables
// is an error wrapping broker.ErrNotFound.
func (q *Queue) Trim(ctx context.Context, topic string) (int64, error) {
	t, err := q.existingTables(ctx, topic)
	if err != nil {
		return 0, err
	}
	leased := ``
	if t.all() {
		leased = ` AND NOT ` + queuetable.Leased(topic, `"offset"`, ``)
	} else if t.leases {
		leased = ` AND "offset" NOT IN (SELECT "offset" FROM ` + quote(queuetable.LeasesTable(topic)) + `)`
	}
	del := `DELETE FROM ` + quote(MessagesTable(topic)) + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + quote(MessagesTable(topic)) + `
	WHERE "offset" <= (SELECT min(offset_acked) FROM ` + quote(OffsetsTable(topic)) + `)` + leased + `
	ORDER BY "offset" LIMIT ?)`
	return dbqueue.Trim(ctx, "sqlitequeue", topic, func(ctx context.Context, limit int) (n int64, err error) {
		err = q.write(ctx, func(tx *sql.Tx) error {
			n, err = dbqueue.Affected(tx.ExecContext(ctx, del, limit))
			return err
		})
		return n, err
	})
}

// view returns the broker.View of topic for group: Waiting and Delete.
func (q *Queue) view(topic, group string) broker.View {
	return dbqueue.View[Record]{
		Waiting: func(ctx context.Context, limit int) ([]Record, error) { return q.Waiting(ctx, topic, group, 0, limit) },
		Message: func(r Record) *message.Message { return r.Message },
		Delete: func(ctx context.Context, r Record) error {
			_, err := q.Delete(ctx, topic, r.Offset)
			return err
		},
	}
}

// topicTables says which of a topic's tables exist.
type topicTables struct {
	messages, offsets, leases, claims bool
}

// exist reports whether the topic exists: its messages and offsets tables do. (A file written
// before the queue had leases has no leases table until a consumer subscribes, nor one written
// before it had claims a claims table.)
func (t topicTables) exist() bool { return t.messages && t.offsets }

// all reports whether every table of the topic exists.
func (t topicTables) all() bool { return t.messages && t.offsets && t.leases && t.claims }

// where returns the condition on topic's messages table that selects the messages after
// offset ?2, with waiting only those that wait for consumer group ?1: leased, or after its
// cursor. The scan then starts below the group's first lease, not at the topic's first message.
func (t topicTables) where(topic string, waiting bool) string {
	if !waiting {
		return `"offset" > ?2`
	}
	cursor := `COALESCE((SELECT offset_acked FROM ` + quote(OffsetsTable(topic)) + ` WHERE consumer_group = ?1), 0)`
	below := func(table, offset string) string {
		return `, COALESCE((SELECT min(` + offset + `) FROM ` + quote(table) + ` WHERE consumer_group = ?1) - 1, ` + cursor + `)`
	}
	from, leased := cursor, ``
	if t.all() {
		from = `min(` + cursor + below(queuetable.LeasesTable(topic), `"offset"`) + below(queuetable.ClaimsTable(topic), `first_offset`) + `)`
		leased = ` OR ` + queuetable.Leased(topic, quote(MessagesTable(topic))+`."offset"`, `?1`)
	} else if t.leases {
		from = `min(` + cursor + below(queuetable.LeasesTable(topic), `"offset"`) + `)`
		leased = ` OR "offset" IN (SELECT "offset" FROM ` + quote(queuetable.LeasesTable(topic)) + ` WHERE consumer_group = ?1)`
	}
	return `"offset" > max(?2, ` + from + `) AND ("offset" > ` + cursor + leased + `)`
}

// topicTables returns which of topic's tables exist. An invalid topic name is an error.
func (q *Queue) topicTables(ctx context.Context, topic string) (topicTables, error) {
	if q.life.Closed() {
		return topicTables{}, ErrClosed
	}
	if err := CheckTopic(topic); err != nil {
		return topicTables{}, err
	}
	if _, ok := q.initialized.Load(topic); ok {
		return topicTables{true, true, true, true}, nil
	}
	var t topicTables
	names := []any{MessagesTable(topic), OffsetsTable(topic), queuetable.LeasesTable(topic), queuetable.ClaimsTable(topic)}
	err := q.db.QueryRowContext(ctx, `SELECT coalesce(max(name = ?1), 0), coalesce(max(name = ?2), 0),
	coalesce(max(name = ?3), 0), coalesce(max(name = ?4), 0)
FROM sqlite_schema WHERE type = 'table' AND name IN (?1, ?2, ?3, ?4)`, names...).Scan(&t.messages, &t.offsets, &t.leases, &t.claims)
	if err != nil {
		return topicTables{}, fmt.Errorf("sqlitequeue: look up topic %q: %w", topic, err)
	}
	return t, nil
}

// inspectTables is topicTables for the inspection methods, which cannot read a topic with only
// one of its messages and offsets tables.
func (q *Queue) inspectTables(ctx context.Context, topic string) (topicTables, error) {
	t, err := q.topicTables(ctx, topic)
	if err == nil && t.messages != t.offsets {
		err = fmt.Errorf("sqlitequeue: topic %q has only one of its tables %s and %s; subscribe to it to create the other", topic, MessagesTable(topic), OffsetsTable(topic))
	}
	return t, err
}

// existingTables is inspectTables for a topic that must exist: one without tables is an error
// wrapping broker.ErrNotFound.
func (q *Queue) existingTables(ctx context.Context, topic string) (topicTables, error) {
	t, err := q.inspectTables(ctx, topic)
	if err == nil && !t.exist() {
		err = broker.NotFound("topic", topic)
	}
	return t, err
}
