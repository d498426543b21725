package amqp

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/connect"
)

func init() {
	broker.Register("amqp", openScheme, broker.Params{
		Own:        []string{ParamQueueType, ParamDeliveryLimit, ParamDeadLetterExchange},
		Client:     clientParams,
		ClientName: "amqp091-go",
	})
}

// clientParams are the URL query parameters of amqp091-go's ParseURI (v1.10), which ignores
// any other.
var clientParams = []string{
	"auth_mechanism", "heartbeat", paramConnectionTimeout, "channel_max",
	"cacertfile", "certfile", "keyfile", "server_name_indication",
}

// paramConnectionTimeout is amqp091-go's URL parameter for the dial and handshake timeout, in
// milliseconds.
const paramConnectionTimeout = "connection_timeout"

// openScheme publishes with watermill-amqp's publisher and consumes with this package's
// Subscriber, both over Topology, with the queue parameters of the URL (ParseQueueParams).
// Every dial, handshake included, is bounded by opts.ConnectTimeout.
func openScheme(_ context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	dsn, queue, err := ParseQueueParams(t.URL)
	if err == nil {
		err = checkClientParams(t.Parsed.Query())
	}
	if err != nil {
		return nil, err
	}
	dsn = withConnectionTimeout(dsn, o)
	topology := Topology{ConsumerGroup: o.ConsumerGroup, Queue: queue}
	cfg := Config{
		URL:       dsn,
		Topology:  topology,
		Prefetch:  o.Prefetch,
		NackDelay: max(o.NackDelay, 0),
		Logger:    o.Logger,
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	start := time.Now()
	pub, err := NewPublisher(dsn, topology, o.Logger)
	if err != nil {
		// amqp091-go reports the handshake deadline as a frame error that carries the I/O
		// timeout as text only: a dial that failed once the timeout had passed failed on it.
		if time.Since(start) >= o.ConnectTimeout {
			err = &connect.TimeoutError{Timeout: o.ConnectTimeout, Err: err}
		}
		return nil, err
	}
	return &broker.Backend{
		Publisher:  pub,
		CheckTopic: topology.CheckTopic,
		NewSubscriber: func() (message.Subscriber, error) {
			return NewSubscriber(cfg)
		},
		View: newView(dsn, o.ConsumerGroup),
	}, nil
}

// withConnectionTimeout sets amqp091-go's connection_timeout, which bounds the dial and the
// AMQP handshake (and the TLS one), to opts.ConnectTimeout, unless the URL sets it itself.
func withConnectionTimeout(dsn string, o broker.Options) string {
	base, query, _ := strings.Cut(dsn, "?")
	q, err := url.ParseQuery(query)
	if err != nil || q.Has(paramConnectionTimeout) {
		return dsn
	}
	q.Set(paramConnectionTimeout, strconv.FormatInt(o.ConnectTimeout.Milliseconds(), 10))
	return base + "?" + q.Encode()
}

// checkClientParams checks the values of amqp091-go's numeric parameters, which it reads only
// when it dials, naming the parameter (its own error for channel_max names another).
func checkClientParams(q url.Values) error {
	for _, p := range []struct {
		name string
		bits int
	}{{"heartbeat", 31}, {paramConnectionTimeout, 31}, {"channel_max", 16}} {
		if !q.Has(p.name) {
			continue
		}
		v := q.Get(p.name)
		if _, err := strconv.ParseUint(v, 10, p.bits); err != nil {
			return fmt.Errorf("broker/amqp: URL parameter %s=%q: want a whole number from 0 to %d", p.name, v, uint64(1)<<p.bits-1)
		}
	}
	return nil
}
