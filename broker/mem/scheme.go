package mem

import (
	"context"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
)

func init() { broker.Register("mem", openScheme, broker.Params{}) }

// hubs holds the in-process brokers of broker.Open by name: every Broker opened with
// mem://name shares name's Hub until the last of them closes.
var hubs = struct {
	sync.Mutex
	m map[string]*namedHub
}{m: map[string]*namedHub{}}

// namedHub is one in-process broker of broker.Open and its references.
type namedHub struct {
	name string
	hub  *Hub
	refs int // guarded by hubs
}

// openScheme opens broker.Open's mem:// scheme. There is no connect: opts.ConnectTimeout does
// not apply.
func openScheme(_ context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	name := t.Parsed.Host + strings.TrimSuffix(t.Parsed.Path, "/")
	hubs.Lock()
	h, ok := hubs.m[name]
	if !ok {
		h = &namedHub{name: name, hub: NewHub()}
		hubs.m[name] = h
	}
	h.refs++
	hubs.Unlock()

	cfg := Config{ConsumerGroup: o.ConsumerGroup, Prefetch: o.Prefetch, NackDelay: max(o.NackDelay, 0)}
	return &broker.Backend{
		Publisher: hubPublisher{h.hub},
		NewSubscriber: func() (message.Subscriber, error) {
			return NewSubscriber(h.hub, cfg)
		},
		Close: h.release,
	}, nil
}

// release drops one reference to the hub and closes it with the last one.
func (h *namedHub) release() error {
	hubs.Lock()
	h.refs--
	last := h.refs == 0
	if last {
		delete(hubs.m, h.name)
	}
	hubs.Unlock()
	if last {
		return h.hub.Close()
	}
	return nil
}

// hubPublisher publishes to a hub; the Broker closes the hub, not the publisher.
type hubPublisher struct{ *Hub }

func (hubPublisher) Close() error { return nil }
