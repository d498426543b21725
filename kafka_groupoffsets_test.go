package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// The modes in which a ByOffset handler applies a partition's records several at a time.
var groupedByOffset = []struct {
	name string
	set  func(h *onceflow.Handler, apply func(ctx context.Context, msg *messagedata.MessageData) error)
}{
	{"group-commit", func(h *onceflow.Handler, apply func(context.Context, *messagedata.MessageData) error) {
		h.GroupCommit.Disabled = false
		h.Processor = processor.Func(apply)
	}},
	{"batch", func(h *onceflow.Handler, apply func(context.Context, *messagedata.MessageData) error) {
		h.GroupCommit.Disabled = false
		h.Processor = nil
		h.BatchProcessor = processor.BatchFunc(func(ctx context.Context, msgs []*messagedata.MessageData) error {
			for _, msg := range msgs {
				if err := apply(ctx, msg); err != nil {
					return processor.ErrorFor(msg, err)
				}
			}
			return nil
		})
	}},
}

// orderedEffects applies records as effects whose note is "partition/offset", and counts the
// records applied while a later offset of their partition was applied already (in the
// database, or earlier in the same transaction).
type orderedEffects struct {
	outOfOrder atomic.Int64
}

func (o *orderedEffects) apply(ctx context.Context, msg *messagedata.MessageData) error {
	pos, ok, err := messagedata.PositionOf(msg)
	if err != nil || !ok {
		return fmt.Errorf("no position: %v", err)
	}
	tx, _ := middleware.CurrentTx(ctx)
	note := fmt.Sprintf("%d/%09d", pos.Partition, pos.Offset)
	var later int
	if err := tx.QueryRowxContext(ctx, tx.Rebind(`SELECT COUNT(*) FROM effects WHERE note LIKE ? AND note > ?`),
		fmt.Sprintf("%d/%%", pos.Partition), note).Scan(&later); err != nil {
		return err
	}
	if later > 0 {
		o.outOfOrder.Add(1)
	}
	_, err = tx.ExecContext(ctx, tx.Rebind(`INSERT INTO effects (message_id, note) VALUES (?, ?)`), msg.ID, note)
	return err
}

// publish publishes n records "r-000".. to the topic.
func (k *kafkaByOffset) publish(n int) {
	for i := range n {
		require.NoError(k.t, k.pub.Publisher().Publish(k.topic, message.NewMessage(fmt.Sprintf("r-%03d", i), []byte("x"))))
	}
}

// positions returns the handler's applied offset of each partition.
func (k *kafkaByOffset) positions() map[int32]int64 {
	rows, err := k.f.db.Query(`SELECT partition_id, applied FROM onceflow_positions WHERE handler = 'effects' AND topic = `+k.f.db.Rebind("?"), k.topic)
	require.NoError(k.t, err)
	defer rows.Close()
	out := map[int32]int64{}
	for rows.Next() {
		var p int32
		var a int64
		require.NoError(k.t, rows.Scan(&p, &a))
		out[p] = a
	}
	require.NoError(k.t, rows.Err())
	return out
}

// lastOffsets returns the highest offset of each partition among the effects, and checks that
// each partition's effects are offsets 0 to that one, each once.
func (k *kafkaByOffset) lastOffsets() map[int32]int64 {
	var notes []string
	require.NoError(k.t, k.f.db.Select(&notes, `SELECT note FROM effects`))
	count, last := map[int32]int64{}, map[int32]int64{}
	for _, n := range notes {
		var p int32
		var o int64
		_, err := fmt.Sscanf(n, "%d/%d", &p, &o)
		require.NoError(k.t, err, n)
		count[p]++
		last[p] = max(last[p], o)
	}
	for p, n := range count {
		require.Equal(k.t, last[p]+1, n, "partition %d: every offset up to the last applied once", p)
	}
	return last
}

// requireAppliedOnceInOrder checks that the effects are the records, each once, none applied
// after a later offset of its partition, and that each partition's position is its last
// offset.
func (k *kafkaByOffset) requireAppliedOnceInOrder(records int, effects *orderedEffects) {
	t := k.t
	var n int
	require.NoError(t, k.f.db.Get(&n, `SELECT COUNT(*) FROM effects`))
	require.Equal(t, records, n, "each record has exactly one effect")
	require.Zero(t, effects.outOfOrder.Load(), "records applied after a later offset of their partition")
	last := k.lastOffsets()
	testsvc.Eventually(t, 10*time.Second, func() bool { return len(k.positions()) == len(last) }, "a partition has no position")
	require.Equal(t, last, k.positions(), "each partition's position is its last offset")
}

// A backlog drained by group commit or a batch processor with duplicate detection by offset:
// each record is applied exactly once and in its partition's order, the position of each
// partition is its last offset, and groups held several records of a partition at once.
func TestExactlyOnceByOffset_KafkaGroupsDrainABacklogOnceInOrder(t *testing.T) {
	const records = 400
	for _, mode := range groupedByOffset {
		t.Run(mode.name, func(t *testing.T) {
			forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
				f := newFixture(t, d)
				k := newKafkaByOffset(t, f, "partitions=4")
				k.publish(records)
				var effects orderedEffects
				k.start(k.group, 2, nil, func(h *onceflow.Handler) { mode.set(h, effects.apply) })
				testsvc.Eventually(t, 30*time.Second, func() bool { return k.applied() == records }, "not every record was applied")
				k.requireAppliedOnceInOrder(records, &effects)
				require.NotZero(t, k.probe.overlapping(), "no record was handed out while the one before it in its partition was in processing")
			})
		})
	}
}

// A record that fails every time in the middle of a partition, applied by groups: it is
// dead-lettered once, no record behind it is applied before it is, and every other record is
// applied exactly once, in order, with the partition's position at its last offset.
func TestExactlyOnceByOffset_KafkaGroupsDeadLetterAPoisonAndApplyTheRestInOrder(t *testing.T) {
	const records = 60
	const poison = "r-030"
	for _, mode := range groupedByOffset {
		t.Run(mode.name, func(t *testing.T) {
			forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
				f := newFixture(t, d)
				k := newKafkaByOffset(t, f, "partitions=1")
				k.publish(records)
				var effects orderedEffects
				var mu sync.Mutex
				poisonRuns := 0
				apply := func(ctx context.Context, msg *messagedata.MessageData) error {
					if msg.ID == poison {
						mu.Lock()
						poisonRuns++
						mu.Unlock()
						return errors.New("cannot apply") // retryable: it fails up to the delivery limit
					}
					return effects.apply(ctx, msg)
				}
				k.start(k.group, 1, nil, func(h *onceflow.Handler) {
					mode.set(h, apply)
					h.DeadLetter.MaxDeliveries = 3
					h.Retry = middleware.Retry{MaxAttempts: 2, InitialInterval: time.Millisecond, MaxInterval: time.Millisecond}
					h.Redelivery.Delays = []time.Duration{5 * time.Millisecond}
				})
				testsvc.Eventually(t, 30*time.Second, func() bool { return k.applied() == records-1 }, "not every other record was applied")
				var dead []*message.Message
				testsvc.Eventually(t, 20*time.Second, func() bool {
					dead = append(dead, f.broker.Drain(onceflow.DefaultDeadLetterTopic)...)
					return len(dead) >= 1
				}, "not dead-lettered")
				require.Len(t, dead, 1)
				require.Equal(t, poison, dead[0].UUID)
				// Dead-lettered at its delivery limit: no record behind it was applied before
				// (the position would have passed it, and its redeliveries been duplicates).
				require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "delivery limit reached after 3 deliveries")

				var n, poisoned int
				require.NoError(t, f.db.Get(&n, `SELECT COUNT(*) FROM effects`))
				require.Equal(t, records-1, n, "each other record has exactly one effect")
				require.NoError(t, f.db.Get(&poisoned, f.db.Rebind(`SELECT COUNT(*) FROM effects WHERE message_id = ?`), poison))
				require.Zero(t, poisoned)
				require.Zero(t, effects.outOfOrder.Load(), "records applied after a later offset of their partition")
				testsvc.Eventually(t, 10*time.Second, func() bool { return k.positions()[0] == records-1 }, "the position is not the last offset")
				mu.Lock()
				defer mu.Unlock()
				require.GreaterOrEqual(t, poisonRuns, 3, "the poison ran in each of its deliveries")
			})
		})
	}
}

// Two consumers of one Kafka group applying by groups, the second joining while the first has
// groups in flight and the first leaving while the second has: each rebalance moves
// partitions whose records are being applied, and still each record has exactly one effect, in
// its partition's order, and each partition's position is its last offset.
func TestExactlyOnceByOffset_KafkaGroupsThroughRebalancesApplyEachRecordOnce(t *testing.T) {
	const records = 300
	forEachDatabase(t, func(t *testing.T, d testsvc.Database) {
		if d.Name == "sqlite" {
			t.Skip("two routers on one SQLite file take turns at its write lock: the rebalance is shown on the servers")
		}
		f := newFixture(t, d)
		k := newKafkaByOffset(t, f, "partitions=4")
		k.publish(records)
		var effects orderedEffects
		slow := func(ctx context.Context, msg *messagedata.MessageData) error {
			time.Sleep(time.Millisecond) // groups stay in flight across the rebalances
			return effects.apply(ctx, msg)
		}
		grouped := func(h *onceflow.Handler) { groupedByOffset[0].set(h, slow) }
		stopFirst := k.start(k.group, 2, nil, grouped)
		testsvc.Eventually(t, 30*time.Second, func() bool { return k.applied() >= records/4 }, "the first consumer applied nothing")
		k.start(k.group, 2, nil, grouped)
		testsvc.Eventually(t, 30*time.Second, func() bool { return k.applied() >= records/2 }, "no progress after the second joined")
		stopFirst()
		testsvc.Eventually(t, 60*time.Second, func() bool { return k.applied() == records }, "not every record was applied")
		k.requireAppliedOnceInOrder(records, &effects)
	})
}
