package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/messagedata"
)

// DeadLetterKeysTable keeps, per topic, the key (messagedata.HeaderDeadLetterKey) of every dead
// letter stored within broker.DeadLetterKeyWindow (see the package documentation).
const DeadLetterKeysTable = dbqueue.DeadLetterKeysTable

// deadLetterKeys are the statements of DeadLetterKeysTable.
var deadLetterKeys = dbqueue.DeadLetterKeys{
	Schema: `CREATE TABLE IF NOT EXISTS ` + DeadLetterKeysTable + ` (
	topic           TEXT NOT NULL,
	dead_letter_key TEXT NOT NULL,
	published_at    INTEGER NOT NULL,
	PRIMARY KEY (topic, dead_letter_key)
) WITHOUT ROWID`,
	Delete: `DELETE FROM ` + DeadLetterKeysTable + ` WHERE published_at < ?`,
	Insert: `INSERT INTO ` + DeadLetterKeysTable + ` (topic, dead_letter_key, published_at) VALUES (?, ?, ?)
ON CONFLICT (topic, dead_letter_key) DO NOTHING`,
}

// firstDeadLetters returns msgs without the dead letters whose key topic has stored before,
// and records the keys of those it keeps, in tx: the messages without a key, and the first
// dead letter of each key. It returns msgs itself, and keyed false, when none has a key.
func (q *Queue) firstDeadLetters(ctx context.Context, tx *sql.Tx, topic string, msgs []*message.Message) (kept []*message.Message, keyed bool, err error) {
	if !slices.ContainsFunc(msgs, func(m *message.Message) bool { return m.Metadata.Get(messagedata.HeaderDeadLetterKey) != "" }) {
		return msgs, false, nil
	}
	if !q.keysCreated.Load() {
		if _, err := tx.ExecContext(ctx, deadLetterKeys.Schema); err != nil {
			return nil, true, fmt.Errorf("create table %s: %w", DeadLetterKeysTable, err)
		}
	}
	kept, err = deadLetterKeys.First(ctx, tx, topic, msgs)
	return kept, true, err
}
