package kafka_test

import (
	"context"
	"errors"
	"maps"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

// positions are a consumer's applied offsets, as a test sets them.
type positions struct {
	applied map[int32]int64
	err     error
	calls   atomic.Int32
}

func (p *positions) Applied(_ context.Context, _ string) (map[int32]int64, error) {
	p.calls.Add(1)
	return maps.Clone(p.applied), p.err
}

// produce writes n records to partition of the fixture's topic.
func (f *fixture) produce(partition int32, n int) {
	f.t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(f.t, err)
	defer cl.Close()
	var recs []*kgo.Record
	for range n {
		recs = append(recs, &kgo.Record{Topic: f.topic, Partition: partition, Value: []byte("x")})
	}
	require.NoError(f.t, cl.ProduceSync(context.Background(), recs...).FirstErr())
}

// subscribeInOrder subscribes s to the fixture's topic with the consumer's positions p.
func (f *fixture) subscribeInOrder(s *kafkabroker.Subscriber, p redelivery.Positions) <-chan *message.Message {
	f.t.Helper()
	ch, err := s.Subscribe(redelivery.WithPositions(context.Background(), p), f.topic)
	require.NoError(f.t, err)
	return ch
}

// position returns the position headers of m.
func position(t *testing.T, m *message.Message) messagedata.Position {
	t.Helper()
	pos, ok, err := messagedata.PositionOf(&messagedata.MessageData{Headers: m.Metadata})
	require.NoError(t, err)
	require.True(t, ok, "message %s has no position", m.UUID)
	return pos
}

func TestSubscriber_InOrderHandsOutOneRecordOfAPartitionAtATime(t *testing.T) {
	t.Parallel()
	f := setup(t, 2)
	f.produce(0, 3)
	f.produce(1, 3)
	ch := f.subscribeInOrder(f.subscriber(kafkabroker.Config{}), &positions{})

	// One record of each partition, the first of each; nothing more while they are in flight.
	first := map[int32]*message.Message{}
	for range 2 {
		m := testsvc.Receive(t, ch, within)
		pos := position(t, m)
		require.Equal(t, messagedata.Position{Partition: pos.Partition, Offset: 0, Previous: -1}, pos)
		first[pos.Partition] = m
	}
	require.Len(t, first, 2)
	testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond)

	// A nacked record comes back before the records behind it.
	first[0].Nack()
	again := testsvc.Receive(t, ch, within)
	require.Equal(t, messagedata.Position{Partition: 0, Offset: 0, Previous: -1}, position(t, again))
	require.Equal(t, 2, testsvc.Info(t, again).Count)
	testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond)

	// Each ack lets the next record of its partition out, and only that one.
	again.Ack()
	next := testsvc.Receive(t, ch, within)
	require.Equal(t, messagedata.Position{Partition: 0, Offset: 1, Previous: -1}, position(t, next))
	first[1].Ack()
	held := map[int32]*message.Message{0: next, 1: testsvc.Receive(t, ch, within)}
	require.Equal(t, messagedata.Position{Partition: 1, Offset: 1, Previous: -1}, position(t, held[1]))
	want := map[int32]int64{0: 2, 1: 2}
	for _, p := range []int32{0, 1, 0, 1} {
		testsvc.RequireOpenAndNothing(t, ch, 50*time.Millisecond)
		if held[p] == nil {
			continue
		}
		held[p].Ack()
		held[p] = nil
		if want[p] == 3 {
			continue
		}
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, messagedata.Position{Partition: p, Offset: want[p], Previous: -1}, position(t, m))
		held[p] = m
		want[p]++
	}
	testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond)
	require.Eventually(t, func() bool { return f.committedTotal() == 6 }, within, 20*time.Millisecond, "not every record committed")
}

// With a window (redelivery.WithPositionWindow), a partition's records go out several at once,
// in order; a record that comes after one that was nacked waits for its redelivery, also while
// the nack is held for its delay.
func TestSubscriber_InOrderWithAWindowHoldsARecordBehindANackedOne(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.produce(0, 3)
	ctx := redelivery.WithPositionWindow(redelivery.WithDirectSettle(context.Background()), &positions{})
	ch, err := f.subscriber(kafkabroker.Config{}).Subscribe(ctx, f.topic)
	require.NoError(t, err)
	got := receiveRun(t, ch, 3)
	require.True(t, redelivery.NackAfter(got[0], time.Second))
	redelivery.Settle(got[0])
	settle(got[1], true)
	settle(got[2], true)
	f.produce(0, 1)
	testsvc.RequireOpenAndNothing(t, ch, 500*time.Millisecond) // offset 3 waits for offset 0, held
	again := testsvc.Receive(t, ch, within)
	require.Equal(t, messagedata.Position{Partition: 0, Offset: 0, Previous: -1}, position(t, again))
	require.Equal(t, 2, testsvc.Info(t, again).Count)
	next := testsvc.Receive(t, ch, within)
	require.Equal(t, messagedata.Position{Partition: 0, Offset: 3, Previous: 0}, position(t, next))
	settle(again, true)
	settle(next, true)
	require.Eventually(t, func() bool { return f.committedTotal() == 4 }, within, 20*time.Millisecond, "not committed")
}

func TestSubscriber_InOrderStartsAfterTheAppliedOffsetOrTheCommittedOneIfHigher(t *testing.T) {
	t.Parallel()
	f := setup(t, 2)
	f.produce(0, 10)
	f.produce(1, 10)
	// Kafka has partition 1 committed at 8; the consumer applied up to 6 of partition 0 and
	// up to 3 of partition 1.
	var commit kadm.Offsets
	commit.Add(kadm.Offset{Topic: f.topic, Partition: 1, At: 8, LeaderEpoch: -1})
	resp, err := f.admin.CommitOffsets(context.Background(), f.group, commit)
	require.NoError(t, err)
	require.NoError(t, resp.Error())
	p := &positions{applied: map[int32]int64{0: 6, 1: 3}}
	ch := f.subscribeInOrder(f.subscriber(kafkabroker.Config{}), p)

	got := map[int32][]int64{}
	for range 5 {
		m := testsvc.Receive(t, ch, within)
		pos := position(t, m)
		require.Equal(t, int64(-1), pos.Previous)
		got[pos.Partition] = append(got[pos.Partition], pos.Offset)
		// The record at a committed offset may have been handed out by a member before.
		want := 1
		if pos.Partition == 1 && pos.Offset == 8 {
			want = 2
		}
		require.Equal(t, want, testsvc.Info(t, m).Count, "partition %d offset %d", pos.Partition, pos.Offset)
		m.Ack()
	}
	testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond)
	require.Equal(t, map[int32][]int64{0: {7, 8, 9}, 1: {8, 9}}, got)
	require.Eventually(t, func() bool { return f.committed()[0] == 10 && f.committed()[1] == 10 }, within, 20*time.Millisecond,
		"the committed offsets follow the acks")
	require.Positive(t, p.calls.Load())
}

func TestSubscriber_InOrderStartsAtTheCommittedOffsetWhenThePositionsCannotBeRead(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.produce(0, 3)
	p := &positions{applied: map[int32]int64{0: 1}, err: errors.New("database down")}
	ch := f.subscribeInOrder(f.subscriber(kafkabroker.Config{}), p)
	for i := range 3 {
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, messagedata.Position{Partition: 0, Offset: int64(i), Previous: -1}, position(t, m))
		m.Ack()
	}
	testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond)
	require.Positive(t, p.calls.Load())
}

// Without positions, records of a partition are handed out before the ones ahead of them are
// acked; each names the last record before it that is not acked, which the consumer applies
// first (middleware.Offsets). A record before it that is acked, dead-lettered say, is not
// waited for. The consumer settles directly, so that each settlement is booked before the
// next hand-out.
func TestSubscriber_PreviousOffsetIsTheLastRecordBeforeItNotAcked(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.produce(0, 3)
	ch, err := f.subscriber(kafkabroker.Config{}).Subscribe(redelivery.WithDirectSettle(context.Background()), f.topic)
	require.NoError(t, err)
	got := receiveRun(t, ch, 3)
	settle(got[1], true)
	settle(got[2], false)
	again := testsvc.Receive(t, ch, within)
	require.Equal(t, messagedata.Position{Partition: 0, Offset: 2, Previous: 0}, position(t, again))
	settle(got[0], true)
	settle(again, false)
	again = testsvc.Receive(t, ch, within)
	require.Equal(t, messagedata.Position{Partition: 0, Offset: 2, Previous: -1}, position(t, again))
	require.Equal(t, 3, testsvc.Info(t, again).Count)
	settle(again, true)
	require.Eventually(t, func() bool { return f.committedTotal() == 3 }, within, 20*time.Millisecond, "not committed")
}

// receiveRun receives the first n records of partition 0, in offset order, each with the one
// before it as the previous record not acked.
func receiveRun(t *testing.T, ch <-chan *message.Message, n int) []*message.Message {
	t.Helper()
	var got []*message.Message
	for i := range n {
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, messagedata.Position{Partition: 0, Offset: int64(i), Previous: int64(i) - 1}, position(t, m))
		got = append(got, m)
	}
	return got
}

// settle acks or nacks m and tells its subscriber, as a consumer that settles directly does.
func settle(m *message.Message, ack bool) {
	if ack {
		m.Ack()
	} else {
		m.Nack()
	}
	redelivery.Settle(m)
}
