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
// and records the keys of those it keeps, in tx (dbqueue.DeadLetterKeys.First), creating
// DeadLetterKeysTable if it is missing. It returns msgs itself when none has a key.
func firstDeadLetters(ctx context.Context, tx *sql.Tx, topic string, msgs []*message.Message) ([]*message.Message, error) {
	if !slices.ContainsFunc(msgs, func(m *message.Message) bool { return m.Metadata.Get(messagedata.HeaderDeadLetterKey) != "" }) {
		return msgs, nil
	}
	if _, err := tx.ExecContext(ctx, deadLetterKeys.Schema); err != nil {
		return nil, fmt.Errorf("create table %s: %w", DeadLetterKeysTable, err)
	}
	return deadLetterKeys.First(ctx, tx, topic, msgs)
}
