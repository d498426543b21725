package conformance

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/messagedata"
)

// probe stands between a broker's Subscriber and the router, and counts what the broker sees:
// each delivery, and whether the router acked or nacked it. It hands the router the broker's
// own message, so the ack or nack it watches is the one the broker gets.
type probe struct {
	mu     sync.Mutex
	counts map[probeKey]*deliveryCounts
	last   time.Time // of the last delivery
	stop   chan struct{}
}

type probeKey struct{ handler, id string }

// deliveryCounts are the deliveries of one message to one handler, and how they were settled.
type deliveryCounts struct {
	Deliveries, Acks, Nacks int
}

func newProbe(t *testing.T) *probe {
	p := &probe{counts: map[probeKey]*deliveryCounts{}, stop: make(chan struct{})}
	t.Cleanup(func() { close(p.stop) })
	return p
}

// wrap returns sub with the deliveries of its subscriptions counted under handler.
func (p *probe) wrap(handler string, sub message.Subscriber) message.Subscriber {
	return &probedSubscriber{Subscriber: sub, p: p, handler: handler}
}

// get returns the counts of message id for handler.
func (p *probe) get(handler, id string) deliveryCounts {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.counts[probeKey{handler, id}]; ok {
		return *c
	}
	return deliveryCounts{}
}

// inFlight returns the number of deliveries not settled yet, and the time of the last one.
func (p *probe) inFlight() (int, time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.counts {
		n += c.Deliveries - c.Acks - c.Nacks
	}
	return n, p.last
}

// total returns the sum of the counts of every message of handler.
func (p *probe) total(handler string) deliveryCounts {
	p.mu.Lock()
	defer p.mu.Unlock()
	var sum deliveryCounts
	for k, c := range p.counts {
		if k.handler == handler {
			sum.Deliveries += c.Deliveries
			sum.Acks += c.Acks
			sum.Nacks += c.Nacks
		}
	}
	return sum
}

func (p *probe) delivered(handler string, m *message.Message) {
	k := probeKey{handler, messageID(m)}
	p.mu.Lock()
	c, ok := p.counts[k]
	if !ok {
		c = &deliveryCounts{}
		p.counts[k] = c
	}
	c.Deliveries++
	p.last = time.Now()
	p.mu.Unlock()

	go func() {
		select {
		case <-m.Acked():
			p.mu.Lock()
			c.Acks++
			p.mu.Unlock()
		case <-m.Nacked():
			p.mu.Lock()
			c.Nacks++
			p.mu.Unlock()
		case <-p.stop:
		}
	}()
}

// messageID is the id the converter gives m, by the same rules: the watermill UUID, the
// onceflow_id header, the AMQP message_id property.
func messageID(m *message.Message) string {
	if m.UUID != "" {
		return m.UUID
	}
	if id := m.Metadata.Get(messagedata.HeaderID); id != "" {
		return id
	}
	return m.Metadata.Get(messagedata.HeaderAMQPMessageID)
}

type probedSubscriber struct {
	message.Subscriber
	p       *probe
	handler string
}

func (s *probedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for m := range in {
			s.p.delivered(s.handler, m)
			select {
			case out <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}
