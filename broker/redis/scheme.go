package redis

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/wmlog"
)

func init() {
	broker.Register("redis", openScheme, broker.Params{Client: clientParams, ClientName: "go-redis"})
}

// clientParams are the URL options of go-redis's ParseURL (v9.12), which refuses any other
// (skip_verify with rediss:// only).
var clientParams = []string{
	"db", "protocol", "client_name", "max_retries", "min_retry_backoff", "max_retry_backoff",
	"dial_timeout", "read_timeout", "write_timeout", "pool_fifo", "pool_size", "pool_timeout",
	"min_idle_conns", "max_idle_conns", "max_active_conns", "conn_max_idle_time",
	"conn_max_lifetime", "idle_timeout", "max_conn_age", "skip_verify",
}

// openScheme publishes with watermill-redisstream's publisher and subscribes with this
// package's Subscriber. Open's ping, the connect and handshake (HELLO, AUTH) included, is
// bounded by opts.ConnectTimeout, and so is the dial of every connection of the clients,
// unless the URL sets dial_timeout; the handshakes of later connections by ReadTimeout.
func openScheme(ctx context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	ropts, err := redis.ParseURL(t.URL)
	if err != nil {
		return nil, err
	}
	if !t.Parsed.Query().Has("dial_timeout") {
		ropts.DialTimeout = o.ConnectTimeout
	}
	// The publisher's client heeds the deadlines of contexts, so that the ping below, its
	// connect and handshake (HELLO, AUTH) included, ends with the connect timeout rather than
	// with ReadTimeout (3 s by default).
	pubOpts := *ropts
	pubOpts.ContextTimeoutEnabled = true
	client := redis.NewClient(&pubOpts)
	pingCtx, cancel := context.WithTimeout(ctx, o.ConnectTimeout)
	defer cancel()
	if err := client.Ping(pingCtx).Err(); err != nil {
		_ = client.Close()
		return nil, err
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client, Marshaller: Marshaller{}}, wmlog.Adapter(o.Logger))
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	// A subscription notices a lost connection by a failed command: the subscribers' clients
	// do not retry.
	subOpts := *ropts
	subOpts.MaxRetries = -1
	cfg := Config{
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      o.Prefetch,
		NackDelay:     o.NackDelay, // NoNackDelay as it is
		AckTimeout:    o.AckTimeout,
		CloseTimeout:  broker.SubscriberCloseTimeout,
		Logger:        o.Logger,
	}
	if err := cfg.Validate(); err != nil {
		_ = pub.Close()
		return nil, err
	}
	return &broker.Backend{
		Publisher: pub,
		NewSubscriber: func() (message.Subscriber, error) {
			// Each Subscriber has a connection pool of its own, closed with it. NewClient
			// writes to its options: give each its copy.
			opts := subOpts
			c := redis.NewClient(&opts)
			sub, err := NewSubscriber(c, cfg)
			if err != nil {
				_ = c.Close()
				return nil, err
			}
			return &ownClientSubscriber{Subscriber: sub, client: c}, nil
		},
		// Closing the publisher closes client.
		View: newView(client, o.ConsumerGroup),
	}, nil
}

// ownClientSubscriber is a Subscriber with the client that it alone uses.
type ownClientSubscriber struct {
	*Subscriber
	client *redis.Client
}

// Close closes the Subscriber, then its client. The Broker's subscriber calls it once
// (Backend.NewSubscriber).
func (s *ownClientSubscriber) Close() error {
	return errors.Join(s.Subscriber.Close(), s.client.Close())
}
