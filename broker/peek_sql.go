package broker

import (
	"context"

	"github.com/onceflow/onceflow/broker/sqlqueue"
)

// sqlView reads the queue of a topic in PostgreSQL or MySQL with sqlqueue's inspection: the
// messages the group has leased (handed out and not acknowledged, or nacked and waiting), then
// those after its cursor, in the order its consumers receive them. It takes no lock, so it
// never waits for the group's consumers; remove deletes the message's row and its leases.
type sqlView struct {
	q     *sqlqueue.Queue
	topic string
}

func (v *sqlView) list(ctx context.Context, limit int) ([]entry, error) {
	ws, err := v.q.Waiting(ctx, v.topic, limit)
	if err != nil {
		return nil, err
	}
	out := make([]entry, len(ws))
	for i, w := range ws {
		out[i] = entry{msg: w.Message, pos: w}
	}
	return out, nil
}

func (v *sqlView) remove(ctx context.Context, e entry) error {
	return v.q.Remove(ctx, v.topic, e.pos.(sqlqueue.Waiting))
}

func (v *sqlView) close() error { return nil }
