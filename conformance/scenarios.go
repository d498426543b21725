package conformance

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// errAckLost is what the router sees when the acknowledgement of a committed message cannot
// reach the broker: the process died between commit and ack, or the connection did.
var errAckLost = errors.New("acknowledgement lost after the commit (injected)")

// testRedeliveryAfterCommit: the first delivery of each message commits its effect and then
// loses its acknowledgement; the broker delivers the message again, and the redelivery is
// acked without a second effect. A copy that the producer publishes again later is acked
// without an effect too.
func testRedeliveryAfterCommit(t *testing.T, f *fixture) {
	b := f.openBroker(f.brokerURL)
	topic := f.topic("in")
	var mu sync.Mutex
	committed := map[string]bool{}
	// Outside "retry": the router gets the error and nacks, so the broker delivers again.
	loseFirstAck := func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			err := next.Process(ctx, msg)
			mu.Lock()
			first := err == nil && !committed[msg.ID]
			if err == nil {
				committed[msg.ID] = true
			}
			mu.Unlock()
			if first {
				return errAckLost
			}
			return err
		})
	}
	n := f.startNode(b, nil, handlerSpec{Name: "effects", Topic: topic, Outer: []onceflow.Stage{onceflow.Use("lose-first-ack", loseFirstAck)}})

	ids := []string{f.id("a"), f.id("b"), f.id("c")}
	for _, id := range ids {
		f.publish(b, topic, id, "first")
	}
	for _, id := range ids {
		f.waitAcks(n.probe, "effects", id, 1)
	}
	for _, id := range ids {
		require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 1, Nacks: 1}, n.probe.get("effects", id),
			"%s: the delivery whose ack was lost is nacked, the redelivery acked", id)
		require.Equal(t, 1, f.effects("effects", id), "%s: one effect", id)
	}

	// The producer publishes the first message again, as a publisher that retries does.
	f.publishCopy(b, topic, ids[0], "again", 1)
	f.waitAcks(n.probe, "effects", ids[0], 2)
	require.Equal(t, deliveryCounts{Deliveries: 3, Acks: 2, Nacks: 1}, n.probe.get("effects", ids[0]))
	require.Equal(t, 1, f.effects("effects", ids[0]))
}

// testNackBeforeCommit: the first attempt of each message writes its effect and fails; the
// transaction rolls back, the router nacks (no in-process retry), the broker delivers the
// message again, and the second attempt, which sees none of the first one's writes, commits.
func testNackBeforeCommit(t *testing.T, f *fixture) {
	b := f.openBroker(f.brokerURL)
	topic := f.topic("in")
	var mu sync.Mutex
	attempts := map[string]int{}
	seenOnRetry := map[string]int{}
	proc := processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
		mu.Lock()
		attempts[msg.ID]++
		attempt := attempts[msg.ID]
		mu.Unlock()
		if attempt == 2 {
			tx, _ := processor.TxFromContext(ctx)
			var rows int
			if err := tx.GetContext(ctx, &rows, tx.Rebind(`SELECT COUNT(*) FROM `+effectsTable+` WHERE message_id = ?`), msg.ID); err != nil {
				return err
			}
			mu.Lock()
			seenOnRetry[msg.ID] = rows
			mu.Unlock()
		}
		if err := writeEffect(ctx, "effects", msg); err != nil {
			return err
		}
		if attempt == 1 {
			return errors.New("downstream service unavailable (injected)")
		}
		return nil
	})
	n := f.startNode(b, nil, handlerSpec{Name: "effects", Topic: topic, Processor: proc, MaxAttempts: 1})

	ids := []string{f.id("a"), f.id("b"), f.id("c")}
	for _, id := range ids {
		f.publish(b, topic, id, "x")
	}
	for _, id := range ids {
		f.waitAcks(n.probe, "effects", id, 1)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		require.Equal(t, 2, attempts[id], "%s: one failed attempt, one retry by the broker (%+v)", id, n.probe.get("effects", id))
		require.Equal(t, 0, seenOnRetry[id], "%s: the failed attempt's effect was rolled back", id)
		require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 1, Nacks: 1}, n.probe.get("effects", id), id)
		require.Equal(t, 1, f.effects("effects", id), "%s: one effect", id)
	}
}

// concurrentAttempts bounds the attempts at getting the two copies of a message into two
// consumers at once, on a broker that may give both to the same consumer (NATS spreads a
// group's messages at random); attemptTimeout bounds how long an attempt waits for it.
const (
	concurrentAttempts = 16
	attemptTimeout     = time.Second
)

// testConcurrentDuplicates: two routers (two nodes, each with its own broker connection and
// the same handler) get the two copies of a message; one effect, both copies acked, none
// nacked.
//
// Where the broker delivers concurrently, both copies are held until each router has one,
// then race into their transactions: the second insert of the dedup key waits for the first
// transaction, then counts as a duplicate. Where the consumers of a group take turns, two
// copies cannot be in flight at once: the router that processed the first copy shuts down,
// and the other router gets the second copy, as happens when a node goes away after its
// commit.
func testConcurrentDuplicates(t *testing.T, f *fixture) {
	topic := f.topic("in")
	gates := &gates{m: map[string]*gate{}}
	var nodes [2]*node
	for i := range nodes {
		b := f.openBroker(f.brokerURL)
		barrier := func(next processor.Processor) processor.Processor {
			return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
				if err := gates.wait(ctx, msg.ID, i); err != nil {
					return err
				}
				return next.Process(ctx, msg)
			})
		}
		nodes[i] = f.startNode(b, nil,
			handlerSpec{Name: "effects", Topic: topic, Inner: []onceflow.Stage{onceflow.Use("barrier", barrier)}, Concurrency: 1})
	}
	get := func(id string) (sum deliveryCounts, per [2]deliveryCounts) {
		for i, n := range nodes {
			c := n.probe.get("effects", id)
			per[i] = c
			sum.Deliveries += c.Deliveries
			sum.Acks += c.Acks
			sum.Nacks += c.Nacks
		}
		return sum, per
	}
	waitAcks := func(id string, n int) {
		t.Helper()
		f.eventually(func() bool { s, _ := get(id); return s.Acks >= n }, "copies of %s should be acked %d times: %v", id, n, lazy(func() any { _, per := get(id); return per }))
	}

	if !f.features.ConcurrentDelivery {
		id := f.id("dup")
		gates.open(id, false)
		f.publishCopy(nodes[0].broker, topic, id, "x", 1)
		waitAcks(id, 1)
		_, per := get(id)
		first := 0
		if per[1].Acks == 1 {
			first = 1
		}
		require.NoError(t, nodes[first].stop())
		f.publishCopy(nodes[0].broker, topic, id, "x", 2)
		waitAcks(id, 2)
		sum, per := get(id)
		require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 2}, sum, "%s: two copies delivered and acked, none nacked (router A %+v, router B %+v, the first stopped: %d)", id, per[0], per[1], first)
		require.Equal(t, deliveryCounts{Deliveries: 1, Acks: 1}, per[1-first], "%s: the second copy went to the other router", id)
		require.Equal(t, 1, f.effects("effects", id), "%s: one effect from two copies", id)
		return
	}

	concurrent := false
	for a := 1; a <= concurrentAttempts && !concurrent; a++ {
		id := f.id(fmt.Sprintf("dup%d", a))
		g := gates.open(id, true)
		f.publishCopy(nodes[0].broker, topic, id, "x", 1)
		f.publishCopy(nodes[0].broker, topic, id, "x", 2)
		select {
		case <-g.both:
			concurrent = true
		case <-time.After(attemptTimeout):
			// Both copies went to the same router, which holds one and has not taken the
			// other: let them go, and try again with another message.
		}
		g.release()
		waitAcks(id, 2)
		sum, per := get(id)
		require.Equal(t, deliveryCounts{Deliveries: 2, Acks: 2}, sum, "%s: two copies delivered and acked, none nacked", id)
		require.Equal(t, 1, f.effects("effects", id), "%s: one effect from two copies", id)
		t.Logf("attempt %d: copies of %s delivered to router A %d time(s), router B %d time(s); in flight on both at once: %v",
			a, id, per[0].Deliveries, per[1].Deliveries, concurrent)
	}
	require.True(t, concurrent, "in %d attempts, the broker never had the two copies in flight on the two routers at once", concurrentAttempts)
}

// gates hold the copies of a message until each router has one.
type gates struct {
	mu sync.Mutex
	m  map[string]*gate
}

type gate struct {
	arrived  [2]bool
	both     chan struct{} // closed when both routers hold a copy
	released chan struct{} // closed to let the copies go
	once     sync.Once
}

// open creates the gate of message id; unless hold, it lets copies through at once.
func (g *gates) open(id string, hold bool) *gate {
	gt := &gate{both: make(chan struct{}), released: make(chan struct{})}
	if !hold {
		gt.release()
	}
	g.mu.Lock()
	g.m[id] = gt
	g.mu.Unlock()
	return gt
}

func (gt *gate) release() { gt.once.Do(func() { close(gt.released) }) }

// wait records that router node holds a copy of id and waits until the gate is released.
func (g *gates) wait(ctx context.Context, id string, node int) error {
	g.mu.Lock()
	gt, ok := g.m[id]
	if ok && !gt.arrived[node] {
		gt.arrived[node] = true
		if gt.arrived[0] && gt.arrived[1] {
			close(gt.both)
		}
	}
	g.mu.Unlock()
	if !ok {
		return nil
	}
	select {
	case <-gt.released:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// cutMessages is the number of messages of ConnectionCut; the cut comes when half of them
// have been delivered.
const cutMessages = 50

// cutOutage is how long the broker stays unreachable: the length of the fault, long enough
// for clients to notice.
const cutOutage = 300 * time.Millisecond

// testConnectionCut: 50 messages wait on the broker; a router consumes them through a
// loopback TCP proxy. When half have been delivered, the delivery in hand is held, every
// connection through the proxy is cut, the held message commits (its ack then goes nowhere)
// and, after an outage, the proxy accepts connections again. The broker delivers again what
// was not acked; each message has exactly one effect.
func testConnectionCut(t *testing.T, f *fixture) {
	direct := f.openBroker(f.brokerURL)
	px := f.proxy(f.brokerURL)
	viaProxy := f.openBroker(px.url)
	topic := f.topic("in")

	half := make(chan string)
	resume := make(chan struct{})
	var mu sync.Mutex
	seen := map[string]bool{}
	holdAtHalf := func(next processor.Processor) processor.Processor {
		return processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			mu.Lock()
			seen[msg.ID] = true
			hold := len(seen) == cutMessages/2 && half != nil
			if hold {
				close(half)
				half = nil
			}
			mu.Unlock()
			if hold {
				select {
				case <-resume:
				case <-ctx.Done():
				}
			}
			return next.Process(ctx, msg)
		})
	}
	halfReached := half
	// All published first: on some brokers a publisher waits for a consumer's batch (MySQL
	// queue), which the held delivery keeps open.
	ids := make([]string, cutMessages)
	for i := range ids {
		ids[i] = f.id(fmt.Sprintf("m%02d", i))
		f.publish(direct, topic, ids[i], "x")
	}
	n := f.startNode(viaProxy, nil, handlerSpec{Name: "effects", Topic: topic, Outer: []onceflow.Stage{onceflow.Use("hold-at-half", holdAtHalf)}})
	select {
	case <-halfReached:
	case <-time.After(waitFor):
		t.Fatalf("half of the messages were not delivered: %d", len(f.effectCounts("effects")))
	}
	px.cut()
	close(resume) // the held message commits; its ack has no connection to go to
	time.Sleep(cutOutage)
	px.restore(t)

	f.eventually(func() bool { return len(f.effectCounts("effects")) >= cutMessages },
		"after the cut, %v of %d messages have an effect", lazy(func() any { return len(f.effectCounts("effects")) }), cutMessages)
	// Redeliveries of messages whose ack was lost may come up to an ack timeout later: wait
	// until every delivery is settled and none has come for longer than that.
	quiet := f.timings.AckTimeout + time.Second
	f.eventually(func() bool {
		inFlight, last := n.probe.inFlight()
		return inFlight == 0 && time.Since(last) > quiet
	}, "deliveries did not settle after the cut")

	counts := f.effectCounts("effects")
	for _, id := range ids {
		require.Equal(t, 1, counts[id], "%s: exactly one effect", id)
	}
	require.Len(t, counts, cutMessages, "effects of unknown messages")
	total := n.probe.total("effects")
	require.Equal(t, total.Deliveries, total.Acks+total.Nacks)
	t.Logf("connection cut: %d deliveries for %d messages (%d redelivered), %d nacks",
		total.Deliveries, cutMessages, total.Deliveries-cutMessages, total.Nacks)
}

// testForeignProducer: a producer that is not watermill publishes a message with the broker's
// native message id (twice, where the broker keeps both copies) and one without any id. The
// first is processed once; the second is dead-lettered with the reason, and never processed.
func testForeignProducer(t *testing.T, f *fixture) {
	b := f.openBroker(f.brokerURL)
	topic := f.topic("in")
	dead := f.collectDeadLetters(b)
	n := f.startNode(b, nil, handlerSpec{Name: "effects", Topic: topic})

	id := f.id("ext")
	copies := 2
	if f.features.DeduplicatesPublishes {
		copies = 1 // the broker would drop the second publish of the id
	}
	for range copies {
		f.features.ForeignProducer(t, f.brokerURL, topic, id, []byte("from elsewhere"))
	}
	f.features.ForeignProducer(t, f.brokerURL, topic, "", []byte("anonymous"))

	f.waitAcks(n.probe, "effects", id, copies)
	require.Equal(t, deliveryCounts{Deliveries: copies, Acks: copies}, n.probe.get("effects", id))
	require.Equal(t, 1, f.effects("effects", id), "one effect")

	if f.features.PositionIDs {
		// The message without an id has the id of its position: processed once, not
		// dead-lettered.
		positional := func() map[string]int {
			out := map[string]int{}
			for id, n := range f.effectCounts("effects") {
				if strings.HasPrefix(id, topic+"/") {
					out[id] = n
				}
			}
			return out
		}
		f.eventually(func() bool { return len(positional()) > 0 }, "the message without an id had no effect")
		effects := positional()
		require.Len(t, effects, 1, "the message without an id: %v", effects)
		for pos, count := range effects {
			require.Equal(t, 1, count, "%s: one effect", pos)
			f.waitAcks(n.probe, "effects", pos, 1)
			require.Equal(t, deliveryCounts{Deliveries: 1, Acks: 1}, n.probe.get("effects", pos))
		}
		require.Empty(t, dead.all(), "dead letters")
		return
	}
	f.eventually(func() bool { return len(dead.all()) >= 1 }, "the message without an id was not dead-lettered")
	require.Len(t, dead.all(), 1)
	dl := dead.all()[0]
	require.Equal(t, "anonymous", string(dl.Payload))
	require.NotEmpty(t, dl.UUID, "a dead letter gets an id, so that it can be replayed")
	reason := dl.Metadata.Get(messagedata.HeaderDeadLetterReason)
	require.True(t, strings.Contains(reason, "message has no id"), "dead-letter reason %q", reason)
	require.Equal(t, "effects", dl.Metadata.Get(messagedata.HeaderDeadLetterHandler))
	require.Equal(t, topic, dl.Metadata.Get(messagedata.HeaderDeadLetterTopic))
	f.waitAcks(n.probe, "effects", "", 1)
	require.Equal(t, deliveryCounts{Deliveries: 1, Acks: 1}, n.probe.get("effects", ""))
	require.Equal(t, 0, f.effects("effects", ""), "the message without an id was processed")
}
