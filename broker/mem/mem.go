// Package mem is an in-process broker for tests: topics, consumer groups, many deliveries in
// flight per subscription, delivery counts and delayed redelivery. It gives the guarantees
// package broker lists for every scheme, so that tests of the router and of the conformance
// suite see a broker, not a stand-in; but its messages live as long as the Hub, in memory.
// Importing the package registers the mem:// scheme of broker.Open, whose Brokers share the
// Hub of their URL's name.
package mem

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/inflight"
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
	// DefaultPrefetch, or to the window the consumer asks for when it subscribes
	// (redelivery.WithWindow) when that is larger.
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
}

// group is one consumer group's view of a topic. A nacked entry waits for its delay out of it.
type group struct {
	ready []*entry
	wake  chan struct{} // closed and replaced when an entry becomes ready
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
		c := m.Copy()
		c.Payload = append([]byte(nil), m.Payload...)
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
		// A new group reads the topic from its start.
		g = &group{wake: make(chan struct{})}
		for _, m := range t.log {
			g.ready = append(g.ready, &entry{msg: m})
		}
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
	h    *Hub
	cfg  Config
	subs *inflight.Group
}

var _ message.Subscriber = (*Subscriber)(nil)

// rules are the defaults and bounds of Config's Prefetch and NackDelay.
var rules = inflight.Rules{Scheme: "mem", Prefetch: DefaultPrefetch}

// NewSubscriber returns a consumer of h in cfg.ConsumerGroup.
func NewSubscriber(h *Hub, cfg Config) (*Subscriber, error) {
	if cfg.ConsumerGroup == "" {
		return nil, errors.New("mem: Config.ConsumerGroup is empty")
	}
	if err := rules.Validate(inflight.Settings{Prefetch: cfg.Prefetch, NackDelay: cfg.NackDelay}); err != nil {
		return nil, err
	}
	return &Subscriber{h: h, cfg: cfg, subs: inflight.NewGroup(ErrClosed)}, nil
}

// Subscribe starts one competing consumer of topicName; see the package documentation.
func (s *Subscriber) Subscribe(ctx context.Context, topicName string) (<-chan *message.Message, error) {
	if err := s.subs.Check(); err != nil {
		return nil, err
	}
	s.h.mu.Lock()
	closed := s.h.closed
	s.h.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	src := &source{h: s.h, topic: topicName, group: s.cfg.ConsumerGroup}
	src.sub = inflight.New(ctx, src, inflight.Options{
		Prefetch:  rules.Window(ctx, s.cfg.Prefetch),
		NackDelay: s.cfg.NackDelay,
		Eager:     true,
	})
	return src.sub.Start(s.subs)
}

// Close ends the Subscriber's subscriptions, giving back what they held; it waits for them.
func (s *Subscriber) Close() error { return s.subs.Close(nil) }

// source is the broker side of one subscription (inflight.Source): it takes the ready entries
// of its group and puts back those nacked or given back.
type source struct {
	h     *Hub
	topic string
	group string
	sub   *inflight.Subscription[*entry]
}

// Fetch delivers up to n ready entries of the group, or waits until one is ready.
func (src *source) Fetch(ctx context.Context, n int) error {
	h := src.h
	for {
		h.mu.Lock()
		if h.closed {
			h.mu.Unlock()
			return ErrClosed
		}
		g := h.group(src.topic, src.group)
		k := 0
		for ; k < n && len(g.ready) > 0; k++ {
			e := g.ready[0]
			e.deliveries++
			if src.sub.Emit(inflight.Item[*entry]{Data: e, Msg: e.msg.Copy(), Count: e.deliveries}) == nil {
				e.deliveries-- // the subscription stops: it stays ready
				break
			}
			g.ready[0] = nil
			g.ready = g.ready[1:]
		}
		wake := g.wake
		h.mu.Unlock()
		if k > 0 {
			return nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return nil
		}
	}
}

// Settle puts a nacked entry back for its group after its delay, and an unsettled one given
// back at once, its delivery not counted if the consumer never took it.
func (src *source) Settle(d *inflight.Delivery[*entry], o inflight.Outcome) {
	switch e := d.Data; {
	case o.Acked:
	case o.Delay > 0:
		time.AfterFunc(o.Delay, func() { src.requeue(e, false) })
	default:
		src.requeue(e, !o.Nacked && !d.HandedOut())
	}
}

// requeue makes e ready again for the group, uncounting its last delivery with uncount.
func (src *source) requeue(e *entry, uncount bool) {
	h := src.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if uncount {
		e.deliveries--
	}
	g := h.group(src.topic, src.group)
	g.ready = append(g.ready, e)
	g.signal()
}

// Close has nothing to release: Settle gave everything back.
func (*source) Close(context.Context) error { return nil }
