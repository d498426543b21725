// Package brokertest is an in-memory broker for tests of the router: a watermill Publisher and
// Subscriber whose subscriptions to one topic compete for its messages, which redelivers nacked
// messages after the delay the router asks for (redelivery.NackAfter), counts the deliveries of
// each message as a broker does (redelivery.Info), and counts every ack and nack per message id.
//
// It stands in for the narrow message.Publisher and message.Subscriber interfaces only; the
// conformance suite runs the same scenarios against the real brokers.
package brokertest

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
)

// Broker is an in-memory, competing-consumer broker. The zero value is not usable; call New.
type Broker struct {
	mu     sync.Mutex
	topics map[string]chan *message.Message
	acks   map[string]int
	nacks  map[string]int
	// deliveries counts each message's deliveries, by message value: a redelivery is a copy
	// that carries its count on.
	deliveries map[*message.Message]int
	pending    sync.WaitGroup
	// directs counts the deliveries to consumers that settle directly.
	directs int
	// flushes counts the consumers' redelivery.Flush calls, early those of a message not
	// settled yet.
	flushes, early int
	closed         chan struct{}
	once           sync.Once
	// failing are the topics whose publishes fail, with their error.
	failing map[string]error

	// RedeliveryDelay is how long a nacked message waits before it is delivered again, unless
	// the router asked for another delay.
	RedeliveryDelay time.Duration

	// CountDeliveries, true by default, makes the broker count deliveries and delay nacks as
	// the router asks (redelivery.Info with Count and DelaysNacks). False makes it a broker
	// that only says whether a delivery is the first, and cannot delay a redelivery, as a
	// RabbitMQ classic queue: the router then counts and holds.
	CountDeliveries bool

	// Prefetch is how many deliveries a subscription keeps unsettled. Defaults to 1.
	Prefetch int
}

// New returns an empty broker.
func New() *Broker {
	return &Broker{
		topics:          map[string]chan *message.Message{},
		acks:            map[string]int{},
		nacks:           map[string]int{},
		deliveries:      map[*message.Message]int{},
		closed:          make(chan struct{}),
		RedeliveryDelay: 5 * time.Millisecond,
		CountDeliveries: true,
	}
}

func (b *Broker) topic(name string) chan *message.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	ch, ok := b.topics[name]
	if !ok {
		ch = make(chan *message.Message, 100000)
		b.topics[name] = ch
	}
	return ch
}

// Publish enqueues copies of msgs on topic.
func (b *Broker) Publish(topic string, msgs ...*message.Message) error {
	b.mu.Lock()
	err := b.failing[topic]
	b.mu.Unlock()
	if err != nil {
		return err
	}
	ch := b.topic(topic)
	for _, m := range msgs {
		c := message.NewMessage(m.UUID, m.Payload)
		for k, v := range m.Metadata {
			c.Metadata[k] = v
		}
		ch <- c
	}
	return nil
}

// FailPublish makes every publish to topic fail with err from now on, as a broker that is
// down; a nil err makes them succeed again.
func (b *Broker) FailPublish(topic string, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.failing == nil {
		b.failing = map[string]error{}
	}
	b.failing[topic] = err
}

// Subscriber is a view of the broker whose Close ends only its own subscriptions, as closing
// one consumer process does.
type Subscriber struct {
	b      *Broker
	closed chan struct{}
	once   sync.Once
}

// Subscriber returns a new consumer of the broker.
func (b *Broker) Subscriber() *Subscriber {
	return &Subscriber{b: b, closed: make(chan struct{})}
}

// Close ends the subscriptions made through s.
func (s *Subscriber) Close() error {
	s.once.Do(func() { close(s.closed) })
	return nil
}

// Subscribe returns a subscription that competes with the other subscriptions to topic. It
// keeps up to Prefetch deliveries unsettled (one by default: each delivered message waits for
// its ack or nack before the next). A message in flight when the subscription ends goes back to
// the topic.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	b := s.b
	ctx, stop := context.WithCancel(ctx)
	go func() {
		select {
		case <-s.closed:
		case <-b.closed:
		case <-ctx.Done():
		}
		stop()
	}()
	in := b.topic(topic)
	out := make(chan *message.Message)
	window := make(chan struct{}, max(b.Prefetch, 1))
	var inFlight sync.WaitGroup
	go func() {
		defer close(out)
		defer inFlight.Wait()
		for {
			select {
			case <-ctx.Done():
				return
			case window <- struct{}{}:
			}
			var m *message.Message
			select {
			case <-ctx.Done():
				return
			case m = <-in:
			}
			msgCtx, cancel := context.WithCancel(ctx)
			count := b.delivered(m)
			info := redelivery.Info{Count: count, DelaysNacks: true}
			if !b.CountDeliveries {
				info = redelivery.Info{Redelivered: count > 1}
			}
			// settled is the message's outcome, taken once: by the consumer's ack or nack, or
			// by the end of the subscription.
			var taken atomic.Bool
			settled := func(acked, nacked, gone bool) {
				if !taken.CompareAndSwap(false, true) {
					return
				}
				defer inFlight.Done()
				defer func() { <-window }()
				defer cancel()
				switch {
				case acked:
					b.count(b.acks, m.UUID)
				case nacked:
					b.count(b.nacks, m.UUID)
					b.redeliver(topic, m)
				case gone:
					// The consumer went away without settling the message: like a broker
					// whose consumer died, deliver it again.
					in <- b.again(m)
				}
			}
			direct := redelivery.SettlesDirectly(ctx)
			if direct {
				b.mu.Lock()
				b.directs++
				b.mu.Unlock()
				// One context holds the info and both functions, as the real subscribers make it.
				msgCtx = redelivery.NewDeliveryContext(msgCtx, info, func() {
					acked := redelivery.Acked(m)
					settled(acked, !acked, false)
				}, func() {
					b.mu.Lock()
					defer b.mu.Unlock()
					b.flushes++
					if !taken.Load() {
						b.early++
					}
				})
			} else {
				msgCtx = redelivery.NewContext(msgCtx, info)
			}
			m.SetContext(msgCtx)
			inFlight.Add(1)
			select {
			case out <- m:
			case <-ctx.Done():
				taken.Store(true)
				inFlight.Done()
				cancel()
				in <- b.again(m)
				return
			}
			go func() {
				if direct {
					// Only the end of the subscription is waited for: the consumer tells of
					// its ack or nack itself.
					<-ctx.Done()
				} else {
					select {
					case <-m.Acked():
						settled(true, false, false)
						return
					case <-m.Nacked():
						settled(false, true, false)
						return
					case <-ctx.Done():
					}
				}
				select {
				case <-m.Acked():
					settled(true, false, false)
				default:
					settled(false, false, true)
				}
			}()
		}
	}()
	return out, nil
}

// delivered counts a delivery of m and returns its count.
func (b *Broker) delivered(m *message.Message) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.deliveries[m]++
	return b.deliveries[m]
}

// again returns the copy of m that is delivered next, carrying m's delivery count on.
func (b *Broker) again(m *message.Message) *message.Message {
	c := m.Copy()
	b.mu.Lock()
	b.deliveries[c] = b.deliveries[m]
	delete(b.deliveries, m)
	b.mu.Unlock()
	return c
}

func (b *Broker) redeliver(topic string, m *message.Message) {
	delay := b.RedeliveryDelay
	if d, ok := redelivery.RequestedDelay(m.Context()); ok {
		delay = d
	}
	c := b.again(m)
	b.pending.Add(1)
	go func() {
		defer b.pending.Done()
		select {
		case <-time.After(delay):
			b.topic(topic) <- c
		case <-b.closed:
		}
	}()
}

func (b *Broker) count(m map[string]int, id string) {
	b.mu.Lock()
	m[id]++
	b.mu.Unlock()
}

// DirectDeliveries returns how many deliveries went to consumers that promised to settle each
// message themselves (redelivery.WithDirectSettle).
func (b *Broker) DirectDeliveries() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.directs
}

// Flushes returns how many times consumers called redelivery.Flush on the messages of the
// broker, and how many of those calls came for a message not settled yet.
func (b *Broker) Flushes() (flushes, early int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.flushes, b.early
}

// Acks returns how many times the message with id was acked.
func (b *Broker) Acks(id string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.acks[id]
}

// Nacks returns how many times the message with id was nacked.
func (b *Broker) Nacks(id string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.nacks[id]
}

// TotalAcks returns the number of acks of all messages.
func (b *Broker) TotalAcks() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, v := range b.acks {
		n += v
	}
	return n
}

// TotalNacks returns the number of nacks of all messages.
func (b *Broker) TotalNacks() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, v := range b.nacks {
		n += v
	}
	return n
}

// Drain removes and returns the messages waiting on topic, without acking anything.
func (b *Broker) Drain(topic string) []*message.Message {
	ch := b.topic(topic)
	var out []*message.Message
	for {
		select {
		case m := <-ch:
			out = append(out, m)
		default:
			return out
		}
	}
}

// Close stops every subscription and pending redelivery. It is safe to call more than once.
func (b *Broker) Close() error {
	b.once.Do(func() { close(b.closed) })
	b.pending.Wait()
	return nil
}
