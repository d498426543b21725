package broker

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
)

// memHubs holds the in-process brokers by name: every Broker opened with mem://name shares
// name's hub until the last of them closes.
var memHubs = struct {
	sync.Mutex
	m map[string]*memHub
}{m: map[string]*memHub{}}

// memHub is one in-process broker: a persistent gochannel with one gochannel subscription per
// topic and consumer group. The consumers of a group read that subscription's channel, so they
// compete for its messages, while every group gets every message.
type memHub struct {
	name string
	gc   *gochannel.GoChannel
	refs int // guarded by memHubs

	mu     sync.Mutex
	groups map[[2]string]<-chan *message.Message
}

func openMem(t *target, o Options) (*backend, error) {
	if len(t.u.Query()) > 0 {
		return nil, fmt.Errorf("mem:// takes no query parameters other than group, prefetch, nack_delay, ack_timeout and poll_interval")
	}
	name := t.u.Host + strings.TrimSuffix(t.u.Path, "/")
	memHubs.Lock()
	h, ok := memHubs.m[name]
	if !ok {
		h = &memHub{
			name: name,
			// Persistent: a consumer group that subscribes late still gets every message.
			gc:     gochannel.NewGoChannel(gochannel.Config{Persistent: true}, o.Logger),
			groups: map[[2]string]<-chan *message.Message{},
		}
		memHubs.m[name] = h
	}
	h.refs++
	memHubs.Unlock()

	group := o.ConsumerGroup
	return &backend{
		pub: memPublisher{h.gc},
		newSubscriber: func() (message.Subscriber, error) {
			return memSubscriber{hub: h, group: group}, nil
		},
		// gochannel delivers a nacked message again at once, and waits for ever for the
		// message of a consumer that went away: the relay delays nacks and nacks for it.
		relayNackDelay: o.nackDelay(),
		nackOnClose:    true,
		close:          h.release,
	}, nil
}

// release drops one reference to the hub and closes it with the last one.
func (h *memHub) release() error {
	memHubs.Lock()
	h.refs--
	last := h.refs == 0
	if last {
		delete(memHubs.m, h.name)
	}
	memHubs.Unlock()
	if last {
		return h.gc.Close()
	}
	return nil
}

// group returns the channel of topic's messages for group, subscribing once per topic and
// group.
func (h *memHub) group(topic, group string) (<-chan *message.Message, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	key := [2]string{topic, group}
	if ch, ok := h.groups[key]; ok {
		return ch, nil
	}
	ch, err := h.gc.Subscribe(context.Background(), topic)
	if err != nil {
		return nil, err
	}
	h.groups[key] = ch
	return ch, nil
}

// memPublisher publishes to a hub; the Broker closes the hub, not the publisher.
type memPublisher struct{ gc *gochannel.GoChannel }

func (p memPublisher) Publish(topic string, msgs ...*message.Message) error {
	return p.gc.Publish(topic, msgs...)
}

func (memPublisher) Close() error { return nil }

// memSubscriber is one consumer of a hub. Its subscriptions read the group's channel; the
// relay in front of it gives back what it held when it closes.
type memSubscriber struct {
	hub   *memHub
	group string
}

func (s memSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ch, err := s.hub.group(topic, s.group)
	if err != nil {
		return nil, err
	}
	return ch, nil
}

func (memSubscriber) Close() error { return nil }
