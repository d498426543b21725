package sqlitequeue

import (
	"context"
	"database/sql"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/queuetable"
)

// publisher is the Queue's message.Publisher.
type publisher struct {
	q *Queue

	mu       sync.Mutex
	closed   bool
	inflight sync.WaitGroup
}

var _ message.Publisher = (*publisher)(nil)

// Publish stores messages on topic, in their order, in one transaction, and returns nil once
// it has committed. The messages' contexts play no part: a message published with the context
// of a delivered message is stored at once, like any other.
//
// A dead letter (a message with the header messagedata.HeaderDeadLetterKey) is stored once per
// topic and key within broker.DeadLetterKeyWindow: one whose key the topic has stored within
// it is left out, and Publish returns
// nil as for a message stored, so the dead letter that a consumer publishes again after its
// predecessor died between the publish and the router's record of it is not a second copy. The
// keys are kept in the table DeadLetterKeysTable, in the same transaction as the messages.
func (p *publisher) Publish(topic string, messages ...*message.Message) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.inflight.Add(1)
	p.mu.Unlock()
	defer p.inflight.Done()

	if p.q.isClosed() {
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
	keyed := false
	err := p.q.write(ctx, func(tx *sql.Tx) error {
		if err := p.q.createTables(ctx, tx, topic); err != nil {
			return err
		}
		msgs, k, err := p.q.firstDeadLetters(ctx, tx, topic, messages)
		if err != nil {
			return err
		}
		keyed = k
		return p.insertRows(ctx, tx, topic, msgs)
	})
	if err != nil {
		return fmt.Errorf("sqlitequeue: publish %d messages to topic %q: %w", len(messages), topic, err)
	}
	if keyed {
		p.q.keysCreated.Store(true)
	}
	p.q.tablesCreated(topic)
	p.q.store.published(topic)
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
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.inflight.Wait()
	return nil
}
