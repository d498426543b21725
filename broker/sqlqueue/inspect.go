package sqlqueue

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/internal/dbqueue"
)

// Waiting is a message that waits for the Queue's consumer group: leased (handed out and not
// acknowledged, or nacked and waiting for its delay) or after the group's cursor (not yet
// handed out).
type Waiting struct {
	// Message has the UUID, metadata and payload a subscriber would receive.
	Message *message.Message
	// Offset is the message's offset in its topic.
	Offset int64
	// TransactionID is the id of the PostgreSQL transaction that wrote the message; 0 on
	// MySQL.
	TransactionID int64
	// Leased reports that the group has a lease on the message.
	Leased bool
	// Deliveries is the message's delivery count in the group: 0 for a message that was
	// never handed out.
	Deliveries int
}

// Waiting returns up to limit of the messages of topic that wait for the group, in the order
// its consumers receive them: the leased ones first, then those after the cursor. It takes no
// lock, so it neither waits for the group's consumers nor holds them up. A topic whose tables
// do not exist has no waiting messages.
func (q *Queue) Waiting(ctx context.Context, topic string, limit int) ([]Waiting, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("sqlqueue: list topic %q: limit %d is not positive", topic, limit)
	}
	have, err := q.tables(ctx, topic)
	if err != nil || !have.messages {
		return nil, err
	}
	rows, err := q.d.waiting(ctx, q.db, topic, q.cfg.ConsumerGroup, have, limit)
	if err != nil {
		return nil, fmt.Errorf("sqlqueue: list topic %q: %w", topic, err)
	}
	out := make([]Waiting, len(rows))
	for i, r := range rows {
		out[i] = Waiting{
			Message:       newMessage(r.uuid, r.payload, r.metadata),
			Offset:        r.offset,
			TransactionID: r.txID,
			Leased:        r.leased,
			Deliveries:    r.deliveries,
		}
	}
	return out, nil
}

// Remove deletes the message w, which Waiting returned, from topic for every consumer group:
// its row and its leases, in one transaction; a consumer that holds it has its acknowledgement
// come to nothing. Removing a message that is gone already does nothing.
func (q *Queue) Remove(ctx context.Context, topic string, w Waiting) error {
	have, err := q.tables(ctx, topic)
	if err != nil {
		return err
	}
	if err := q.d.remove(ctx, q.db, topic, have, row{offset: w.Offset, txID: w.TransactionID}); err != nil {
		return fmt.Errorf("sqlqueue: delete the message at offset %d from topic %q: %w", w.Offset, topic, err)
	}
	return nil
}

// tables returns which tables of topic exist.
func (q *Queue) tables(ctx context.Context, topic string) (tableSet, error) {
	if err := CheckTopic(topic); err != nil {
		return tableSet{}, fmt.Errorf("sqlqueue: %w", err)
	}
	have, err := q.d.existing(ctx, q.db, topic)
	if err != nil {
		return have, fmt.Errorf("sqlqueue: look up topic %q: %w", topic, err)
	}
	return have, nil
}

// lookUp returns which tables of topic exist, or an error wrapping broker.ErrNotFound when
// topic has no messages table, or, with group, when the Queue's consumer group has no cursor
// row (a Broker's publisher creates both before its first publish, by EnsureTopic).
func (q *Queue) lookUp(ctx context.Context, topic string, group bool) (tableSet, error) {
	have, err := q.tables(ctx, topic)
	if err != nil {
		return have, err
	}
	if !have.messages {
		return have, broker.NotFound("topic", topic)
	}
	if group {
		known := false
		if have.offsets {
			known, err = q.d.hasGroup(ctx, q.db, topic, q.cfg.ConsumerGroup)
		}
		switch {
		case err != nil:
			return have, fmt.Errorf("sqlqueue: look up topic %q: %w", topic, err)
		case !known:
			return have, broker.NotFound("consumer group", q.cfg.ConsumerGroup)
		}
	}
	return have, nil
}

// Trim is broker.Broker.Trim of topic: it deletes, in statements of at most dbqueue.TrimBatch
// rows, the messages at or below the cursor of every group that has subscribed to topic and
// leased by none, nothing when no group has, and returns how many. On MySQL and MariaDB the
// message at the highest offset stays, so that the next offsets follow it whatever the server
// version. A topic that has no tables is an error wrapping broker.ErrNotFound.
func (q *Queue) Trim(ctx context.Context, topic string) (int64, error) {
	have, err := q.lookUp(ctx, topic, false)
	if err != nil || !have.offsets {
		return 0, err // no group has subscribed
	}
	return dbqueue.Trim(ctx, "sqlqueue", topic, func(ctx context.Context, limit int) (int64, error) {
		return q.d.trim(ctx, q.db, topic, have, limit)
	})
}

// view returns the broker.View of topic: Waiting and Remove.
func (q *Queue) view(topic string) broker.View {
	return dbqueue.View[Waiting]{
		Waiting: func(ctx context.Context, limit int) ([]Waiting, error) { return q.Waiting(ctx, topic, limit) },
		Message: func(w Waiting) *message.Message { return w.Message },
		Delete:  func(ctx context.Context, w Waiting) error { return q.Remove(ctx, topic, w) },
	}
}
