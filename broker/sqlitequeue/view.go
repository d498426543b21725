package sqlitequeue

import (
	"context"

	"github.com/onceflow/onceflow/broker"
)

// view reads the queue file with the Queue's inspection methods: the messages waiting
// for the group, those it has leased (held by a consumer, or nacked and waiting for their
// delay) and those after its cursor, in offset order. Reads take no lock; Remove deletes the
// message, and its leases, in its turn to write.
type view struct {
	q     *Queue
	group string
	topic string
}

func (v *view) List(ctx context.Context, limit int) ([]broker.Entry, error) {
	recs, err := v.q.Waiting(ctx, v.topic, v.group, 0, limit)
	if err != nil {
		return nil, err
	}
	out := make([]broker.Entry, len(recs))
	for i, r := range recs {
		out[i] = broker.Entry{Message: r.Message, Pos: r.Offset}
	}
	return out, nil
}

func (v *view) Remove(ctx context.Context, e broker.Entry) error {
	_, err := v.q.Delete(ctx, v.topic, e.Pos.(int64))
	return err
}

func (v *view) Close() error { return nil }
