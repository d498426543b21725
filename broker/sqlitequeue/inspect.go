package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// The inspection methods read without taking the write lock, so they never wait for consumers
// and see the last committed state.

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
	if q.isClosed() {
		return nil, ErrClosed
	}
	rows, err := q.db.QueryContext(ctx, `SELECT name FROM sqlite_schema WHERE type = 'table'`)
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: list topics: %w", err)
	}
	defer func() { _ = rows.Close() }()
	var topics []string
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			return nil, fmt.Errorf("sqlitequeue: list topics: %w", err)
		}
		if suffix, ok := strings.CutPrefix(name, messagesTablePrefix); ok {
			topics = append(topics, topicOfSuffix(suffix))
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqlitequeue: list topics: %w", err)
	}
	sort.Strings(topics)
	return topics, nil
}

// Len returns the number of messages stored on topic, consumed or not; 0 for a topic that has
// never been used.
func (q *Queue) Len(ctx context.Context, topic string) (int64, error) {
	return q.count(ctx, topic, "", false)
}

// Backlog returns the number of messages of topic that consumerGroup has not acknowledged yet.
// For a group that has never consumed topic, that is every message on it.
func (q *Queue) Backlog(ctx context.Context, topic, consumerGroup string) (int64, error) {
	return q.count(ctx, topic, consumerGroup, true)
}

func (q *Queue) count(ctx context.Context, topic, group string, backlog bool) (int64, error) {
	exists, err := q.topicExists(ctx, topic)
	if err != nil || !exists {
		return 0, err
	}
	query := `SELECT count(*) FROM ` + quote(MessagesTable(topic))
	var args []any
	if backlog {
		next := q.offsets.NextOffsetQuery(topic, group)
		query += ` WHERE "offset" > (` + next.Query + `)`
		args = next.Args
	}
	var n int64
	if err := q.db.QueryRowContext(ctx, query, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("sqlitequeue: count messages of topic %q: %w", topic, err)
	}
	return n, nil
}

// List returns up to limit messages of topic with offsets greater than after, in offset order.
// Pass 0 to start at the beginning and the last returned Offset to page on.
func (q *Queue) List(ctx context.Context, topic string, after int64, limit int) ([]Record, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("sqlitequeue: list topic %q: limit %d is not positive", topic, limit)
	}
	exists, err := q.topicExists(ctx, topic)
	if err != nil || !exists {
		return nil, err
	}
	rows, err := q.db.QueryContext(ctx, `SELECT "offset", uuid, payload, metadata, created_at FROM `+
		quote(MessagesTable(topic))+` WHERE "offset" > ? ORDER BY "offset" LIMIT ?`, after, limit)
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: list topic %q: %w", topic, err)
	}
	defer func() { _ = rows.Close() }()
	var out []Record
	for rows.Next() {
		var (
			r         Record
			uuid      string
			payload   []byte
			metadata  sql.NullString
			createdAt string
		)
		if err := rows.Scan(&r.Offset, &uuid, &payload, &metadata, &createdAt); err != nil {
			return nil, fmt.Errorf("sqlitequeue: list topic %q: %w", topic, err)
		}
		if r.Message, err = newMessage(uuid, payload, metadata); err != nil {
			return nil, fmt.Errorf("sqlitequeue: topic %q, offset %d: %w", topic, r.Offset, err)
		}
		if r.CreatedAt, err = time.Parse(time.RFC3339Nano, createdAt); err != nil {
			return nil, fmt.Errorf("sqlitequeue: topic %q, offset %d: created_at %q: %w", topic, r.Offset, createdAt, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqlitequeue: list topic %q: %w", topic, err)
	}
	return out, nil
}

// AckedOffset returns the offset of the last message of topic that consumerGroup has
// acknowledged: 0 for a group that has acknowledged nothing and for a topic that has never been
// used. The messages waiting for the group are those List returns after it.
func (q *Queue) AckedOffset(ctx context.Context, topic, consumerGroup string) (int64, error) {
	exists, err := q.topicExists(ctx, topic)
	if err != nil || !exists {
		return 0, err
	}
	next := q.offsets.NextOffsetQuery(topic, consumerGroup)
	var offset int64
	if err := q.db.QueryRowContext(ctx, next.Query, next.Args...).Scan(&offset); err != nil {
		return 0, fmt.Errorf("sqlitequeue: read the offset of consumer group %q on topic %q: %w", consumerGroup, topic, err)
	}
	return offset, nil
}

// Delete removes the message at offset from topic, for every consumer group, and reports
// whether it was there. It waits for its turn to write like a publisher, so it never removes a
// message from under a subscription that holds it in its batch: the message is delivered and
// settled first, or not delivered at all.
func (q *Queue) Delete(ctx context.Context, topic string, offset int64) (bool, error) {
	exists, err := q.topicExists(ctx, topic)
	if err != nil || !exists {
		return false, err
	}
	var n int64
	err = q.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM `+quote(MessagesTable(topic))+` WHERE "offset" = ?`, offset)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return false, fmt.Errorf("sqlitequeue: delete offset %d of topic %q: %w", offset, topic, err)
	}
	return n == 1, nil
}

// trimBatch bounds the rows one Trim transaction deletes, so that the write lock is held
// briefly.
const trimBatch = 1000

// Trim deletes the messages of topic that every consumer group known to the topic (every group
// that has subscribed to it) has acknowledged, and returns how many it deleted. It deletes
// nothing from a topic no group has subscribed to. A consumer group that subscribes for the
// first time after a Trim does not see the deleted messages.
func (q *Queue) Trim(ctx context.Context, topic string) (int64, error) {
	if err := CheckTopic(topic); err != nil {
		return 0, err
	}
	exists, err := q.topicExists(ctx, topic)
	if err != nil || !exists {
		return 0, err
	}
	del := `DELETE FROM ` + quote(MessagesTable(topic)) + ` WHERE "offset" IN (
	SELECT "offset" FROM ` + quote(MessagesTable(topic)) + `
	WHERE "offset" <= (SELECT min(offset_acked) FROM ` + quote(OffsetsTable(topic)) + `)
	ORDER BY "offset" LIMIT ?)`
	var total int64
	for {
		var n int64
		err := q.write(ctx, func(tx *sql.Tx) error {
			res, err := tx.ExecContext(ctx, del, trimBatch)
			if err != nil {
				return err
			}
			n, err = res.RowsAffected()
			return err
		})
		if err != nil {
			return total, fmt.Errorf("sqlitequeue: trim topic %q: %w", topic, err)
		}
		total += n
		if n < trimBatch {
			return total, nil
		}
	}
}

// topicExists reports whether topic's tables exist. An invalid topic name is an error, and so
// is a topic with only one of its tables.
func (q *Queue) topicExists(ctx context.Context, topic string) (bool, error) {
	n, err := q.topicTables(ctx, topic)
	if err != nil {
		return false, err
	}
	if n == 1 {
		return false, fmt.Errorf("sqlitequeue: topic %q has only one of its tables %s and %s; subscribe to it to create the other", topic, MessagesTable(topic), OffsetsTable(topic))
	}
	return n == 2, nil
}

// topicTables returns how many of topic's two tables exist.
func (q *Queue) topicTables(ctx context.Context, topic string) (int, error) {
	if q.isClosed() {
		return 0, ErrClosed
	}
	if err := CheckTopic(topic); err != nil {
		return 0, err
	}
	if _, ok := q.initialized.Load(topic); ok {
		return 2, nil
	}
	var n int
	err := q.db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN (?, ?)`,
		MessagesTable(topic), OffsetsTable(topic)).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("sqlitequeue: look up topic %q: %w", topic, err)
	}
	return n, nil
}
