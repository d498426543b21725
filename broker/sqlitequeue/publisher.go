package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/lifecycle"
	"github.com/onceflow/onceflow/internal/queuetable"
)

// publisher is the Queue's message.Publisher.
type publisher struct {
	q    *Queue
	life lifecycle.Set[struct{}] // counts the Publish calls in progress
}

var _ message.Publisher = (*publisher)(nil)

// Publish stores messages on topic, in their order, in one transaction, and returns nil once
// it has committed. The messages' contexts play no part: a message published with the context
// of a delivered message is stored at once, like any other.
//
// A dead letter whose key the topic has stored within broker.DeadLetterKeyWindow is left out
// (see the package documentation), and Publish returns nil as for a message stored.
func (p *publisher) Publish(topic string, messages ...*message.Message) error {
	if !p.life.Enter() {
		return ErrClosed
	}
	defer p.life.Leave()

	if p.q.life.Closed() {
		return ErrClosed
	}
	if err := CheckTopic(topic); err != nil {
		return err
	}
	for i, msg := range messages {
		if msg == nil {
			return fmt.Errorf("sqlitequeue: publish to topic %q: message %d of %d is nil", topic, i, len(messages))
		}
	}
	if len(messages) == 0 {
		return nil
	}
	ctx := context.Background()
	err := p.q.write(ctx, func(tx *sql.Tx) error {
		if err := p.q.createTables(ctx, tx, topic); err != nil {
			return err
		}
		msgs, err := firstDeadLetters(ctx, tx, topic, messages)
		if err != nil {
			return err
		}
		return p.insertRows(ctx, tx, topic, msgs)
	})
	if err != nil {
		return fmt.Errorf("sqlitequeue: publish %d messages to topic %q: %w", len(messages), topic, err)
	}
	p.q.tablesCreated(topic)
	p.q.wakes.Wake(topic)
	return nil
}

func (p *publisher) insertRows(ctx context.Context, tx *sql.Tx, topic string, msgs []*message.Message) error {
	for len(msgs) > 0 {
		n := min(len(msgs), queuetable.InsertChunk)
		query, err := p.q.schema.InsertQuery(topic, msgs[:n])
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, query.Query, query.Args...); err != nil {
			return err
		}
		msgs = msgs[n:]
	}
	return nil
}

// Close makes further Publish calls fail with ErrClosed and waits for the calls in progress.
// It does not close the Queue.
func (p *publisher) Close() error {
	p.life.Close()
	p.life.Wait()
	return nil
}
