package sqlqueue

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/messagedata"
)

// DeadLetterKeysTable keeps the dead-letter keys of every topic (see
// broker.DeadLetterKeyWindow). The first publish of a dead letter creates it.
const DeadLetterKeysTable = dbqueue.DeadLetterKeysTable

// publisher is the postgres:// and mysql:// schemes' Publisher, behind the Broker's, which
// refuses nil messages: watermill-sql's, and for a publish with dead letters publishOnce, which
// stores each once per key and broker.DeadLetterKeyWindow.
type publisher struct {
	message.Publisher
	q *Queue
}

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.Metadata.Get(messagedata.HeaderDeadLetterKey) != "" {
			return p.q.publishOnce(context.Background(), topic, msgs)
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// publishOnce stores msgs on topic in one transaction, without the dead letters whose key the
// topic has stored before, and records the keys of those it stores.
func (q *Queue) publishOnce(ctx context.Context, topic string, msgs []*message.Message) error {
	if err := q.createKeysTable(ctx); err != nil {
		return fmt.Errorf("sqlqueue: create table %s: %w", DeadLetterKeysTable, err)
	}
	err := inTx(ctx, q.db, func(tx *sql.Tx) error {
		kept, err := q.d.keys().First(ctx, tx, topic, msgs)
		if err != nil {
			return err
		}
		if len(kept) == 0 {
			return nil
		}
		insert, err := q.d.messagesSchema().InsertQuery(topic, kept)
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, insert.Query, insert.Args...)
		return err
	})
	if err != nil {
		return fmt.Errorf("sqlqueue: publish %d messages to topic %q: %w", len(msgs), topic, err)
	}
	return nil
}
