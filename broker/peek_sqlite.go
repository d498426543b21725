package broker

import (
	"context"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// sqliteView reads the queue file with sqlitequeue's inspection methods: the messages past the
// group's acknowledged offset. Reads take no lock; remove deletes a message in its turn to
// write, after any batch a subscription holds.
type sqliteView struct {
	q     *sqlitequeue.Queue
	group string
	topic string
}

func (v *sqliteView) list(ctx context.Context, limit int) ([]entry, error) {
	acked, err := v.q.AckedOffset(ctx, v.topic, v.group)
	if err != nil {
		return nil, err
	}
	recs, err := v.q.List(ctx, v.topic, acked, limit)
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
