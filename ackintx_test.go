package onceflow_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
)

// The PostgreSQL and MySQL queues in the handler's own database: the acknowledgement commits
// with the effect. A processor that fails once is rolled back with its acknowledgement and
// applied at the redelivery; an acknowledgement that the router then loses changes nothing,
// since the queue's lease went with the commit; no dedup row is written.
func TestExactlyOnceAckInTransaction_QueueAndEffectCommitTogether(t *testing.T) {
	for _, d := range testsvc.Databases()[1:] { // the SQL queues: postgres, mysql
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, b, sub, topic := openQueueInDB(t, d)

			var failed atomic.Bool
			var lostAcks atomic.Int32
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), PurgeInterval: -1, CloseTimeout: 5 * time.Second})
			require.NoError(t, err)
			h := onceflow.Handler{Name: "effects", Topic: topic, DB: db, Subscriber: sub,
				Chain:      onceflow.ExactlyOnce.Chain().Before(onceflow.StageDeadLetter, loseAcks(&lostAcks)),
				Dedup:      middleware.Dedup{Mode: middleware.DedupAckInTransaction},
				Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{10 * time.Millisecond}},
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					if err := applyEffect(ctx, msg); err != nil {
						return err
					}
					if msg.ID == "fails-once" && failed.CompareAndSwap(false, true) {
						return errors.New("the first attempt fails after its write")
					}
					return nil
				}),
				Retry: middleware.Retry{MaxAttempts: 1}}
			require.NoError(t, r.AddHandler(h))
			testsvc.StartRouter(t, r)

			for _, id := range []string{"plain", "fails-once"} {
				require.NoError(t, b.Publisher().Publish(topic, message.NewMessage(id, []byte(`x`))))
			}
			// The acknowledgement is lost once the commit has returned: after the effect shows.
			testsvc.Eventually(t, 15*time.Second, func() bool {
				return countEffects(t, db, "plain") == 1 && countEffects(t, db, "fails-once") == 1 && lostAcks.Load() >= 2
			}, "effects not applied, or acknowledgements not lost (%d)", lostAcks.Load())
			waiting, err := b.Peek(ctx, topic, 10)
			require.NoError(t, err)
			require.Empty(t, waiting, "every message consumed by its commit")
			require.Equal(t, 1, countEffects(t, db, "plain"), "the lost acknowledgement brought nothing back")
			// The interceptor counts a lost acknowledgement just after the commit that made the
			// effect visible: wait for the count.
			testsvc.Eventually(t, 15*time.Second, func() bool { return lostAcks.Load() >= 2 }, "both acknowledgements were lost")
			require.Equal(t, 1, countEffects(t, db, "fails-once"), "the failed attempt rolled back with its acknowledgement")
			has, err := db.TableExists(ctx, "onceflow_dedup")
			require.NoError(t, err)
			require.False(t, has, "no dedup table")
		})
	}
}

// With group commit, the queue's leases of a group are deleted in the group's one
// transaction: a member that fails is rolled back with its lease and its writes, its message
// stays queued, and the other members of its group commit; once it succeeds it is applied
// once, and an acknowledgement that the router then loses changes nothing, since the lease
// went with the commit. No dedup row is written.
func TestExactlyOnceAckInTransaction_GroupCommitRollsBackAFailedMemberAlone(t *testing.T) {
	const others = 20
	for _, d := range testsvc.Databases()[1:] { // the SQL queues: postgres, mysql
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, b, sub, topic := openQueueInDB(t, d)
			ids := []string{"fails"}
			for i := range others {
				ids = append(ids, fmt.Sprintf("m-%02d", i))
			}
			for _, id := range ids {
				require.NoError(t, b.Publisher().Publish(topic, message.NewMessage(id, []byte(`x`))))
			}

			var failing atomic.Bool
			failing.Store(true)
			var failures atomic.Int32
			var lostAcks atomic.Int32
			r, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), PurgeInterval: -1, CloseTimeout: 5 * time.Second})
			require.NoError(t, err)
			// The chain of DedupAckInTransaction with group commit, with acks lost.
			require.NoError(t, r.AddHandler(onceflow.Handler{Name: "effects", Topic: topic, DB: db, Subscriber: sub,
				Chain:       onceflow.ExactlyOnce.Chain().Before(onceflow.StageDeadLetter, loseAcks(&lostAcks)),
				Dedup:       middleware.Dedup{Mode: middleware.DedupAckInTransaction},
				GroupCommit: onceflow.GroupCommitConfig{MaxWait: 50 * time.Millisecond},
				DeadLetter:  middleware.DeadLetter{MaxDeliveries: -1}, Retry: middleware.Retry{MaxAttempts: 1},
				Redelivery: onceflow.RedeliveryConfig{Delays: []time.Duration{20 * time.Millisecond}},
				Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
					if err := applyEffect(ctx, msg); err != nil {
						return err
					}
					if msg.ID == "fails" && failing.Load() {
						failures.Add(1)
						return errors.New("fails after its write")
					}
					return nil
				})}))
			testsvc.StartRouter(t, r)

			testsvc.Eventually(t, 15*time.Second, func() bool {
				var n int
				require.NoError(t, db.Get(&n, `SELECT COUNT(*) FROM effects`))
				return n == others && failures.Load() >= 2
			}, "the other members were not committed, or the failing one not redelivered")
			require.Zero(t, countEffects(t, db, "fails"), "the failed member's write rolled back")
			waiting, err := b.Peek(ctx, topic, 10)
			require.NoError(t, err)
			require.Len(t, waiting, 1, "only the failed member's message is still queued")
			require.Equal(t, "fails", waiting[0].UUID)

			failing.Store(false)
			testsvc.Eventually(t, 15*time.Second, func() bool { return countEffects(t, db, "fails") == 1 }, "not applied once it succeeds")
			testsvc.Eventually(t, 15*time.Second, func() bool {
				waiting, err := b.Peek(ctx, topic, 10)
				require.NoError(t, err)
				return len(waiting) == 0
			}, "the message was not consumed by its commit")
			for _, id := range ids {
				require.Equal(t, 1, countEffects(t, db, id), id)
			}
			// The last commit empties the queue before its member's goroutine loses the ack.
			testsvc.Eventually(t, 5*time.Second, func() bool { return lostAcks.Load() >= int32(len(ids)) },
				"not every acknowledgement was lost")
			has, err := db.TableExists(ctx, "onceflow_dedup")
			require.NoError(t, err)
			require.False(t, has, "no dedup table")
		})
	}
}

// openQueueInDB opens a fresh database of d, with the effects table, and the SQL queue in it:
// its broker, a subscriber of group "effects" and a new topic.
func openQueueInDB(t *testing.T, d testsvc.Database) (*sqldb.DB, *broker.Broker, message.Subscriber, string) {
	t.Helper()
	ctx := context.Background()
	url := d.URL(t)
	db, err := sqldb.Open(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	createEffects(t, db)
	b, err := broker.Open(ctx, url, broker.Options{ConsumerGroup: "effects"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	sub, err := b.Subscriber()
	require.NoError(t, err)
	return db, b, sub, testsvc.UniqueName("ackintx")
}

// loseAcks is a stage that fails every message after the rest of the chain succeeded, as if
// the acknowledgement after the commit were lost, and counts them.
func loseAcks(lost *atomic.Int32) onceflow.Stage {
	return onceflow.Use("lose-acks", func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if err := next.Process(ctx, msg); err != nil {
				return err
			}
			lost.Add(1)
			return errors.New("the acknowledgement is lost after the commit")
		})
	})
}
