package broker_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// forEachInspectableScheme runs test as a parallel subtest for every scheme that Peek and Move
// support, as the package's table of schemes says (Kafka's tests are in broker/kafka).
func forEachInspectableScheme(t *testing.T, test func(t *testing.T, f *fixture)) {
	for _, sc := range schemes() {
		if !broker.Inspectable(sc.name) {
			continue
		}
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			test(t, setup(t, sc, testTimings))
		})
	}
}

// peek returns what waits on topic for b's group, failing the test on error.
func peek(t *testing.T, b *broker.Broker, topic string, limit int) []*message.Message {
	t.Helper()
	msgs, err := b.Peek(context.Background(), topic, limit)
	require.NoError(t, err)
	return msgs
}

// uuids returns the UUIDs of msgs.
func uuids(msgs []*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

func TestPeek_ListsWaitingMessagesInOrderWithoutConsumingThem(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		want := []*message.Message{f.message(0), f.message(1), f.message(2)}
		f.publish(b, want...)

		got := peek(t, b, f.topic, 10)
		require.Len(t, got, 3)
		for i := range want {
			requireSame(t, want[i], got[i])
		}
		require.Equal(t, uuids(want[:2]), uuids(peek(t, b, f.topic, 2)))
		require.Equal(t, uuids(want), uuids(peek(t, b, f.topic, 10)), "peeking again finds the same messages")

		// The group's consumers find them as before, from the first.
		_, ch := f.subscribe(b)
		first := receive(t, ch)
		requireSame(t, want[0], first)
		first.Nack()
	})
}

func TestPeek_AcknowledgedMessagesAreNotListed(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		f.publish(b, f.message(0), f.message(1), f.message(2))
		sub, ch := f.subscribe(b)
		for i := range 2 {
			m := receive(t, ch)
			require.Equal(t, f.message(i).UUID, m.UUID)
			m.Ack()
		}
		// The acks are settled once the next message is delivered (SQL queues: once the
		// consumer closes and commits its batch). The held message stays waiting.
		held := receive(t, ch)
		require.Equal(t, f.message(2).UUID, held.UUID)
		require.NoError(t, sub.Close())

		require.Equal(t, []string{f.message(2).UUID}, uuids(peek(t, b, f.topic, 10)))
	})
}

// A topic that does not exist has no messages, and with Options.ReportNotFound it is reported.
func TestPeekMoveDeleteTrim_TopicThatDoesNotExist(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		lenient := f.open(broker.Options{}) // creates the SQLite queue file
		require.Empty(t, peek(t, lenient, f.topic, 10))
		n, err := lenient.Trim(context.Background(), f.topic)
		if !errors.Is(err, errors.ErrUnsupported) {
			require.NoError(t, err)
			require.Zero(t, n)
		}

		b := f.open(broker.Options{ReportNotFound: true})
		_, err = b.Peek(context.Background(), f.topic, 10)
		requireNotFound(t, err, `topic "`+f.topic+`" does not exist`)
		_, err = b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) { return "elsewhere", m })
		requireNotFound(t, err, `topic "`+f.topic+`" does not exist`)
		_, err = b.Delete(context.Background(), f.topic, 10, func(*message.Message) bool { return true })
		requireNotFound(t, err, `topic "`+f.topic+`" does not exist`)
		if _, err := b.Trim(context.Background(), f.topic); !errors.Is(err, errors.ErrUnsupported) {
			requireNotFound(t, err, `topic "`+f.topic+`" does not exist`)
		}
	})
}

// A consumer group that does not exist is reported, with Options.ReportNotFound, where the
// broker keeps it apart from its reading and the publisher creates it (a queue per group on
// AMQP, a cursor row in the SQL queues); elsewhere it reads the whole topic, as it will when it
// first subscribes.
func TestPeek_GroupThatDoesNotExist(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		f.publish(f.open(broker.Options{ConsumerGroup: "billing"}), f.message(0))
		b := f.open(broker.Options{ConsumerGroup: "biling", ReportNotFound: true})
		msgs, err := b.Peek(context.Background(), f.topic, 10)
		switch f.sc.name {
		case "amqp", "postgres", "mysql":
			requireNotFound(t, err, `consumer group "biling" does not exist`)
		default:
			require.NoError(t, err)
			require.Equal(t, []string{f.message(0).UUID}, uuids(msgs))
		}
	})
}

// requireNotFound requires err to wrap broker.ErrNotFound and say what.
func requireNotFound(t *testing.T, err error, what string) {
	t.Helper()
	require.ErrorIs(t, err, broker.ErrNotFound)
	require.ErrorContains(t, err, what)
}

func TestPeek_OtherGroupsAndTheirProgressDoNotMatter(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		billing := f.open(broker.Options{ConsumerGroup: "billing"})
		shipping := f.open(broker.Options{ConsumerGroup: "shipping"})
		// Both groups' queues exist before the publish (AMQP binds a group's queue when it
		// first subscribes or publishes).
		_, ch := f.subscribe(shipping)
		f.publish(billing, f.message(0), f.message(1))
		m := receive(t, ch)
		m.Ack()
		m = receive(t, ch)
		m.Ack()

		require.Equal(t, uuids([]*message.Message{f.message(0), f.message(1)}), uuids(peek(t, billing, f.topic, 10)))
	})
}

func TestMove_MovesPickedMessagesAndLeavesTheRestInPlace(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		other := testsvc.UniqueName("moved")
		t.Cleanup(func() { f.cleanupTopic(other) })
		msgs := []*message.Message{f.message(0), f.message(1), f.message(2), f.message(3)}
		f.publish(b, msgs...)

		picked := map[string]bool{msgs[1].UUID: true, msgs[3].UUID: true}
		rep, err := b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) {
			if !picked[m.UUID] {
				return "", nil
			}
			out := m.Copy()
			out.Metadata.Set("moved", "yes")
			return other, out
		})
		require.NoError(t, err)
		require.Len(t, rep.Moved, 2)
		require.Equal(t, msgs[1].UUID, rep.Moved[0].Message.UUID)
		require.Equal(t, other, rep.Moved[0].To)
		require.Equal(t, msgs[3].UUID, rep.Moved[1].Message.UUID)
		require.Equal(t, uuids([]*message.Message{msgs[0], msgs[2]}), uuids(rep.Kept))

		require.Equal(t, uuids([]*message.Message{msgs[0], msgs[2]}), uuids(peek(t, b, f.topic, 10)), "the rest stays")
		moved := peek(t, b, other, 10)
		require.Equal(t, uuids([]*message.Message{msgs[1], msgs[3]}), uuids(moved))
		for i, m := range moved {
			require.Equal(t, "yes", m.Metadata.Get("moved"))
			require.Equal(t, string(msgs[2*i+1].Payload), string(m.Payload))
			_, has := m.Metadata[broker.HeaderNATSMsgID]
			require.False(t, has, "the NATS message id is not a header")
		}

		// Moved back to the topic it was published to seconds ago, with the same UUID:
		// JetStream's duplicate window must not swallow it.
		rep, err = b.Move(context.Background(), other, 10, func(m *message.Message) (string, *message.Message) {
			return f.topic, m
		})
		require.NoError(t, err)
		require.Len(t, rep.Moved, 2)
		require.Empty(t, rep.Kept)
		require.Empty(t, peek(t, b, other, 10))
		require.Equal(t, uuids([]*message.Message{msgs[0], msgs[2], msgs[1], msgs[3]}), uuids(peek(t, b, f.topic, 10)))

		// The group's consumers get them in that order.
		_, ch := f.subscribe(b)
		for _, want := range []string{msgs[0].UUID, msgs[2].UUID} {
			m := receive(t, ch)
			require.Equal(t, want, m.UUID)
			m.Ack()
		}
	})
}

func TestMove_StopsAtTheLimitAndLeavesLaterMessages(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		other := testsvc.UniqueName("moved")
		t.Cleanup(func() { f.cleanupTopic(other) })
		f.publish(b, f.message(0), f.message(1), f.message(2))
		rep, err := b.Move(context.Background(), f.topic, 2, func(m *message.Message) (string, *message.Message) {
			return other, m
		})
		require.NoError(t, err)
		require.Len(t, rep.Moved, 2)
		require.Equal(t, []string{f.message(2).UUID}, uuids(peek(t, b, f.topic, 10)))
	})
}

// refusedTopics are, per scheme, a topic its publisher refuses: too long a queue name for
// AMQP, a space and a wildcard for the others. Redis carries any topic name, so it has none.
var refusedTopics = map[string]string{
	"amqp":     strings.Repeat("x", 300),
	"postgres": "no such topic *",
	"mysql":    "no such topic *",
	"sqlite":   "no such topic *",
	"nats":     "no such topic *",
}

func TestMove_GoesOnPastAMessageThatCannotBeMoved(t *testing.T) {
	t.Parallel()
	for _, sc := range schemes() {
		refused, ok := refusedTopics[sc.name]
		if !ok {
			continue
		}
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			f := setup(t, sc, testTimings)
			b := f.open(broker.Options{})
			other := testsvc.UniqueName("moved")
			t.Cleanup(func() { f.cleanupTopic(other) })
			msgs := []*message.Message{f.message(0), f.message(1), f.message(2), f.message(3)}
			f.publish(b, msgs...)

			rep, err := b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) {
				if m.UUID == msgs[1].UUID {
					return refused, m
				}
				return other, m
			})
			require.NoError(t, err, "one message's failure is in the report, not the error")
			require.Equal(t, uuids([]*message.Message{msgs[0], msgs[2], msgs[3]}), uuids(movedMessages(rep.Moved)))
			require.Empty(t, rep.Kept)
			require.Len(t, rep.Failed, 1)
			require.Equal(t, msgs[1].UUID, rep.Failed[0].Message.UUID)
			require.ErrorContains(t, rep.Failed[0].Err, "message \""+msgs[1].UUID+"\": ")
			require.Equal(t, []string{msgs[1].UUID}, uuids(peek(t, b, f.topic, 10)), "the one that failed stays")
			require.Equal(t, uuids([]*message.Message{msgs[0], msgs[2], msgs[3]}), uuids(peek(t, b, other, 10)))
		})
	}
}

// movedMessages returns the messages of moved, as they waited.
func movedMessages(moved []broker.Moved) []*message.Message {
	out := make([]*message.Message, len(moved))
	for i, m := range moved {
		out[i] = m.Message
	}
	return out
}

func TestMove_StopsWhenTheContextEndsAndKeepsTheRest(t *testing.T) {
	t.Parallel()
	f := setup(t, sqliteScheme(), testTimings)
	b := f.open(broker.Options{})
	other := testsvc.UniqueName("moved")
	msgs := []*message.Message{f.message(0), f.message(1), f.message(2)}
	f.publish(b, msgs...)

	ctx, cancel := context.WithCancel(context.Background())
	rep, err := b.Move(ctx, f.topic, 10, func(m *message.Message) (string, *message.Message) {
		cancel() // the operator gives up while the first message is being moved
		return other, m
	})
	require.ErrorIs(t, err, context.Canceled)
	require.Empty(t, rep.Moved)
	require.Len(t, rep.Failed, 1, "the message being moved when the context ended")
	require.Equal(t, uuids(msgs[1:]), uuids(rep.Kept), "the messages not reached stay, unasked")
	require.Equal(t, uuids(msgs), uuids(peek(t, b, f.topic, 10)))
}

func TestDelete_RemovesPickedMessagesAndLeavesTheRestInPlace(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		billing := f.open(broker.Options{ConsumerGroup: "billing"})
		shipping := f.open(broker.Options{ConsumerGroup: "shipping"})
		// Both groups' queues exist before the publish (AMQP binds a group's queue when it
		// first subscribes or publishes).
		sub, _ := f.subscribe(shipping)
		require.NoError(t, sub.Close())
		msgs := []*message.Message{f.message(0), f.message(1), f.message(2), f.message(3)}
		f.publish(billing, msgs...)

		picked := map[string]bool{msgs[0].UUID: true, msgs[2].UUID: true}
		rep, err := billing.Delete(context.Background(), f.topic, 10, func(m *message.Message) bool { return picked[m.UUID] })
		require.NoError(t, err)
		require.Equal(t, uuids([]*message.Message{msgs[0], msgs[2]}), uuids(rep.Deleted))
		require.Equal(t, uuids([]*message.Message{msgs[1], msgs[3]}), uuids(rep.Kept))
		require.Equal(t, uuids(rep.Kept), uuids(peek(t, billing, f.topic, 10)), "the rest stays, in its order")

		// Removal is per group on AMQP, where every group has a queue of its own, and for
		// every group elsewhere, where the groups read one log.
		others := uuids(peek(t, shipping, f.topic, 10))
		if f.sc.name == "amqp" {
			require.Equal(t, uuids(msgs), others)
		} else {
			require.Equal(t, uuids(rep.Kept), others)
		}

		// Deleting nothing changes nothing; the group's consumers get the rest in order.
		rep, err = billing.Delete(context.Background(), f.topic, 10, func(*message.Message) bool { return false })
		require.NoError(t, err)
		require.Empty(t, rep.Deleted)
		require.Len(t, rep.Kept, 2)
		_, ch := f.subscribe(billing)
		for _, want := range []string{msgs[1].UUID, msgs[3].UUID} {
			m := receive(t, ch)
			require.Equal(t, want, m.UUID)
			m.Ack()
		}
	})
}

func TestDelete_StopsAtTheLimit(t *testing.T) {
	t.Parallel()
	forEachInspectableScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		f.publish(b, f.message(0), f.message(1), f.message(2))
		rep, err := b.Delete(context.Background(), f.topic, 2, func(*message.Message) bool { return true })
		require.NoError(t, err)
		require.Len(t, rep.Deleted, 2)
		require.Equal(t, []string{f.message(2).UUID}, uuids(peek(t, b, f.topic, 10)))
	})
}

func TestPeek_MemIsNotSupported(t *testing.T) {
	t.Parallel()
	b, err := broker.Open(context.Background(), "mem://"+testsvc.UniqueName("mem"), broker.Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.Peek(context.Background(), "orders", 10)
	require.ErrorIs(t, err, errors.ErrUnsupported)
	_, err = b.Move(context.Background(), "orders", 10, func(*message.Message) (string, *message.Message) { return "", nil })
	require.ErrorIs(t, err, errors.ErrUnsupported)
	_, err = b.Delete(context.Background(), "orders", 10, func(*message.Message) bool { return true })
	require.ErrorIs(t, err, errors.ErrUnsupported)
}

func TestPeek_LimitMustBePositive(t *testing.T) {
	t.Parallel()
	b, err := broker.Open(context.Background(), "sqlite://"+t.TempDir()+"/q.db", broker.Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.Peek(context.Background(), "orders", 0)
	require.ErrorContains(t, err, "limit 0 is not positive")
	_, err = b.Delete(context.Background(), "orders", 0, func(*message.Message) bool { return true })
	require.ErrorContains(t, err, "limit 0 is not positive")
	_, err = b.Delete(context.Background(), "orders", 10, nil)
	require.ErrorContains(t, err, "pick is nil")
}
