package amqp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// Errors that end a delivery without an acknowledgement, as the cause of its context
// (context.Cause), and that a closed Subscriber returns.
var (
	// ErrClosed is returned by Subscribe on a closed Subscriber, and is the cause of the
	// contexts of the deliveries that Close gives back.
	ErrClosed = errors.New("broker/amqp: subscriber closed")
	// ErrConnectionLost is the cause of the context of a delivery whose channel or connection
	// was lost: RabbitMQ delivers the message again, and an ack or nack of this delivery is
	// dropped (its tag belongs to the lost channel).
	ErrConnectionLost = errors.New("broker/amqp: channel or connection lost: RabbitMQ delivers the message again")
)

// defaultDialTimeout bounds connecting and the AMQP handshake when the URL sets no
// connection_timeout, as amqp091-go's Dial does.
const defaultDialTimeout = 30 * time.Second

// connCloseTimeout bounds the close of the connection after the subscriptions ended.
const connCloseTimeout = time.Second

// acker sends the settlements of one AMQP channel: the channel itself, or in tests a wrapper
// that counts the frames.
type acker interface {
	Ack(tag uint64, multiple bool) error
	Nack(tag uint64, multiple, requeue bool) error
}

// Subscriber consumes RabbitMQ queues with many deliveries in flight, as the package
// documentation says. It implements watermill's message.Subscriber; NewSubscriber makes one.
// It holds one AMQP connection, and one channel per Subscribe call. It is safe for concurrent
// use.
type Subscriber struct {
	cfg         Config
	dialTimeout time.Duration
	subs        *inflight.Group
	// wrapAcker, when set (by tests before the first Subscribe), wraps each channel's acker.
	wrapAcker func(acker) acker
	// dropped is set when a subscription did not end within Config.CloseTimeout: Close then
	// drops the connection without waiting for RabbitMQ.
	dropped atomic.Bool

	mu   sync.Mutex       // held through a dial: one dial at a time
	conn *amqp.Connection // nil before the first dial and after Close
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber validates cfg and connects to RabbitMQ. Its errors never contain the URL's
// password.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	uri, err := amqp.ParseURI(cfg.URL)
	if err != nil {
		if _, isURL := errors.AsType[*url.Error](err); isURL {
			// url.Error quotes the URL, password and all.
			return nil, errors.New("broker/amqp: Config.URL is malformed")
		}
		return nil, fmt.Errorf("broker/amqp: Config.URL: %w", err)
	}
	s := &Subscriber{cfg: cfg, dialTimeout: defaultDialTimeout, subs: inflight.NewGroup(ErrClosed)}
	if uri.ConnectionTimeout > 0 {
		s.dialTimeout = time.Duration(uri.ConnectionTimeout) * time.Millisecond
	}
	if _, err := s.connection(); err != nil {
		_ = s.subs.Close(nil)
		return nil, fmt.Errorf("broker/amqp: connect: %w", err)
	}
	return s, nil
}

// connection returns the Subscriber's connection, dialing a new one when there is none or it
// was lost. Close takes the connection under mu once the Group is closed: a connection dialed
// meanwhile is closed here.
func (s *Subscriber) connection() (*amqp.Connection, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.subs.Check(); err != nil {
		return nil, err
	}
	if s.conn != nil && !s.conn.IsClosed() {
		return s.conn, nil
	}
	conn, err := s.dial()
	if err != nil {
		return nil, s.subs.SetupError(err)
	}
	if err := s.subs.Check(); err != nil {
		_ = conn.CloseDeadline(time.Now().Add(connCloseTimeout))
		return nil, err
	}
	s.conn = conn
	return conn, nil
}

// dial connects to RabbitMQ. Close aborts a dial in progress, the AMQP handshake included.
func (s *Subscriber) dial() (*amqp.Connection, error) {
	stop := func() bool { return false }
	props := amqp.NewConnectionProperties()
	props["connection_name"] = "onceflow subscriber, group " + s.cfg.Topology.ConsumerGroup
	conn, err := amqp.DialConfig(s.cfg.URL, amqp.Config{
		Locale:     "en_US",
		Properties: props,
		// DialConfig calls Dial once, before it returns.
		Dial: func(network, addr string) (net.Conn, error) {
			ctx, cancel := context.WithTimeout(s.subs.Context(), s.dialTimeout)
			defer cancel()
			c, err := new(net.Dialer).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// amqp091-go clears the deadline when the handshake is done.
			_ = c.SetDeadline(time.Now().Add(s.dialTimeout))
			stop = context.AfterFunc(s.subs.Context(), func() { _ = c.SetDeadline(time.Unix(1, 0)) })
			return c, nil
		},
	})
	stop()
	return conn, err
}

// Subscribe starts one competing consumer of topic's queue in the consumer group: it declares
// the topology, opens a channel with the prefetch, and consumes with manual acks. Errors of
// that first attempt (a queue declared with other arguments, access refused) are returned;
// later losses are repaired in the background. When ctx ends, it ends as Close ends it.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.cfg.Topology.CheckTopic(topic); err != nil {
		return nil, err
	}
	if err := s.subs.Check(); err != nil {
		return nil, err
	}
	setup, stop := s.subs.Setup(ctx)
	defer stop()

	sub := &subscription{
		s:        s,
		topic:    topic,
		queue:    s.cfg.Topology.QueueName(topic),
		prefetch: rules.Window(ctx, s.cfg.Prefetch),
	}
	sub.log = s.cfg.log.With(watermill.LogFields{"queue": sub.queue})
	ss, err := sub.open()
	for wait, attempt := s.cfg.ReconnectInitial, 1; err != nil && transient(err) && attempt < subscribeAttempts; attempt++ {
		if !sleep(wait, setup.Done()) {
			err = setup.Err()
			break
		}
		wait = min(2*wait, s.cfg.ReconnectMax)
		ss, err = sub.open()
	}
	if err != nil {
		return nil, s.subs.SetupError(fmt.Errorf("broker/amqp: subscribe to %q: %w", topic, err))
	}
	sub.ss.Store(ss)
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:     sub.prefetch,
		NackDelay:    s.cfg.NackDelay,
		HoldNacks:    true,
		CloseTimeout: s.cfg.CloseTimeout,
		Log:          sub.log,
	})
	out, err := sub.sub.Start(s.subs)
	if err != nil {
		ss.stop()
		_ = ss.ch.Close()
		return nil, err
	}
	go sub.watch(ss)
	return out, nil
}

// Close ends the subscriptions: each stops taking messages, sends the acks given before, gives
// back held and unsettled deliveries, and closes its AMQP channel; then Close closes the
// connection, within about Config.CloseTimeout plus a second even when RabbitMQ does not
// answer. Close is idempotent; concurrent calls return when the first is done, with its result.
func (s *Subscriber) Close() error {
	if err := s.subs.Close(s.closeConnection); err != nil {
		return fmt.Errorf("broker/amqp: close: %w", err)
	}
	return nil
}

// closeConnection closes the connection once the subscriptions have ended: at once when one
// of them did not end in time, within connCloseTimeout otherwise.
func (s *Subscriber) closeConnection() error {
	s.mu.Lock()
	conn := s.conn
	s.conn = nil
	s.mu.Unlock()
	if conn == nil {
		return nil
	}
	deadline := time.Now().Add(connCloseTimeout)
	if s.dropped.Load() {
		deadline = time.Now()
	}
	if err := conn.CloseDeadline(deadline); err != nil && !errors.Is(err, amqp.ErrClosed) {
		return fmt.Errorf("close connection: %w", err)
	}
	return nil
}

// sleep waits for about d (±20%, so that the consumers of a restarted server do not all come
// back at once), and reports false when stop is closed first.
func sleep(d time.Duration, stop <-chan struct{}) bool {
	return inflight.Pause(stop, time.Duration(float64(d)*(0.8+0.4*rand.Float64())))
}

// subscribeAttempts bounds the attempts of Subscribe to open its first session when they fail
// for a transient reason.
const subscribeAttempts = 5

// transient reports an error of opening a session that a retry may cure: the connection closed
// under it, or INTERNAL_ERROR, which RabbitMQ 3.10 answers (closing the connection) to some of
// the consumers that come at once to a quorum queue declared a moment before.
func transient(err error) bool {
	code := replyCode(err)
	return errors.Is(err, amqp.ErrClosed) || code == amqp.InternalError || code == amqp.FrameError
}

// replyCode returns the reply code of RabbitMQ's error err (amqp.NotFound for a passive
// declaration of something that does not exist), or 0.
func replyCode(err error) int {
	if e, ok := errors.AsType[*amqp.Error](err); ok {
		return e.Code
	}
	return 0
}
