package dbqueue

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
)

// View is the broker.View of a topic of a queue in a database, made of the queue's own
// inspection, which takes no lock that its consumers wait for: Waiting lists the messages that
// wait for the consumer group, in the order its consumers receive them, each as a P that
// locates it; Message is the message of a P; Delete deletes the message at a P, its leases
// with it.
type View[P any] struct {
	Waiting func(ctx context.Context, limit int) ([]P, error)
	Message func(P) *message.Message
	Delete  func(ctx context.Context, pos P) error
}

var _ broker.View = View[int]{}

// List returns up to limit waiting messages; each Entry's Pos is its P.
func (v View[P]) List(ctx context.Context, limit int) ([]broker.Entry, error) {
	waiting, err := v.Waiting(ctx, limit)
	if err != nil {
		return nil, err
	}
	out := make([]broker.Entry, len(waiting))
	for i, p := range waiting {
		out[i] = broker.Entry{Message: v.Message(p), Pos: p}
	}
	return out, nil
}

// Remove deletes the message of e, which List returned.
func (v View[P]) Remove(ctx context.Context, e broker.Entry) error { return v.Delete(ctx, e.Pos.(P)) }

// Close has nothing to release.
func (View[P]) Close() error { return nil }

// TrimBatch bounds the messages that one statement of a Trim deletes, so that each holds its
// locks briefly.
const TrimBatch = 1000

// Trim runs trim, which deletes up to TrimBatch acknowledged messages of topic, oldest first,
// until it deletes fewer, and returns how many they deleted in all. Its error names scheme and
// topic.
func Trim(ctx context.Context, scheme, topic string, trim func(ctx context.Context, limit int) (int64, error)) (int64, error) {
	var total int64
	for {
		n, err := trim(ctx, TrimBatch)
		total += n
		if err != nil {
			return total, fmt.Errorf("%s: trim topic %q: %w", scheme, topic, err)
		}
		if n < TrimBatch {
			return total, nil
		}
	}
}
