package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// publisher is the Queue's message.Publisher.
type publisher struct {
	q *Queue

	mu       sync.Mutex
	closed   bool
	inflight sync.WaitGroup
}

var _ message.Publisher = (*publisher)(nil)

// Publish stores messages on topic, in their order, and returns nil once they are stored.
//
// Messages whose context carries a delivery of a subscriber of the same queue file (see
// Queue.Subscriber) are written in that delivery's transaction: they become visible when it
// commits, together with the acknowledgement of the delivered message, and vanish if it rolls
// back or the message is nacked. The other messages are written in a transaction of their own.
// A call with both kinds is split into runs of consecutive messages of one kind; each run is
// atomic, the call as a whole is not.
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
	for start := 0; start < len(messages); {
		d := p.deliveryOf(messages[start])
		end := start + 1
		for end < len(messages) && p.deliveryOf(messages[end]) == d {
			end++
		}
		var err error
		if d != nil {
			err = p.insertInDelivery(d, topic, messages[start:end])
		} else {
			err = p.insert(topic, messages[start:end])
		}
		if err != nil {
			return err
		}
		start = end
	}
	return nil
}

// deliveryOf returns the delivery msg's context carries if it is one of this queue file, nil
// otherwise.
func (p *publisher) deliveryOf(msg *message.Message) *delivery {
	d, ok := msg.Context().Value(deliveryKey{}).(*delivery)
	if !ok || d.store != p.q.store {
		return nil
	}
	return d
}

func (p *publisher) insert(topic string, msgs []*message.Message) error {
	ctx := context.Background()
	err := p.q.write(ctx, func(tx *sql.Tx) error {
		if err := p.q.createTables(ctx, tx, topic); err != nil {
			return err
		}
		return p.insertRows(ctx, tx, topic, msgs)
	})
	if err != nil {
		return fmt.Errorf("sqlitequeue: publish %d messages to topic %q: %w", len(msgs), topic, err)
	}
	p.q.tablesCreated(topic)
	return nil
}

// ErrDeliveryEnded is returned by Publish for a message whose context is that of a delivery
// that has ended: acknowledged, nacked, past its ack deadline, or given up by a closing
// subscriber. A handler publishes before it acknowledges.
var ErrDeliveryEnded = errors.New("sqlitequeue: the delivery whose context the message carries has ended")

// publishSavepoint makes each publish in a delivery's transaction atomic.
const publishSavepoint = "onceflow_publish"

// insertInDelivery writes msgs in the transaction of delivery d, atomically, unless the
// delivery has ended. It runs under the delivered message's context, which also ends with the
// delivery.
func (p *publisher) insertInDelivery(d *delivery, topic string, msgs []*message.Message) error {
	ctx := msgs[0].Context()
	err := d.use(func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, "SAVEPOINT "+publishSavepoint); err != nil {
			return err
		}
		err := p.q.createTables(ctx, tx, topic)
		if err == nil {
			err = p.insertRows(ctx, tx, topic, msgs)
		}
		if err != nil {
			// Without a context: the rollback must run even when ctx has just ended.
			if _, rbErr := tx.ExecContext(context.Background(), "ROLLBACK TO "+publishSavepoint); rbErr != nil {
				return errors.Join(err, fmt.Errorf("roll back: %w", rbErr))
			}
		}
		_, relErr := tx.ExecContext(context.Background(), "RELEASE "+publishSavepoint)
		return errors.Join(err, relErr)
	})
	if err != nil {
		return fmt.Errorf("sqlitequeue: publish %d messages to topic %q in the transaction of delivery %s: %w", len(msgs), topic, d.uuid, err)
	}
	return nil
}

func (p *publisher) insertRows(ctx context.Context, tx *sql.Tx, topic string, msgs []*message.Message) error {
	for len(msgs) > 0 {
		n := min(len(msgs), insertChunk)
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
