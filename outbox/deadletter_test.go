package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/outbox"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// A message the destination keeps failing while it takes the others is given up at its
// MaxAttempts-th delivery: it goes to the dead-letter topic with the reason, and the messages
// behind it are sent meanwhile, in order.
func TestRelay_RefusedMessageIsDeadLetteredWhileTheOthersFlow(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 5)
		rec, dlq := newRecorder(), newRecorder()
		rec.before = func(m *message.Message, _ int) error {
			if m.UUID == ids[1] {
				return errors.New("message too large for the broker")
			}
			return nil
		}
		cfg := relayConfig(e, e.db, rec)
		cfg.MaxAttempts = 3
		cfg.DeadLetterPublisher = dlq
		r := start(t, cfg)
		dead := dlq.waitFor(t, 1)
		rec.waitFor(t, 4)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))

		require.Equal(t, []string{ids[0], ids[2], ids[3], ids[4]}, rec.ids())
		rec.mu.Lock()
		require.Equal(t, 3, rec.attempts[ids[1]], "attempts of the refused message")
		rec.mu.Unlock()
		require.Len(t, dead, 1)
		require.Equal(t, outbox.DefaultDeadLetterTopic, dead[0].topic)
		d := dead[0].msg
		require.Equal(t, ids[1], d.UUID)
		require.Equal(t, "order-001", string(d.Payload))
		require.Equal(t, topic, d.Metadata.Get(messagedata.HeaderDeadLetterTopic), "a replay sends it to its destination topic")
		require.Equal(t, "3", d.Metadata.Get(messagedata.HeaderDeadLetterDeliveries))
		require.Equal(t, "outbox:"+outbox.DefaultTable, d.Metadata.Get(messagedata.HeaderDeadLetterHandler))
		require.Equal(t, `the destination failed the message at each of 3 deliveries to topic "orders.shipped" while it accepted others: message too large for the broker`,
			d.Metadata.Get(messagedata.HeaderDeadLetterReason))
	})
}

// An error that says publishing again cannot succeed gives the message up at once.
func TestRelay_MessageRefusedByTheErrorsKindIsDeadLetteredAtOnce(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 3)
		rec, dlq := newRecorder(), newRecorder()
		rec.before = func(m *message.Message, _ int) error {
			if m.UUID == ids[0] {
				return processor.Permanent(errors.New("invalid subject"))
			}
			return nil
		}
		cfg := relayConfig(e, e.db, rec)
		cfg.DeadLetterPublisher, cfg.DeadLetterTopic = dlq, "outbox.dead"
		r := start(t, cfg)
		dead := dlq.waitFor(t, 1)
		rec.waitFor(t, 2)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))

		require.Equal(t, ids[1:], rec.ids())
		require.Equal(t, "outbox.dead", dead[0].topic)
		require.Equal(t, ids[0], dead[0].msg.UUID)
		require.Equal(t, "1", dead[0].msg.Metadata.Get(messagedata.HeaderDeadLetterDeliveries))
		require.Equal(t, `the destination refused the message to topic "orders.shipped", and publishing it again cannot succeed: permanent: invalid subject`,
			dead[0].msg.Metadata.Get(messagedata.HeaderDeadLetterReason))
	})
}

// While the destination fails every message, failures give no message up: the relay holds
// one message and publishes it again in place, after growing pauses, until the destination
// is back; then it goes on in order. Only the message that failed first, before the relay
// could tell, comes after the others.
func TestRelay_DestinationDownIsWaitedForWithoutDeadLettering(t *testing.T) {
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ids := e.commitN(t, "order", 6)
		var down atomic.Bool
		down.Store(true)
		var failures atomic.Int64
		rec, dlq := newRecorder(), newRecorder()
		rec.before = func(*message.Message, int) error {
			if down.Load() {
				failures.Add(1)
				return errors.New("connection refused")
			}
			return nil
		}
		cfg := relayConfig(e, e.db, rec)
		cfg.MaxAttempts = 2
		cfg.DeadLetterPublisher = dlq
		r := start(t, cfg)
		testsvc.Eventually(t, waitTimeout, func() bool { return failures.Load() >= 6 }, "the relay did not try while the destination was down")
		time.Sleep(200 * time.Millisecond)
		// Pauses growing to MaxResendInterval (50 ms): a few attempts, not one per message per
		// interval.
		require.Less(t, failures.Load(), int64(20), "the relay hammers a destination that is down")
		down.Store(false)
		rec.waitFor(t, 6)
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))

		require.Empty(t, dlq.ids(), "nothing is dead-lettered for an outage")
		require.Equal(t, append(ids[1:6:6], ids[0]), rec.ids(), "each message once, in order but the first")
	})
}

// The problem this relay was built for, against a real broker: NATS refuses a 2 MiB message
// (its max_payload is 1 MiB). The four messages behind it are delivered, and the refused one
// is dead-lettered on NATS with its reason; its payload is dropped from the dead letter,
// which NATS would refuse too.
func TestRelay_NATSRefusesATooLargeMessageAndTheOthersAreDelivered(t *testing.T) {
	natsURL := testsvc.NATSURL(t)
	forEachDB(t, outbox.Config{}, func(t *testing.T, e *env) {
		ctx := context.Background()
		dest, dlqTopic := testsvc.UniqueName("shipped"), testsvc.UniqueName("dlq")
		t.Cleanup(func() { testsvc.RemoveTopics(t, natsURL, nil, dest, dlqTopic) })
		b, err := broker.Open(ctx, natsURL, broker.Options{ConsumerGroup: testsvc.UniqueName("g")})
		require.NoError(t, err)
		t.Cleanup(func() { _ = b.Close() })

		var ids []string
		for i := range 5 {
			in := fmt.Sprintf("order-%d", i)
			payload := []byte(in)
			if i == 0 {
				payload = []byte(strings.Repeat("x", 2<<20))
			}
			ids = append(ids, outbox.DerivedID(in, "shipped"))
			require.NoError(t, e.inTx(ctx, func(ctx context.Context) error {
				return e.ob.Publish(ctx, dest, message.NewMessage(ids[i], payload))
			}))
		}

		cfg := relayConfig(e, e.db, b.Publisher())
		cfg.MaxAttempts, cfg.DeadLetterTopic = 3, dlqTopic
		if e.db.Dialect == sqldb.SQLite {
			// The error's kind says it at once.
			cfg.Refused = func(err error) bool { return errors.Is(err, nats.ErrMaxPayload) }
		}
		r := start(t, cfg)
		var delivered, dead []*message.Message
		testsvc.Eventually(t, waitTimeout, func() bool {
			delivered, err = b.Peek(ctx, dest, 10)
			require.NoError(t, err)
			dead, err = b.Peek(ctx, dlqTopic, 10)
			require.NoError(t, err)
			return len(delivered) == 4 && len(dead) == 1
		}, "want 4 messages delivered and 1 dead-lettered")
		waitBacklog(t, e.ob, outbox.DefaultConsumerGroup, 0)
		require.NoError(t, r.stop(t))

		var got []string
		for _, m := range delivered {
			got = append(got, m.UUID)
		}
		require.Equal(t, ids[1:], got)
		d := dead[0]
		require.Equal(t, ids[0], d.Metadata.Get(messagedata.HeaderDeadLetterOriginalID))
		require.Equal(t, dest, d.Metadata.Get(messagedata.HeaderDeadLetterTopic))
		require.Contains(t, d.Metadata.Get(messagedata.HeaderDeadLetterReason), "maximum payload exceeded")
		require.Contains(t, d.Metadata.Get(messagedata.HeaderDeadLetterPayloadDropped), fmt.Sprintf("%d bytes", 2<<20))
		require.Empty(t, d.Payload)
		want := "3"
		if e.db.Dialect == sqldb.SQLite {
			want = "1"
		}
		require.Equal(t, want, d.Metadata.Get(messagedata.HeaderDeadLetterDeliveries))
		t.Logf("dead letter reason: %s", d.Metadata.Get(messagedata.HeaderDeadLetterReason))
	})
}

func TestRelay_DefaultDeadLetterTopicIsTheRoutersDefault(t *testing.T) {
	t.Parallel()
	require.Equal(t, onceflow.DefaultDeadLetterTopic, outbox.DefaultDeadLetterTopic)
}
