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

// DeadLetterKeysTable is the table, beside a queue's topics, that keeps per topic the key of
// every dead letter stored within broker.DeadLetterKeyWindow, which says why.
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

// First returns msgs without the dead letters whose key topic has stored within the window,
// and records the keys of those it keeps, in tx, after deleting the keys older than the window.
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
