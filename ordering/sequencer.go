package ordering

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// DefaultSequenceTable is the producer's sequence table when SequencerConfig.Table is empty.
const DefaultSequenceTable = "onceflow_order_seq"

// SetSequence writes the ordering key and the sequence number into msg's metadata, in the
// headers messagedata.HeaderKey and messagedata.HeaderSequence that the converter reads into
// MessageData.Key and MessageData.Sequence. It is for producers that number their messages
// themselves (a single writer per key that knows its position, a test); Sequencer numbers them
// in the database, gap-free across processes.
func SetSequence(msg *message.Message, key string, seq uint64) {
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(messagedata.HeaderKey, key)
	msg.Metadata.Set(messagedata.HeaderSequence, strconv.FormatUint(seq, 10))
}

// SequencerConfig configures a Sequencer. The zero value is valid.
type SequencerConfig struct {
	// Table is the sequence table, a plain SQL identifier (see sqldb.CheckIdentifier).
	// Defaults to DefaultSequenceTable.
	Table string
}

// Validate reports the first invalid field of c, by name.
func (c SequencerConfig) Validate() error {
	if c.Table == "" {
		return nil
	}
	return sqldb.CheckIdentifier("Table", c.Table)
}

// Sequencer assigns the producer side of ordering: for each topic and ordering key, the
// sequence numbers 1, 2, 3, ... in the order the producing transactions reserve them, without
// gaps. It is safe for concurrent use; build one per database and share it.
//
// A sequence is reserved in the producer's transaction (an upsert that adds to the key's row
// and returns the new value): it is used if and only if that transaction commits, and the row
// stays locked until then, so the transactions that produce messages for one key take turns
// while other keys go on in parallel. Publish the stamped messages through the transactional
// outbox in that same transaction (Publish, PublishTx): then a message exists exactly when its
// sequence does. A message published straight to a broker after the commit can be lost (a gap
// the consumer waits for); published before the commit, its sequence can be rolled back and
// given to another message, which the consumer would take for a duplicate.
//
// Sequences count per topic: a consumer orders the messages of the topic it reads. Every
// producer of a topic must use the same sequence table.
type Sequencer struct {
	db     *sqldb.DB
	table  string
	quoted string
	d      dialect
}

// NewSequencer returns the sequencer of cfg.Table on db. It does not touch the database: call
// Migrate before the first Next.
func NewSequencer(db *sqldb.DB, cfg SequencerConfig) (*Sequencer, error) {
	if db == nil || db.DB == nil {
		return nil, errors.New("ordering.NewSequencer: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("ordering.NewSequencer: %w", err)
	}
	d, err := dialectOf(db.Dialect)
	if err != nil {
		return nil, fmt.Errorf("ordering.NewSequencer: db.Dialect: %w", err)
	}
	table := cmp.Or(cfg.Table, DefaultSequenceTable)
	return &Sequencer{db: db, table: table, quoted: db.Dialect.Quote(table), d: d}, nil
}

// Table returns the name of the sequence table.
func (s *Sequencer) Table() string { return s.table }

// Migrate creates the sequence table when it does not exist. It is idempotent and safe to run
// from several processes at once.
func (s *Sequencer) Migrate(ctx context.Context) error {
	if err := s.d.migrateSeq(ctx, s.db, s.table); err != nil {
		return fmt.Errorf("ordering: migrate sequence table %s: %w", s.table, err)
	}
	return nil
}

// Next reserves the next n sequence numbers of key on topic in tx, a transaction of the
// sequencer's database, and returns the first; the others follow it. The reservation commits
// or rolls back with tx, and the key's row stays locked until then.
func (s *Sequencer) Next(ctx context.Context, tx sqlx.ExtContext, topic, key string, n int) (uint64, error) {
	switch {
	case tx == nil:
		return 0, errors.New("ordering: Next: tx is nil")
	case n < 1:
		return 0, fmt.Errorf("ordering: Next: n is %d, want at least 1", n)
	}
	if err := checkText("topic", topic, maxTopicLen); err != nil {
		return 0, fmt.Errorf("ordering: Next: %w", err)
	}
	if err := checkText("ordering key", key, MaxKeyLen); err != nil {
		return 0, fmt.Errorf("ordering: Next: %w", err)
	}
	last, err := s.d.next(ctx, tx, s.quoted, topic, key, int64(n))
	if err != nil {
		return 0, fmt.Errorf("ordering: reserve %d sequence numbers of key %s on topic %q: %w", n, textcol.Quote(key), topic, err)
	}
	if last < int64(n) {
		return 0, fmt.Errorf("ordering: reserve %d sequence numbers of key %s on topic %q: the table returned %d", n, textcol.Quote(key), topic, last)
	}
	return uint64(last - int64(n) + 1), nil
}

// Stamp reserves the next sequence numbers of key on topic in tx, one per message, and writes
// the key and each message's number into its metadata (see SetSequence), in the order of msgs.
// It changes msgs.
func (s *Sequencer) Stamp(ctx context.Context, tx sqlx.ExtContext, topic, key string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	for i, m := range msgs {
		if m == nil {
			return fmt.Errorf("ordering: Stamp: message %d of %d is nil", i, len(msgs))
		}
	}
	first, err := s.Next(ctx, tx, topic, key, len(msgs))
	if err != nil {
		return err
	}
	for i, m := range msgs {
		SetSequence(m, key, first+uint64(i))
	}
	return nil
}

// Outbox is where Publish and PublishTx write the stamped messages: an *outbox.Outbox on the
// sequencer's database.
type Outbox interface {
	PublishTx(ctx context.Context, tx *sql.Tx, topic string, msgs ...*message.Message) error
}

// Publish stamps msgs with the next sequence numbers of key on topic and writes them to ob, in
// the transaction the handler's chain opened for the message being processed
// (processor.TxFromContext): the messages, their sequence numbers and the handler's writes
// commit or roll back together. ob must be on the sequencer's database.
func (s *Sequencer) Publish(ctx context.Context, ob Outbox, topic, key string, msgs ...*message.Message) error {
	tx, ok := processor.TxFromContext(ctx)
	if !ok {
		return fmt.Errorf("ordering: Publish: %w (run inside the handler's chain, or call PublishTx with a transaction of your own)", middleware.ErrNoTransaction)
	}
	return s.PublishTx(ctx, tx, ob, topic, key, msgs...)
}

// PublishTx is Publish through tx, a transaction of the sequencer's database that the caller
// opened and will commit or roll back: for producers outside a handler, such as an HTTP request
// that books a posting and announces it. A Relay sends the messages once tx commits.
func (s *Sequencer) PublishTx(ctx context.Context, tx *sqlx.Tx, ob Outbox, topic, key string, msgs ...*message.Message) error {
	if tx == nil {
		return errors.New("ordering: PublishTx: tx is nil")
	}
	if ob == nil {
		return errors.New("ordering: PublishTx: the outbox is nil")
	}
	if err := s.Stamp(ctx, tx, topic, key, msgs...); err != nil {
		return err
	}
	return ob.PublishTx(ctx, tx.Tx, topic, msgs...)
}
