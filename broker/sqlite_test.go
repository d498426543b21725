package broker_test

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func sqliteScheme() scheme { return scheme{name: "sqlite", url: testsvc.SQLiteURL} }

// The Broker hands the SQLite queue's deliveries through as they are: many in flight per
// subscription (prefetch), each with the delivery count from the leases table, and a nack
// delayed by NackAfter's delay or else by nack_delay.
func TestSQLite_DeliveriesCarryTheirCountAndNackDelay(t *testing.T) {
	t.Parallel()
	f := setup(t, sqliteScheme(), "prefetch=3&nack_delay=300ms&poll_interval=10ms")
	b := f.open(broker.Options{})
	f.publish(b, f.message(0), f.message(1), f.message(2), f.message(3))
	_, ch := f.subscribe(b)

	var held []*message.Message
	for i := range 3 {
		m := receive(t, ch)
		requireSame(t, f.message(i), m)
		info, ok := redelivery.FromContext(m.Context())
		require.True(t, ok)
		require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, info)
		held = append(held, m)
	}
	select {
	case m := <-ch:
		t.Fatalf("%s delivered beyond the prefetch of 3", m.UUID)
	case <-time.After(200 * time.Millisecond):
	}

	nacked := time.Now()
	held[0].Nack()
	m := receive(t, ch)
	require.Equal(t, f.message(3).UUID, m.UUID, "the nacked message waits; the next one comes")
	m.Ack()
	m = receive(t, ch)
	require.Equal(t, f.message(0).UUID, m.UUID)
	require.GreaterOrEqual(t, time.Since(nacked), 300*time.Millisecond, "nack_delay")
	info, _ := redelivery.FromContext(m.Context())
	require.Equal(t, 2, info.Count)

	nacked = time.Now()
	require.True(t, redelivery.NackAfter(m, 50*time.Millisecond))
	m = receive(t, ch)
	require.Equal(t, f.message(0).UUID, m.UUID)
	require.GreaterOrEqual(t, time.Since(nacked), 50*time.Millisecond)
	info, _ = redelivery.FromContext(m.Context())
	require.Equal(t, 3, info.Count)
	for _, h := range append(held[1:], m) {
		h.Ack()
	}
}

// Peek lists the messages a consumer holds, those waiting for a nack's delay and those it
// claimed and has not handed out, with the others, in offset order; Move takes the picked
// ones and leaves every leased message in place, for the group to settle.
func TestSQLite_PeekAndMoveSeeLeasedMessagesAsWaiting(t *testing.T) {
	t.Parallel()
	f := setup(t, sqliteScheme(), "ack_timeout=1m")
	b := f.open(broker.Options{})
	msgs := []*message.Message{f.message(0), f.message(1), f.message(2), f.message(3), f.message(4)}
	f.publish(b, msgs...)
	sub, ch := f.subscribe(b)
	held := receive(t, ch)
	nacked := receive(t, ch)
	require.True(t, redelivery.NackAfter(nacked, time.Hour))
	require.Equal(t, uuids(msgs), uuids(peek(t, b, f.topic, 10)))

	to := testsvc.UniqueName("moved")
	rep, err := b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) {
		if m.UUID == msgs[3].UUID {
			return to, m
		}
		return "", nil
	})
	require.NoError(t, err)
	require.Len(t, rep.Moved, 1)
	require.Len(t, rep.Kept, 4)
	require.Equal(t, uuids([]*message.Message{msgs[0], msgs[1], msgs[2], msgs[4]}), uuids(peek(t, b, f.topic, 10)))

	held.Ack()
	require.NoError(t, sub.Close())
	require.Equal(t, uuids([]*message.Message{msgs[1], msgs[2], msgs[4]}), uuids(peek(t, b, f.topic, 10)))

	_, ch = f.subscribe(b)
	for _, want := range []*message.Message{msgs[2], msgs[4]} {
		m := receive(t, ch)
		require.Equal(t, want.UUID, m.UUID)
		m.Ack()
	}
	testsvc.Eventually(t, 10*time.Second, func() bool {
		got, err := b.Peek(context.Background(), f.topic, 10)
		return err == nil && len(got) == 1 && got[0].UUID == msgs[1].UUID
	}, "only the message nacked for an hour should wait")
}

// MustExist opens a queue file that exists and refuses, without creating it, one that does
// not: a mistyped path in a command that only reads.
func TestSQLite_MustExistRefusesAMissingFileAndCreatesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	missing := filepath.Join(t.TempDir(), "typo.db")
	_, err := broker.Open(ctx, "sqlite://"+missing, broker.Options{MustExist: true})
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.ErrorContains(t, err, "no such queue: "+missing)
	_, statErr := os.Stat(missing)
	require.ErrorIs(t, statErr, fs.ErrNotExist, "the queue file was created")

	b, err := broker.Open(ctx, "sqlite://"+missing, broker.Options{})
	require.NoError(t, err)
	require.NoError(t, b.Close())
	b, err = broker.Open(ctx, "sqlite://"+missing, broker.Options{MustExist: true})
	require.NoError(t, err)
	require.NoError(t, b.Close())
}
