package sqlqueue

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/sqldb"
)

// Coalescing of settlements.
const (
	// settleLinger is how long the first settlement of a batch waits for others before the
	// batch is written: short enough that no prefetch window waits on it, long enough that
	// the acks of a burst of deliveries share one statement.
	settleLinger = 2 * time.Millisecond
	// maxSettleBatch bounds the leases one statement settles.
	maxSettleBatch = 500
)

// settlement is what becomes of one lease of topic: deleted (ack), or changed (a nack, a
// give-back).
type settlement struct {
	topic string
	ack   bool
	leaseUpdate
}

// newSettler returns the writer of a Subscriber's settlements: acknowledgements delete the
// lease, nacks and give-backs change it. Settlements that come within settleLinger of each
// other go in one statement per topic. A write that fails is tried again after
// Config.RetryInterval (PollInterval after a conflict, or once Close has begun), together with
// what came since: an acknowledgement is never dropped while the Subscriber is open.
func newSettler(ctx context.Context, q *Queue) *inflight.Writer[settlement] {
	cfg := q.cfg
	return inflight.NewWriter(ctx, inflight.WriterOptions[settlement]{
		Linger: settleLinger,
		Max:    maxSettleBatch,
		Write:  q.settle,
		Wait: func(err error, _ int, closing bool) time.Duration {
			if closing || sqldb.Classify(err) == sqldb.Conflict {
				return cfg.PollInterval
			}
			return cfg.RetryInterval
		},
		Log:  cfg.log,
		What: "writing acknowledgements",
	})
}

// settle writes list, one statement per topic, each in offset order so that concurrent
// writers lock leases in the same order. An acknowledgement supersedes a lease change of the
// same lease (a delivery given back at Close, then acked). It returns how many of list, as
// it sorted it, are written.
func (q *Queue) settle(ctx context.Context, list []settlement) (int, error) {
	slices.SortStableFunc(list, func(a, b settlement) int {
		return cmp.Or(strings.Compare(a.topic, b.topic), cmp.Compare(a.offset, b.offset), cmp.Compare(a.deliveries, b.deliveries))
	})
	for i := 0; i < len(list); {
		topic, b, j := list[i].topic, &batch{}, i
		for ; j < len(list) && list[j].topic == topic; j++ {
			s := list[j]
			if j+1 < len(list) && list[j+1].topic == topic && list[j+1].leaseRef == s.leaseRef {
				if s.ack {
					list[j+1].ack = true // the next one stands for both
				}
				continue
			}
			if s.ack {
				b.acks = append(b.acks, s.leaseRef)
			} else {
				b.updates = append(b.updates, s.leaseUpdate)
			}
		}
		if err := q.d.settle(ctx, q.db, topic, q.cfg.ConsumerGroup, b); err != nil {
			return i, fmt.Errorf("topic %q: %w", topic, err)
		}
		i = j
	}
	return len(list), nil
}
