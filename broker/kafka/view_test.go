package kafka_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// viewFixture is a broker of one group, opened by URL, on a topic of one partition holding
// the records 0..n-1, so that their order is the log's.
type viewFixture struct {
	*fixture
	b *broker.Broker
}

func setupView(t *testing.T, n int) *viewFixture {
	t.Helper()
	f := &viewFixture{fixture: setup(t, 1)}
	f.b = f.open(f.group)
	f.publish(0, n)
	return f
}

// open opens a broker on the fixture's cluster for group, closed when the test ends.
func (f *viewFixture) open(group string) *broker.Broker {
	f.t.Helper()
	url := "kafka://" + strings.Join(f.brokers, ",") + "/?group=" + group + "&ack_timeout=2s&nack_delay=0"
	b, err := broker.Open(context.Background(), url, broker.Options{})
	require.NoError(f.t, err)
	f.t.Cleanup(func() { require.NoError(f.t, b.Close()) })
	return b
}

// peek returns the UUIDs that wait for b's group on topic.
func peekIDs(t *testing.T, b *broker.Broker, topic string) []string {
	t.Helper()
	msgs, err := b.Peek(context.Background(), topic, 100)
	require.NoError(t, err)
	out := []string{}
	for _, m := range msgs {
		out = append(out, m.UUID)
	}
	return out
}

// ids returns the UUIDs of the fixture's messages i.
func (f *viewFixture) ids(is ...int) []string {
	out := []string{}
	for _, i := range is {
		out = append(out, f.message(i).UUID)
	}
	return out
}

// consume subscribes a member of b's group to the topic, acks what ack says and leaves the
// rest unsettled until the member closes, which commits the acked records and gives back the
// others; it returns the UUIDs handed out.
func (f *viewFixture) consume(b *broker.Broker, n int, ack func(uuid string) bool) []string {
	f.t.Helper()
	sub, err := b.Subscriber()
	require.NoError(f.t, err)
	ch, err := sub.Subscribe(context.Background(), f.topic)
	require.NoError(f.t, err)
	var got []string
	for range n {
		m := testsvc.Receive(f.t, ch, within)
		got = append(got, m.UUID)
		if ack(m.UUID) {
			m.Ack()
		}
	}
	require.NoError(f.t, sub.Close())
	return got
}

// Peek lists the records from the group's committed offset on, less those the group acked past
// it, without consuming anything: the group's next member receives the same ones.
func TestView_PeekListsWhatWaitsForTheGroupAndConsumesNothing(t *testing.T) {
	t.Parallel()
	f := setupView(t, 5)
	require.Equal(t, f.ids(0, 1, 2, 3, 4), peekIDs(t, f.b, f.topic), "a group that has committed nothing reads from the start")

	skip := map[string]bool{f.message(2).UUID: true, f.message(4).UUID: true}
	f.consume(f.b, 5, func(id string) bool { return !skip[id] })
	require.Equal(t, map[int32]int64{0: 2}, f.committed(), "record 3 is acked past the mark")

	require.Equal(t, f.ids(2, 4), peekIDs(t, f.b, f.topic))
	require.Equal(t, f.ids(2, 4), peekIDs(t, f.b, f.topic), "listing again finds them again")
	require.Equal(t, f.ids(0, 1, 2, 3, 4), peekIDs(t, f.open("audit"), f.topic), "another group's progress is its own")
	require.Equal(t, f.ids(2, 4), f.consume(f.b, 2, func(string) bool { return true }))
}

// Move publishes the records it picks elsewhere and takes them out for the group only; Delete
// takes them out without publishing. The committed offset moves past a record taken out at it,
// and past the acked ones behind it.
func TestView_MoveAndDeleteTakeRecordsOutForTheGroupOnly(t *testing.T) {
	t.Parallel()
	f := setupView(t, 4)
	moved := testsvc.UniqueName("moved")
	t.Cleanup(func() { _, _ = f.admin.DeleteTopics(context.Background(), moved) })
	picked := map[string]bool{f.message(1).UUID: true, f.message(2).UUID: true}
	rep, err := f.b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) {
		if picked[m.UUID] {
			return moved, m
		}
		return "", nil
	})
	require.NoError(t, err)
	require.Len(t, rep.Moved, 2)
	require.Len(t, rep.Kept, 2)
	require.Equal(t, f.ids(0, 3), peekIDs(t, f.b, f.topic))
	require.ElementsMatch(t, f.ids(1, 2), peekIDs(t, f.b, moved), "in the partitions of a topic of its own")
	require.Equal(t, f.ids(0, 1, 2, 3), peekIDs(t, f.open("audit"), f.topic), "other groups keep every record")
	require.Equal(t, map[int32]int64{0: 0}, f.committed(), "record 0 still waits")

	del, err := f.b.Delete(context.Background(), f.topic, 10, func(m *message.Message) bool { return m.UUID == f.message(0).UUID })
	require.NoError(t, err)
	require.Len(t, del.Deleted, 1)
	require.Equal(t, map[int32]int64{0: 3}, f.committed(), "past 0 and the moved 1 and 2")
	require.Equal(t, f.ids(3), peekIDs(t, f.b, f.topic))

	// The group's next member receives only what waits.
	sub, err := f.b.Subscriber()
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), f.topic)
	require.NoError(t, err)
	m := testsvc.Receive(t, ch, within)
	require.Equal(t, f.message(3).UUID, m.UUID)
	m.Ack()
	testsvc.RequireOpenAndNothing(t, ch, time.Second)
}

// A member of the group that consumes another topic goes on while the view joins the group
// and takes records out: each of its records is handed out once and acked, none lost.
func TestView_MoveWhileTheGroupConsumesAnotherTopic(t *testing.T) {
	t.Parallel()
	f := setupView(t, 3)
	orders := testsvc.UniqueName("orders")
	t.Cleanup(func() { _, _ = f.admin.DeleteTopics(context.Background(), orders) })
	sub, err := f.b.Subscriber()
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), orders)
	require.NoError(t, err)
	const n = 40
	handed := map[string]int{} // written by the consumer until done is closed
	done := make(chan struct{})
	go func() {
		defer close(done)
		for received := 0; received < n; received++ {
			select {
			case m, ok := <-ch:
				if !ok {
					return
				}
				handed[m.UUID]++
				m.Ack()
			case <-time.After(within):
				return
			}
		}
	}()
	publish := func(from, to int) {
		for i := from; i < to; i++ {
			require.NoError(t, f.b.Publisher().Publish(orders, message.NewMessage(fmt.Sprintf("%s-%02d", orders, i), nil)))
		}
	}
	publish(0, n/2)

	moved := testsvc.UniqueName("moved")
	t.Cleanup(func() { _, _ = f.admin.DeleteTopics(context.Background(), moved) })
	rep, err := f.b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) { return moved, m })
	require.NoError(t, err)
	require.Len(t, rep.Moved, 3)
	publish(n/2, n)
	<-done
	testsvc.RequireOpenAndNothing(t, ch, time.Second)
	require.Len(t, handed, n, "every record of the other topic")
	for id, k := range handed {
		require.Equal(t, 1, k, "record %s handed out once", id)
	}
	require.Empty(t, peekIDs(t, f.b, f.topic))
	require.ElementsMatch(t, f.ids(0, 1, 2), peekIDs(t, f.b, moved))
}

// While a member of the group consumes the topic itself, Move takes nothing out and publishes
// nothing: that member's commits would race with the view's. The member goes on and every
// record of the topic reaches it.
func TestView_MoveRefusesATopicThatAMemberOfTheGroupConsumes(t *testing.T) {
	t.Parallel()
	f := setupView(t, 4)
	sub, err := f.b.Subscriber()
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(context.Background(), f.topic)
	require.NoError(t, err)
	first := testsvc.Receive(t, ch, within) // the member owns the partition

	moved := testsvc.UniqueName("moved")
	_, err = f.b.Move(context.Background(), f.topic, 10, func(m *message.Message) (string, *message.Message) { return moved, m })
	require.ErrorContains(t, err, "are assigned to another member of consumer group \""+f.group+"\", which consumes the topic")
	msgs, err := f.b.Peek(context.Background(), moved, 10)
	require.NoError(t, err)
	require.Empty(t, msgs, "nothing published")

	got := []string{first.UUID}
	first.Ack()
	for len(got) < 4 {
		m := testsvc.Receive(t, ch, within)
		if !slices.Contains(got, m.UUID) { // a record handed out again after the rebalance
			got = append(got, m.UUID)
		}
		m.Ack()
	}
	slices.Sort(got)
	require.Equal(t, f.ids(0, 1, 2, 3), got)
}

// Records are listed oldest first across partitions, each partition's in offset order.
func TestView_PeekMergesThePartitionsByTimestamp(t *testing.T) {
	t.Parallel()
	f := setup(t, 2)
	cl, err := kgo.NewClient(kgo.SeedBrokers(f.brokers...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer cl.Close()
	base := time.Now().Add(-time.Hour)
	var want []string
	for i, p := range []int32{1, 0, 0, 1, 0} {
		id := f.message(i).UUID
		want = append(want, id)
		r := &kgo.Record{Topic: f.topic, Partition: p, Timestamp: base.Add(time.Duration(i) * time.Second),
			Headers: []kgo.RecordHeader{{Key: "_watermill_message_uuid", Value: []byte(id)}}}
		require.NoError(t, cl.ProduceSync(context.Background(), r).FirstErr())
	}
	b := (&viewFixture{fixture: f}).open(f.group)
	require.Equal(t, want, peekIDs(t, b, f.topic))
	msgs, err := b.Peek(context.Background(), f.topic, 2)
	require.NoError(t, err)
	require.Equal(t, want[:2], []string{msgs[0].UUID, msgs[1].UUID})
}

// A topic that does not exist has nothing waiting, or is reported with ReportNotFound.
func TestView_TopicThatDoesNotExist(t *testing.T) {
	t.Parallel()
	f := setup(t, 1)
	url := "kafka://" + strings.Join(f.brokers, ",") + "/?group=" + f.group
	b, err := broker.Open(context.Background(), url, broker.Options{ReportNotFound: true})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.Peek(context.Background(), "nosuch", 10)
	require.ErrorIs(t, err, broker.ErrNotFound)
	require.ErrorContains(t, err, `topic "nosuch" does not exist`)
	require.Empty(t, peekIDs(t, (&viewFixture{fixture: f}).open(f.group), "nosuch"))
}
