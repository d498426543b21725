package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// DeadLetterKeysTable is the table of the queue file that keeps the key
// (messagedata.HeaderDeadLetterKey) of every dead letter stored within the last
// broker.DeadLetterKeyWindow, per topic, so that a dead letter published again within it is
// stored once. Each publish of a dead letter deletes the keys older than that.
const DeadLetterKeysTable = "onceflow_dead_letter_keys"

// deadLetterKeysSchema creates DeadLetterKeysTable.
const deadLetterKeysSchema = `CREATE TABLE IF NOT EXISTS ` + DeadLetterKeysTable + ` (
	topic           TEXT NOT NULL,
	dead_letter_key TEXT NOT NULL,
	published_at    INTEGER NOT NULL,
	PRIMARY KEY (topic, dead_letter_key)
) WITHOUT ROWID`

// firstDeadLetters returns msgs without the dead letters whose key topic has stored before,
// and records the keys of those it keeps, in tx: the messages without a key, and the first
// dead letter of each key. It returns msgs itself, and keyed false, when none has a key.
func (q *Queue) firstDeadLetters(ctx context.Context, tx *sql.Tx, topic string, msgs []*message.Message) (kept []*message.Message, keyed bool, err error) {
	first := -1
	for i, m := range msgs {
		if m.Metadata.Get(messagedata.HeaderDeadLetterKey) != "" {
			first = i
			break
		}
	}
	if first < 0 {
		return msgs, false, nil
	}
	if !q.keysCreated.Load() {
		if _, err := tx.ExecContext(ctx, deadLetterKeysSchema); err != nil {
			return nil, true, fmt.Errorf("create table %s: %w", DeadLetterKeysTable, err)
		}
	}
	now := time.Now()
	cutoff := now.Add(-broker.DeadLetterKeyWindow).UnixMilli()
	if _, err := tx.ExecContext(ctx, `DELETE FROM `+DeadLetterKeysTable+` WHERE published_at < ?`, cutoff); err != nil {
		return nil, true, fmt.Errorf("delete the dead-letter keys older than %s: %w", broker.DeadLetterKeyWindow, err)
	}
	kept = append(make([]*message.Message, 0, len(msgs)), msgs[:first]...)
	for _, m := range msgs[first:] {
		key := m.Metadata.Get(messagedata.HeaderDeadLetterKey)
		if key == "" {
			kept = append(kept, m)
			continue
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO `+DeadLetterKeysTable+` (topic, dead_letter_key, published_at) VALUES (?, ?, ?)
ON CONFLICT (topic, dead_letter_key) DO NOTHING`, topic, key, now.UnixMilli())
		if err != nil {
			return nil, true, fmt.Errorf("record dead-letter key %q of message %q: %w", key, m.UUID, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return nil, true, fmt.Errorf("record dead-letter key %q of message %q: %w", key, m.UUID, err)
		}
		if n == 1 {
			kept = append(kept, m)
		}
	}
	return kept, true, nil
}
