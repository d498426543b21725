package sqlqueue

import (
	"context"

	"github.com/onceflow/onceflow/broker"
)

// view reads the queue of a topic in PostgreSQL or MySQL with the Queue's inspection: the
// messages the group has leased (handed out and not acknowledged, or nacked and waiting), then
// those after its cursor, in the order its consumers receive them. It takes no lock, so it
// never waits for the group's consumers; Remove deletes the message's row and its leases.
type view struct {
	q     *Queue
	topic string
}

func (v *view) List(ctx context.Context, limit int) ([]broker.Entry, error) {
	ws, err := v.q.Waiting(ctx, v.topic, limit)
	if err != nil {
		return nil, err
	}
	out := make([]broker.Entry, len(ws))
	for i, w := range ws {
		out[i] = broker.Entry{Message: w.Message, Pos: w}
	}
	return out, nil
}

func (v *view) Remove(ctx context.Context, e broker.Entry) error {
	return v.q.Remove(ctx, v.topic, e.Pos.(Waiting))
}

func (v *view) Close() error { return nil }
