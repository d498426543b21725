package broker

import (
	"context"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// sqliteView reads the queue file with sqlitequeue's inspection methods: the messages waiting
// for the group, those it has leased (held by a consumer, or nacked and waiting for their
// delay) and those after its cursor, in offset order. Reads take no lock; remove deletes the
// message, and its leases, in its turn to write.
type sqliteView struct {
	q     *sqlitequeue.Queue
	group string
	topic string
}

func (v *sqliteView) list(ctx context.Context, limit int) ([]entry, error) {
	recs, err := v.q.Waiting(ctx, v.topic, v.group, 0, limit)
	if err != nil {
		return nil, err
	}
	out := make([]entry, len(recs))
	for i, r := range recs {
		out[i] = entry{msg: r.Message, pos: r.Offset}
	}
	return out, nil
}

func (v *sqliteView) remove(ctx context.Context, e entry) error {
	_, err := v.q.Delete(ctx, v.topic, e.pos.(int64))
	return err
}

func (v *sqliteView) close() error { return nil }
