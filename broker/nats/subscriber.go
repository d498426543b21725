package nats

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Errors that end a delivery without an acknowledgement, as the cause of its context
// (context.Cause), and that a closed Subscriber returns.
var (
	// ErrClosed is returned by Subscribe on a closed Subscriber, and is the cause of the
	// contexts of the deliveries that Close gives back.
	ErrClosed = errors.New("nats: subscriber closed")
	// ErrAckWaitPassed is the cause of the context of a delivery whose AckWait passed:
	// JetStream delivers the message again, and an ack or nack of this delivery is ignored.
	ErrAckWaitPassed = errors.New("nats: AckWait passed: JetStream delivers the message again")
	// ErrConnectionLost is the cause of the context of a delivery whose connection to the
	// server was lost: JetStream delivers the message again once its AckWait has passed, and
	// an ack or nack of this delivery is ignored.
	ErrConnectionLost = errors.New("nats: connection to the server lost: JetStream delivers the message again after AckWait")
)

// Subscriber is a watermill message.Subscriber on NATS JetStream that keeps many deliveries in
// flight, as the package documentation says. NewSubscriber makes one, with a connection of its
// own. A Subscriber is safe for concurrent use.
type Subscriber struct {
	cfg     Config
	logger  watermill.LoggerAdapter
	nc      *nats.Conn
	js      jetstream.JetStream
	streams *Streams
	subs    *inflight.Group

	mu   sync.Mutex
	link *link // the current connection to the server
}

var _ message.Subscriber = (*Subscriber)(nil)

// link is one connection to the server, from its loss of the one before to its own loss. A
// delivery belongs to the link it came on: when lost is closed, the delivery ends.
type link struct {
	up   chan struct{} // closed once connected
	lost chan struct{} // closed when the connection is lost
}

// isLost reports whether the connection is lost.
func (l *link) isLost() bool {
	select {
	case <-l.lost:
		return true
	default:
		return false
	}
}

// NewSubscriber connects to the NATS server of cfg.URL and returns a Subscriber over that
// connection. The connection reconnects by itself, for ever, until Close.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	s := &Subscriber{
		cfg:    cfg,
		logger: cfg.log.With(watermill.LogFields{"consumer_group": cfg.ConsumerGroup}),
		link:   &link{up: make(chan struct{}), lost: make(chan struct{})},
		subs:   inflight.NewGroup(ErrClosed),
	}
	close(s.link.up)
	opts := []nats.Option{nats.Name("onceflow subscriber " + cfg.ConsumerGroup), nats.MaxReconnects(-1)}
	opts = append(opts, cfg.ConnectOptions...)
	opts = append(opts,
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) { s.disconnected(err) }),
		nats.ReconnectHandler(func(*nats.Conn) { s.reconnected() }),
	)
	nc, err := nats.Connect(cfg.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("nats: connect: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("nats: JetStream API: %w", err)
	}
	s.nc, s.js, s.streams = nc, js, NewStreams(js)
	return s, nil
}

// disconnected ends the deliveries that came on the connection just lost.
func (s *Subscriber) disconnected(err error) {
	if s.subs.Check() != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.link.lost)
	s.link = &link{up: make(chan struct{}), lost: make(chan struct{})}
	s.logger.Info("Connection to NATS lost: the deliveries in flight end, JetStream delivers them again after AckWait", watermill.LogFields{"error": err})
}

// reconnected lets the subscriptions pull on the new connection.
func (s *Subscriber) reconnected() {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.link.up:
	default:
		close(s.link.up)
	}
	s.logger.Info("Reconnected to NATS", nil)
}

// currentLink returns the connection that deliveries come on now.
func (s *Subscriber) currentLink() *link {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.link
}

// Subscribe starts one competing consumer of topic in the subscriber's consumer group: it
// creates the topic's stream when no stream captures the subject, creates or updates the
// group's durable pull consumer (ensureConsumer), and pulls from it, as the package
// documentation says, until ctx ends or the Subscriber closes.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.subs.Begin("nats", topic); err != nil {
		return nil, err
	}
	setup, stop := s.subs.Setup(ctx)
	defer stop()
	stream, err := s.streams.Ensure(setup, topic)
	var cons jetstream.Consumer
	if err == nil {
		cons, err = s.ensureConsumer(setup, stream, topic)
	}
	if err != nil {
		return nil, s.subs.SetupError(fmt.Errorf("nats: subscribe to %q: %w", topic, err))
	}

	info := cons.CachedInfo()
	sub := &subscription{
		s:       s,
		topic:   topic,
		stream:  stream,
		subject: pullSubject(stream, info.Name),
		ackWait: info.Config.AckWait,
		logger:  s.logger.With(watermill.LogFields{"topic": topic, "consumer": info.Name}),
	}
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:     rules.Window(ctx, s.cfg.Prefetch),
		NackDelay:    s.cfg.NackDelay,
		FillWait:     fillWait,
		Eager:        true,
		CloseTimeout: s.cfg.CloseTimeout,
		ErrExpired:   ErrAckWaitPassed,
		Log:          sub.logger,
	})
	out, err := sub.sub.Start(s.subs)
	if err != nil {
		return nil, err
	}
	go sub.watchLinks()
	return out, nil
}

// Close stops every subscription, gives back (naks) the deliveries not settled, waits up to
// Config.CloseTimeout for the server to confirm the acknowledgements and nacks given before,
// and closes the connection and the channels. It is idempotent and safe to call concurrently,
// every call returning the first one's result, which says when the server could not confirm
// (it delivers again what it did not get, after AckWait).
func (s *Subscriber) Close() error {
	return s.subs.Close(func() error {
		var err error
		if s.nc.IsConnected() {
			err = s.nc.FlushTimeout(s.cfg.CloseTimeout)
		} else {
			err = errors.New("not connected to the server")
		}
		s.nc.Close()
		if err != nil {
			return fmt.Errorf("nats: close: the acknowledgements given before Close may not have reached the server: %w", err)
		}
		return nil
	})
}
