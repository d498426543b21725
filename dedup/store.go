package dedup

import (
	"context"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/messagedata"
)

// Key identifies one message for one handler.
type Key struct {
	// Handler is the name of the handler; two handlers consuming the same message each apply it
	// once.
	Handler string
	// MessageID is the id of the message.
	MessageID string
	// Timestamp is the message timestamp in Unix microseconds when the key includes it (seed
	// 002's message_log), zero otherwise.
	Timestamp int64
}

// KeyOf returns the key under which handler records msg: its id, and with withTimestamp its
// timestamp when it has one.
func KeyOf(handler string, msg *messagedata.MessageData, withTimestamp bool) Key {
	key := Key{Handler: handler, MessageID: msg.ID}
	if withTimestamp && !msg.Timestamp.IsZero() {
		key.Timestamp = msg.Timestamp.UnixMicro()
	}
	return key
}

// Store records the keys of processed messages inside the caller's transaction.
//
// Both methods run on tx, the transaction that also holds the message's business writes, and
// neither may leave tx unusable: on PostgreSQL a failed statement aborts the whole transaction,
// so implementations use statements that do not fail on an existing key.
type Store interface {
	// Record inserts key with internalID (which may be empty) and reports whether it was
	// inserted. It reports false, with a nil error, when key is already recorded and has not
	// expired: the message is a duplicate. An expired record is replaced. When another
	// transaction is recording the same key at the same moment, Record waits for it: false once
	// it commits, true once it rolls back.
	Record(ctx context.Context, tx sqlx.ExtContext, key Key, internalID string) (bool, error)

	// Lookup returns the internal id recorded for key and whether an unexpired record exists,
	// without writing (the check-first id mapper).
	Lookup(ctx context.Context, tx sqlx.ExtContext, key Key) (internalID string, found bool, err error)
}

// DefaultRetention is how long a key is kept when Config.Retention is zero: seven days, which
// outlives the redelivery horizon of every broker onceflow supports in its default
// configuration.
const DefaultRetention = 7 * 24 * time.Hour

// DefaultTable is the table name used when Config.Table is empty.
const DefaultTable = "onceflow_dedup"
