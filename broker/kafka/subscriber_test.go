package kafka_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	kafkabroker "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

func TestSubscriber_DeliversEveryRecordWithItsHeadersAndCommitsTheAcked(t *testing.T) {
	t.Parallel()
	f := setup(t, 3)
	ids := f.publish(0, 30)
	ch := f.subscribe(f.subscriber(kafkabroker.Config{}))

	got := map[string]bool{}
	last := map[int32]int64{} // per partition, the offset received last
	var held []*message.Message
	for range ids {
		m := testsvc.Receive(t, ch, within)
		require.False(t, got[m.UUID], "%s delivered twice", m.UUID)
		got[m.UUID] = true
		var i int
		for j, id := range ids {
			if id == m.UUID {
				i = j
			}
		}
		// The subscriber says where the record sits: each record of a partition follows the
		// one received before it, not acked yet; the first follows none.
		pos, ok, err := messagedata.PositionOf(&messagedata.MessageData{Headers: m.Metadata})
		require.NoError(t, err)
		require.True(t, ok, "position headers")
		prev, seen := last[pos.Partition]
		if !seen {
			prev = -1
		}
		require.Equal(t, prev, pos.Previous, "partition %d offset %d", pos.Partition, pos.Offset)
		require.Greater(t, pos.Offset, prev)
		last[pos.Partition] = pos.Offset
		for _, h := range []string{messagedata.HeaderPartition, messagedata.HeaderOffset, messagedata.HeaderPreviousOffset} {
			delete(m.Metadata, h)
		}
		want := f.message(i)
		require.Equal(t, want.Payload, m.Payload)
		require.Equal(t, want.Metadata, m.Metadata)
		require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, testsvc.Info(t, m))
		held = append(held, m)
	}
	for _, m := range held {
		m.Ack()
	}
	require.Len(t, got, len(ids))
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == int64(len(ids)) }, "the group has not committed every acked record")
}

func TestSubscriber_NackRedeliversAfterTheDelayWithoutHoldingTheRecordsBehind(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	ids := f.publish(0, 3)
	ch := f.subscribe(f.subscriber(kafkabroker.Config{}))

	first := testsvc.Receive(t, ch, within)
	require.Equal(t, ids[0], first.UUID)
	nacked := time.Now()
	require.True(t, redelivery.NackAfter(first, 500*time.Millisecond))
	for _, id := range ids[1:] {
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, id, m.UUID)
		m.Ack()
	}
	again := testsvc.Receive(t, ch, within)
	require.Equal(t, ids[0], again.UUID)
	require.GreaterOrEqual(t, time.Since(nacked), 500*time.Millisecond)
	require.Equal(t, 2, testsvc.Info(t, again).Count)
	// The records behind the nacked one are acked, but a commit is a position: nothing of
	// the partition is committed while its first record is not acked.
	require.Zero(t, f.committedTotal())

	again.Nack() // Config.NackDelay is 0: at once
	third := testsvc.Receive(t, ch, within)
	require.Equal(t, 3, testsvc.Info(t, third).Count)
	third.Ack()
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 3 }, "the partition is not committed after its first record was acked")
}

func TestSubscriber_AckTimeoutEndsTheDeliveryAndDeliversTheRecordAgain(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	ids := f.publish(0, 1)
	ch := f.subscribe(f.subscriber(kafkabroker.Config{AckTimeout: 200 * time.Millisecond}))
	m := testsvc.Receive(t, ch, within)
	select {
	case <-m.Context().Done():
		require.ErrorIs(t, context.Cause(m.Context()), kafkabroker.ErrAckTimeout)
	case <-time.After(within):
		t.Fatal("the delivery did not end after AckTimeout")
	}
	m.Ack() // too late: ignored
	again := testsvc.Receive(t, ch, within)
	require.Equal(t, ids[0], again.UUID)
	require.Equal(t, 2, testsvc.Info(t, again).Count)
	again.Ack()
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 1 }, "not committed")
}

func TestSubscriber_ARestartedMemberResumesAtTheFirstRecordNotAcked(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	ids := f.publish(0, 10)
	s := f.subscriber(kafkabroker.Config{})
	ch := f.subscribe(s)
	var held []*message.Message
	for i := range 10 {
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, ids[i], m.UUID)
		held = append(held, m)
	}
	for _, i := range []int{0, 1, 2, 3, 5, 6} {
		held[i].Ack()
	}
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 4 }, "the acked prefix is not committed")
	require.NoError(t, s.Close())
	_, open := <-ch
	require.False(t, open)
	for _, m := range held {
		select {
		case <-m.Context().Done():
		default:
			t.Fatalf("the delivery of %s did not end with the subscription", m.UUID)
		}
	}

	// The records acked behind the first one not acked (5 and 6) are done: the group's commit
	// metadata says so, and they are not delivered again. The others from the committed offset
	// up to the last one the member before took were handed out once, as the metadata says:
	// this is their second delivery. Those written after are first deliveries.
	ids = append(ids, f.publish(10, 13)...)
	ch = f.subscribe(f.subscriber(kafkabroker.Config{}))
	// The second deliveries wait for the commit that records them, the first ones do not: the
	// order between them is not kept.
	want := map[string]int{}
	for _, i := range []int{4, 7, 8, 9, 10, 11, 12} {
		want[ids[i]] = map[bool]int{true: 2, false: 1}[i < 10]
	}
	got := map[string]int{}
	for range want {
		m := testsvc.Receive(t, ch, within)
		got[m.UUID] = testsvc.Info(t, m).Count
		m.Ack()
	}
	require.Equal(t, want, got)
	testsvc.RequireOpenAndNothing(t, ch, 200*time.Millisecond)
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 13 }, "not committed")
}

// An ack given before the subscription ends is committed by its end, though the consumer,
// which settles directly, has not settled it yet.
func TestSubscriber_AnAckGivenBeforeCloseIsCommitted(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	f.publish(0, 1)
	s := f.subscriber(kafkabroker.Config{})
	ch, err := s.Subscribe(redelivery.WithDirectSettle(context.Background()), f.topic)
	require.NoError(t, err)
	testsvc.Receive(t, ch, within).Ack()
	require.NoError(t, s.Close())
	require.Equal(t, int64(1), f.committedTotal())
}

func TestSubscriber_ForeignRecordsGetTheirCoordinatesAsID(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...))
	require.NoError(t, err)
	defer cl.Close()
	require.NoError(t, cl.ProduceSync(context.Background(),
		&kgo.Record{Topic: f.topic, Value: []byte("a"), Headers: []kgo.RecordHeader{{Key: "origin", Value: []byte("java")}}},
		&kgo.Record{Topic: f.topic, Key: []byte("k"), Value: []byte("b")},
	).FirstErr())
	ch := f.subscribe(f.subscriber(kafkabroker.Config{}))
	a := testsvc.Receive(t, ch, within)
	require.Equal(t, f.topic+"/0/0", a.UUID)
	require.Equal(t, message.Metadata{"origin": "java", messagedata.HeaderPartition: "0", messagedata.HeaderOffset: "0", messagedata.HeaderPreviousOffset: "-1"}, a.Metadata)
	require.Equal(t, message.Payload("a"), a.Payload)
	b := testsvc.Receive(t, ch, within)
	require.Equal(t, f.topic+"/0/1", b.UUID)
	require.Equal(t, message.Metadata{messagedata.HeaderPartition: "0", messagedata.HeaderOffset: "1", messagedata.HeaderPreviousOffset: "0"}, b.Metadata)
	a.Ack()
	b.Ack()
}

func TestPublisher_KeyIsTheOrderingKeyOrTheUUID(t *testing.T) {
	t.Parallel()
	m := message.NewMessage("id-1", []byte("x"))
	require.Equal(t, []byte("id-1"), kafkabroker.Record("t", m).Key)
	m.Metadata.Set(messagedata.HeaderKey, "account-7")
	r := kafkabroker.Record("t", m)
	require.Equal(t, []byte("account-7"), r.Key)
	require.Equal(t, kgo.RecordHeader{Key: kafkabroker.UUIDHeader, Value: []byte("id-1")}, r.Headers[0])

	// The records of one key land on one partition, in order.
	f := setup(t, 4)
	var msgs []*message.Message
	for i := range 20 {
		m := f.message(i)
		m.Metadata.Set(messagedata.HeaderKey, "account-7")
		msgs = append(msgs, m)
	}
	require.NoError(t, f.pub.Publish(f.topic, msgs...))
	ch := f.subscribe(f.subscriber(kafkabroker.Config{}))
	for i := range 20 {
		m := testsvc.Receive(t, ch, within)
		require.Equal(t, msgs[i].UUID, m.UUID)
		m.Ack()
	}
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 20 }, "not committed")
	nonEmpty := 0
	for _, o := range f.committed() {
		if o > 0 {
			nonEmpty++
		}
	}
	require.Equal(t, 1, nonEmpty)
}

// TestSubscriber_TwoMembersShareTheTopicAndALeavingMemberLosesNothing runs two members of one
// group; the first leaves while it holds records unacked. Every record is acked in the end,
// by one member or the other, and the group's offsets reach the end of every partition.
func TestSubscriber_TwoMembersShareTheTopicAndALeavingMemberLosesNothing(t *testing.T) {
	t.Parallel()
	const n = 200
	f := setup(t, 4)

	var mu sync.Mutex
	acked := map[string]int{}
	byMember := [2]int{}
	ack := func(member int, m *message.Message) {
		mu.Lock()
		acked[m.UUID]++
		byMember[member]++
		mu.Unlock()
		m.Ack()
	}
	ackedCount := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(acked)
	}

	s0 := f.subscriber(kafkabroker.Config{Prefetch: 16})
	ch0 := f.subscribe(s0)
	s1 := f.subscriber(kafkabroker.Config{Prefetch: 16})
	ch1 := f.subscribe(s1)
	// The records come once both members have partitions: published before, they could all go
	// to whichever member the group assigned every partition first.
	f.settled(2)
	ids := f.publish(0, n)

	// Member 1 acks all it gets, slowly enough that both members have records.
	done1 := make(chan struct{})
	go func() {
		defer close(done1)
		for m := range ch1 {
			time.Sleep(time.Millisecond)
			ack(1, m)
		}
	}()
	// Member 0 acks 40 records, then stops acking, holds what it has, and leaves.
	for range 40 {
		ack(0, testsvc.Receive(t, ch0, within))
	}
	var held []*message.Message
	for len(held) < 5 {
		select {
		case m := <-ch0:
			held = append(held, m)
		case <-time.After(within):
			t.Fatal("member 0 got no more records")
		}
	}
	require.NoError(t, s0.Close())
	for range ch0 {
	}
	for _, m := range held {
		m.Ack() // after the member left: ignored, the new owner delivers them again
	}

	testsvc.Eventually(t, within, func() bool { return ackedCount() == n }, "not every record acked: %d of %d", ackedCount(), n)
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == n }, "the group's offsets do not reach the end of the topic")
	mu.Lock()
	for _, id := range ids {
		require.GreaterOrEqual(t, acked[id], 1, id)
	}
	require.Positive(t, byMember[1], "member 1 got no records")
	mu.Unlock()
	require.NoError(t, s1.Close())
	<-done1
}

// TestSubscriber_ARevokeWaitsForTheDeliveriesInFlight: a member that holds records when a
// second member joins keeps them while the revoke waits (RevokeTimeout): acked then, they are
// committed and not delivered again; held past it, they end with ErrRevoked and go to the new
// owner.
func TestSubscriber_ARevokeWaitsForTheDeliveriesInFlight(t *testing.T) {
	t.Parallel()
	t.Run("acked within", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 2)
		ids := f.publish(0, 10)
		ch0 := f.subscribe(f.subscriber(kafkabroker.Config{RevokeTimeout: 10 * time.Second}))
		var held []*message.Message
		for range ids {
			held = append(held, testsvc.Receive(t, ch0, within))
		}
		ch1 := f.subscribe(f.subscriber(kafkabroker.Config{}))
		time.Sleep(500 * time.Millisecond) // the second member joins; the revoke waits
		for _, m := range held {
			require.NoError(t, context.Cause(m.Context()), m.UUID)
			m.Ack()
		}
		testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 10 }, "not committed")
		testsvc.RequireOpenAndNothing(t, ch1, 500*time.Millisecond)
	})
	t.Run("held past", func(t *testing.T) {
		t.Parallel()
		f := setup(t, 2)
		ids := f.publish(0, 10)
		ch0 := f.subscribe(f.subscriber(kafkabroker.Config{RevokeTimeout: 200 * time.Millisecond}))
		var held []*message.Message
		for range ids {
			held = append(held, testsvc.Receive(t, ch0, within))
		}
		ch1 := f.subscribe(f.subscriber(kafkabroker.Config{}))
		// One partition moves: its deliveries end when the revoke stops waiting.
		var revoked, kept []*message.Message
		split := func() {
			revoked, kept = nil, nil
			for _, m := range held {
				if errors.Is(context.Cause(m.Context()), kafkabroker.ErrRevoked) {
					revoked = append(revoked, m)
				} else {
					kept = append(kept, m)
				}
			}
		}
		testsvc.Eventually(t, within, func() bool { split(); return len(revoked) > 0 }, "no delivery was revoked")
		// The new owner delivers the revoked records, and only those. The revoke ends the
		// partition's deliveries one after the other: the split is taken again as they come.
		got := map[string]bool{}
		for allGot := false; !allGot; {
			m := testsvc.Receive(t, ch1, within)
			split()
			require.True(t, slices.ContainsFunc(revoked, func(r *message.Message) bool { return r.UUID == m.UUID }),
				"%s went to the new owner, but the old one kept it", m.UUID)
			got[m.UUID] = true
			m.Ack()
			allGot = !slices.ContainsFunc(revoked, func(r *message.Message) bool { return !got[r.UUID] })
		}
		for _, m := range revoked {
			m.Ack() // ignored
		}
		for _, m := range kept {
			m.Ack()
		}
		testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 10 }, "not committed")
		testsvc.RequireOpenAndNothing(t, ch1, 300*time.Millisecond)
	})
}

// A revoke takes back the records its member emitted and its consumer has not taken: it waits
// only for the deliveries the consumer has, and those records are not counted as handed out.
func TestSubscriber_ARevokeWithdrawsTheRecordsTheConsumerHasNotTaken(t *testing.T) {
	t.Parallel()
	f := setup(t, 2)
	f.produce(0, 5)
	f.produce(1, 5)
	ch0 := f.subscribe(f.subscriber(kafkabroker.Config{RevokeTimeout: time.Minute}))
	testsvc.Receive(t, ch0, within).Ack() // the others wait in the subscription, not taken
	// One partition moves to the new member, with its records, well before RevokeTimeout.
	ch1 := f.subscribe(f.subscriber(kafkabroker.Config{}))
	for range 4 {
		m := testsvc.Receive(t, ch1, within)
		require.Equal(t, 1, testsvc.Info(t, m).Count, "%s was never taken before", m.UUID)
		m.Ack()
	}
}

// A member that closes records in its last commit the records its consumer took, not those it
// had made ready: the next member counts only those as handed out before.
func TestSubscriber_ARecordTheConsumerNeverTookIsNotCounted(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	ids := f.publish(0, 5)
	s := f.subscriber(kafkabroker.Config{})
	ch := f.subscribe(s)
	m := testsvc.Receive(t, ch, within)
	require.Equal(t, ids[0], m.UUID)
	m.Ack()
	held := testsvc.Receive(t, ch, within) // taken, never settled
	require.Equal(t, ids[1], held.UUID)
	require.NoError(t, s.Close())

	ch = f.subscribe(f.subscriber(kafkabroker.Config{}))
	want := map[string]int{ids[1]: 2, ids[2]: 1, ids[3]: 1, ids[4]: 1}
	got := map[string]int{}
	for range want {
		m := testsvc.Receive(t, ch, within)
		got[m.UUID] = testsvc.Info(t, m).Count
		m.Ack()
	}
	require.Equal(t, want, got)
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 5 }, "not committed")
}

// A revoke does not wait for a nack held for its delay: it is no longer in flight, and its
// record goes to the new owner at once, its count up by one.
func TestSubscriber_ARevokeDoesNotWaitForAHeldNack(t *testing.T) {
	t.Parallel()
	f := setup(t, 2)
	f.produce(0, 1)
	f.produce(1, 1)
	ch0 := f.subscribe(f.subscriber(kafkabroker.Config{RevokeTimeout: time.Minute}))
	for range 2 {
		require.True(t, redelivery.NackAfter(testsvc.Receive(t, ch0, within), time.Minute))
	}
	// One partition moves to the new member, with its record, well before RevokeTimeout.
	m := testsvc.Receive(t, f.subscribe(f.subscriber(kafkabroker.Config{})), within)
	require.Equal(t, 2, testsvc.Info(t, m).Count)
	m.Ack()
}

// TestSubscriber_TheDeliveryCountOutlivesTheMember: the count of a record nacked by one member
// goes on in the next, from the group's commit metadata.
func TestSubscriber_TheDeliveryCountOutlivesTheMember(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	ids := f.publish(0, 2)
	s := f.subscriber(kafkabroker.Config{})
	ch := f.subscribe(s)
	for want := 1; want <= 2; want++ {
		m := testsvc.Receive(t, ch, within)
		if m.UUID == ids[1] {
			m.Ack()
			m = testsvc.Receive(t, ch, within)
		}
		require.Equal(t, ids[0], m.UUID)
		require.Equal(t, want, testsvc.Info(t, m).Count)
		m.Nack()
	}
	// The third hand-out is recorded before it is handed out: the member stops holding it.
	m := testsvc.Receive(t, ch, within)
	require.Equal(t, 3, testsvc.Info(t, m).Count)
	require.NoError(t, s.Close())

	ch = f.subscribe(f.subscriber(kafkabroker.Config{}))
	m = testsvc.Receive(t, ch, within)
	require.Equal(t, ids[0], m.UUID)
	require.Equal(t, redelivery.Info{Count: 4, DelaysNacks: true}, testsvc.Info(t, m))
	m.Ack()
	testsvc.RequireOpenAndNothing(t, ch, 300*time.Millisecond) // the second record was acked: not again
	testsvc.Eventually(t, within, func() bool { return f.committedTotal() == 2 }, "not committed")
}
