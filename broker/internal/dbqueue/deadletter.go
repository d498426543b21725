package dbqueue

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// DeadLetterKeysTable is the table, beside a queue's topics, that keeps the key
// (messagedata.HeaderDeadLetterKey) of every dead letter stored within the last
// broker.DeadLetterKeyWindow, per topic, so that a dead letter published again within it is
// stored once.
const DeadLetterKeysTable = "onceflow_dead_letter_keys"

// DeadLetterKeys are the statements of DeadLetterKeysTable in one SQL dialect.
type DeadLetterKeys struct {
	// Schema creates the table, harmless to repeat.
	Schema string
	// Delete deletes the keys published before its one parameter, in Unix milliseconds.
	Delete string
	// Insert records a key (parameters: topic, key, published_at in Unix milliseconds), and
	// affects no row when the topic has the key already.
	Insert string
}

// First returns msgs without the dead letters whose key topic has stored within
// broker.DeadLetterKeyWindow: the messages without a key, and the first dead letter of each
// key, whose keys it records, in tx. It deletes the keys older than the window first.
func (k DeadLetterKeys) First(ctx context.Context, tx *sql.Tx, topic string, msgs []*message.Message) ([]*message.Message, error) {
	now := time.Now()
	if _, err := tx.ExecContext(ctx, k.Delete, now.Add(-broker.DeadLetterKeyWindow).UnixMilli()); err != nil {
		return nil, fmt.Errorf("delete the dead-letter keys older than %s: %w", broker.DeadLetterKeyWindow, err)
	}
	kept := make([]*message.Message, 0, len(msgs))
	for _, m := range msgs {
		key := m.Metadata.Get(messagedata.HeaderDeadLetterKey)
		if key == "" {
			kept = append(kept, m)
			continue
		}
		n, err := Affected(tx.ExecContext(ctx, k.Insert, topic, key, now.UnixMilli()))
		if err != nil {
			return nil, fmt.Errorf("record dead-letter key %q of message %q: %w", key, m.UUID, err)
		}
		if n == 1 {
			kept = append(kept, m)
		}
	}
	return kept, nil
}
