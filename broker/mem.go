package broker

import (
	"fmt"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/mem"
)

// memHubs holds the in-process brokers by name: every Broker opened with mem://name shares
// name's hub until the last of them closes.
var memHubs = struct {
	sync.Mutex
	m map[string]*memHub
}{m: map[string]*memHub{}}

// memHub is one in-process broker (package broker/mem) and its references.
type memHub struct {
	name string
	hub  *mem.Hub
	refs int // guarded by memHubs
}

func openMem(t *target, o Options) (*backend, error) {
	if len(t.u.Query()) > 0 {
		return nil, fmt.Errorf("mem:// takes no query parameters other than group, prefetch, nack_delay, ack_timeout and poll_interval")
	}
	name := t.u.Host + strings.TrimSuffix(t.u.Path, "/")
	memHubs.Lock()
	h, ok := memHubs.m[name]
	if !ok {
		h = &memHub{name: name, hub: mem.NewHub()}
		memHubs.m[name] = h
	}
	h.refs++
	memHubs.Unlock()

	cfg := mem.Config{ConsumerGroup: o.ConsumerGroup, Prefetch: o.Prefetch, NackDelay: o.nackDelay()}
	return &backend{
		pub: memPublisher{h.hub},
		newSubscriber: func() (message.Subscriber, error) {
			return mem.NewSubscriber(h.hub, cfg)
		},
		native: true,
		close:  h.release,
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
		return h.hub.Close()
	}
	return nil
}

// memPublisher publishes to a hub; the Broker closes the hub, not the publisher.
type memPublisher struct{ hub *mem.Hub }

func (p memPublisher) Publish(topic string, msgs ...*message.Message) error {
	return p.hub.Publish(topic, msgs...)
}

func (memPublisher) Close() error { return nil }
