// Package mem is an in-process broker for tests: topics, consumer groups, many deliveries in
// flight per subscription, delivery counts and delayed redelivery, with nothing on disk. It
// keeps the contract of onceflow's other subscribers (see package broker/redelivery), so that
// tests of the router and of the conformance suite see a broker, not a stand-in: every message
// of a topic goes to every consumer group, each once to one of the group's subscriptions at a
// time; a nacked message comes back after its delay with its count up by one; a subscription
// that ends gives back what it held.
//
// Messages live as long as the Hub: a process that dies loses them, which is why it is for
// tests only. Importing the package registers the mem:// scheme of broker.Open, whose Brokers
// share the Hub of their URL's name.
package mem

import (
	"container/heap"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// DefaultPrefetch is the window of a subscription whose Config names none.
const DefaultPrefetch = 10

// ErrClosed is returned by a closed Hub, and by Publishers and Subscribers of one.
var ErrClosed = errors.New("mem: closed")

// Config configures the Subscribers of a Hub.
type Config struct {
	// ConsumerGroup is the group of the subscriptions. Required.
	ConsumerGroup string
	// Prefetch is how many deliveries a subscription keeps unsettled. Defaults to
	// DefaultPrefetch.
	Prefetch int
	// NackDelay is how long a nacked message waits before it is delivered again when the
	// router asked for no delay of its own. Zero redelivers at once.
	NackDelay time.Duration
}

// Hub is one in-process broker. It is safe for concurrent use.
type Hub struct {
	mu     sync.Mutex
	topics map[string]*topic
	closed bool
}

// NewHub returns an empty Hub.
func NewHub() *Hub { return &Hub{topics: map[string]*topic{}} }

type topic struct {
	log    []*message.Message // every message published, for groups that come later
	groups map[string]*group
}

// entry is one message as one group holds it.
type entry struct {
	msg        *message.Message
	deliveries int
	visibleAt  time.Time
	index      int // in the group's delayed heap
}

// group is one consumer group's view of a topic.
type group struct {
	ready   []*entry
	delayed delayedHeap
	wake    chan struct{} // closed and replaced when an entry becomes ready
}

func newGroup(log []*message.Message) *group {
	g := &group{wake: make(chan struct{})}
	for _, m := range log {
		g.ready = append(g.ready, &entry{msg: m})
	}
	return g
}

func (g *group) signal() {
	close(g.wake)
	g.wake = make(chan struct{})
}

// Publish stores copies of msgs on topic for every consumer group, present and future.
func (h *Hub) Publish(name string, msgs ...*message.Message) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return ErrClosed
	}
	t := h.topic(name)
	for _, m := range msgs {
		c := message.NewMessage(m.UUID, append([]byte(nil), m.Payload...))
		for k, v := range m.Metadata {
			c.Metadata[k] = v
		}
		t.log = append(t.log, c)
		for _, g := range t.groups {
			g.ready = append(g.ready, &entry{msg: c})
			g.signal()
		}
	}
	return nil
}

func (h *Hub) topic(name string) *topic {
	t, ok := h.topics[name]
	if !ok {
		t = &topic{groups: map[string]*group{}}
		h.topics[name] = t
	}
	return t
}

func (h *Hub) group(topicName, name string) *group {
	t := h.topic(topicName)
	g, ok := t.groups[name]
	if !ok {
		g = newGroup(t.log)
		t.groups[name] = g
	}
	return g
}

// Close ends every subscription. Publishing fails from then on.
func (h *Hub) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	for _, t := range h.topics {
		for _, g := range t.groups {
			g.signal()
		}
	}
	return nil
}

// Subscriber is a consumer of a Hub in one consumer group.
type Subscriber struct {
	h   *Hub
	cfg Config

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	subs    sync.WaitGroup
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber returns a consumer of h in cfg.ConsumerGroup.
func NewSubscriber(h *Hub, cfg Config) (*Subscriber, error) {
	if cfg.ConsumerGroup == "" {
		return nil, errors.New("mem: Config.ConsumerGroup is empty")
	}
	if cfg.Prefetch < 0 || cfg.NackDelay < 0 {
		return nil, errors.New("mem: Config.Prefetch and Config.NackDelay must not be negative")
	}
	if cfg.Prefetch == 0 {
		cfg.Prefetch = DefaultPrefetch
	}
	return &Subscriber{h: h, cfg: cfg, closing: make(chan struct{})}, nil
}

// Subscribe starts one competing consumer of topicName; see the package documentation.
func (s *Subscriber) Subscribe(ctx context.Context, topicName string) (<-chan *message.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	s.h.mu.Lock()
	closed := s.h.closed
	if !closed {
		s.h.group(topicName, s.cfg.ConsumerGroup)
	}
	s.h.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	out := make(chan *message.Message)
	sub := &subscription{s: s, topic: topicName, out: out, settled: make(chan settlement, s.cfg.Prefetch), done: make(chan struct{})}
	s.subs.Add(1)
	go sub.run(ctx)
	return out, nil
}

// Close ends the Subscriber's subscriptions, giving back what they held; it waits for them.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.closing)
	}
	s.mu.Unlock()
	s.subs.Wait()
	return nil
}

type settlement struct {
	e     *entry
	acked bool
	delay time.Duration
}

type subscription struct {
	s       *Subscriber
	topic   string
	out     chan *message.Message
	held    map[*entry]heldDelivery
	settled chan settlement
	done    chan struct{} // closed when run returns
}

type heldDelivery struct {
	msg    *message.Message
	cancel context.CancelFunc
}

func (sub *subscription) run(ctx context.Context) {
	defer sub.s.subs.Done()
	defer close(sub.out)
	defer close(sub.done)
	sub.held = map[*entry]heldDelivery{}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer sub.giveBack()
	for {
		// Settle what came back, then take what the window has room for.
		for {
			select {
			case st := <-sub.settled:
				sub.settle(st)
				continue
			default:
			}
			break
		}
		var e *entry
		var wake <-chan struct{}
		var next time.Duration = -1
		h := sub.s.h
		h.mu.Lock()
		if h.closed {
			h.mu.Unlock()
			return
		}
		g := h.group(sub.topic, sub.s.cfg.ConsumerGroup)
		g.release(time.Now())
		if len(sub.held) < sub.s.cfg.Prefetch && len(g.ready) > 0 {
			e = g.ready[0]
			g.ready = g.ready[1:]
			e.deliveries++
		}
		wake = g.wake
		if len(g.delayed) > 0 {
			next = time.Until(g.delayed[0].visibleAt)
		}
		h.mu.Unlock()

		if e != nil {
			if !sub.deliver(ctx, e) {
				return
			}
			continue
		}
		var timer <-chan time.Time
		var t *time.Timer
		if next >= 0 {
			t = time.NewTimer(next)
			timer = t.C
		}
		stop := false
		select {
		case st := <-sub.settled:
			sub.settle(st)
		case <-wake:
		case <-timer:
		case <-ctx.Done():
			stop = true
		case <-sub.s.closing:
			stop = true
		}
		if t != nil {
			t.Stop()
		}
		if stop {
			return
		}
	}
}

// deliver hands e out and watches its settlement. It reports false when the subscription ends
// before the consumer takes it.
func (sub *subscription) deliver(ctx context.Context, e *entry) bool {
	m := e.msg.Copy()
	mctx, cancel := context.WithCancel(ctx)
	m.SetContext(redelivery.NewContext(mctx, redelivery.Info{Count: e.deliveries, DelaysNacks: true}))
	sub.held[e] = heldDelivery{msg: m, cancel: cancel}
	select {
	case sub.out <- m:
	case <-ctx.Done():
		sub.untaken(e)
		return false
	case <-sub.s.closing:
		sub.untaken(e)
		return false
	}
	go func() {
		var st settlement
		select {
		case <-m.Acked():
			st = settlement{e: e, acked: true}
		case <-m.Nacked():
			st = sub.nacked(e, m)
		case <-mctx.Done():
			return
		}
		cancel() // the delivery is over
		select {
		case sub.settled <- st:
		case <-sub.done: // giveBack looks at the message itself
		}
	}()
	return true
}

// untaken forgets e, which the consumer never took: its delivery does not count, and giveBack
// returns it to the group.
func (sub *subscription) untaken(e *entry) {
	sub.s.h.mu.Lock()
	e.deliveries--
	sub.s.h.mu.Unlock()
}

func (sub *subscription) nacked(e *entry, m *message.Message) settlement {
	d, ok := redelivery.RequestedDelay(m.Context())
	if !ok {
		d = sub.s.cfg.NackDelay
	}
	return settlement{e: e, delay: d}
}

func (sub *subscription) settle(st settlement) {
	d, ok := sub.held[st.e]
	if !ok {
		return
	}
	delete(sub.held, st.e)
	d.cancel()
	if st.acked {
		return
	}
	h := sub.s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	sub.requeue(h.group(sub.topic, sub.s.cfg.ConsumerGroup), st)
}

// requeue puts the entry of a nacked delivery back for its group, after its delay.
func (sub *subscription) requeue(g *group, st settlement) {
	if st.delay <= 0 {
		g.ready = append(g.ready, st.e)
	} else {
		st.e.visibleAt = time.Now().Add(st.delay)
		heap.Push(&g.delayed, st.e)
	}
	g.signal()
}

// giveBack returns what the subscription holds to the group, as a consumer that went away
// does; a delivery that was acked or nacked before is settled as the consumer said.
func (sub *subscription) giveBack() {
	h := sub.s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	g := h.group(sub.topic, sub.s.cfg.ConsumerGroup)
	for e, d := range sub.held {
		select {
		case <-d.msg.Acked():
		case <-d.msg.Nacked():
			sub.requeue(g, sub.nacked(e, d.msg))
		default:
			g.ready = append(g.ready, e)
		}
		d.cancel()
	}
	sub.held = nil
	g.signal()
}

// release moves the delayed entries that are due to the ready list.
func (g *group) release(now time.Time) {
	for len(g.delayed) > 0 && !g.delayed[0].visibleAt.After(now) {
		g.ready = append(g.ready, heap.Pop(&g.delayed).(*entry))
	}
}

type delayedHeap []*entry

func (q delayedHeap) Len() int           { return len(q) }
func (q delayedHeap) Less(i, j int) bool { return q[i].visibleAt.Before(q[j].visibleAt) }
func (q delayedHeap) Swap(i, j int)      { q[i], q[j] = q[j], q[i]; q[i].index = i; q[j].index = j }
func (q *delayedHeap) Push(x any)        { e := x.(*entry); e.index = len(*q); *q = append(*q, e) }
func (q *delayedHeap) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}
