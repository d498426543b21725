package amqp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrClosed is returned by Subscribe on a closed Subscriber.
var ErrClosed = errors.New("broker/amqp: subscriber closed")

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

// Subscriber consumes RabbitMQ queues with many deliveries in flight. It implements watermill's
// message.Subscriber; NewSubscriber makes one. It holds one AMQP connection, and one channel
// per Subscribe call. It is safe for concurrent use.
//
// Each subscription hands its deliveries out as they arrive, up to Config.Prefetch unsettled,
// without waiting for their acks; each message's context carries a redelivery.Info and is
// cancelled when the message is settled, when its channel is lost, and when the subscription
// ends. An ack settles that delivery by its tag; acks are coalesced (see Config.AckDelay). A
// nack gives the message back to RabbitMQ (requeue) after the delay the router asked for with
// redelivery.NackAfter, or Config.NackDelay; meanwhile the message is held, and the others go
// on. A lost connection or channel is reopened with backoff: the deliveries it carried are
// given back by RabbitMQ, their contexts are cancelled, and their acks are dropped (never sent
// on another channel).
type Subscriber struct {
	cfg         Config
	dialTimeout time.Duration
	// stop is cancelled by Close.
	stop   context.Context
	stopFn context.CancelFunc
	// wrapAcker, when set (by tests before the first Subscribe), wraps each channel's acker.
	wrapAcker func(acker) acker

	dialMu sync.Mutex // one dial at a time

	mu     sync.Mutex
	conn   *amqp.Connection // nil before the first dial and after Close
	closed bool
	subs   sync.WaitGroup // subscriptions running

	closeOnce sync.Once
	closeErr  error
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
	s := &Subscriber{cfg: cfg, dialTimeout: defaultDialTimeout}
	if uri.ConnectionTimeout > 0 {
		s.dialTimeout = time.Duration(uri.ConnectionTimeout) * time.Millisecond
	}
	s.stop, s.stopFn = context.WithCancel(context.Background())
	if _, err := s.connection(); err != nil {
		s.stopFn()
		return nil, fmt.Errorf("broker/amqp: connect: %w", err)
	}
	return s, nil
}

// connection returns the Subscriber's connection, dialing a new one when there is none or it
// was lost.
func (s *Subscriber) connection() (*amqp.Connection, error) {
	s.dialMu.Lock()
	defer s.dialMu.Unlock()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	if c := s.conn; c != nil && !c.IsClosed() {
		s.mu.Unlock()
		return c, nil
	}
	s.mu.Unlock()

	conn, err := s.dial()
	if err != nil {
		if s.stop.Err() != nil {
			return nil, ErrClosed
		}
		return nil, err
	}
	s.mu.Lock()
	closed := s.closed
	if !closed {
		s.conn = conn
	}
	s.mu.Unlock()
	if closed {
		_ = conn.CloseDeadline(time.Now().Add(connCloseTimeout))
		return nil, ErrClosed
	}
	return conn, nil
}

// dial connects to RabbitMQ. Close aborts a dial in progress, the AMQP handshake included.
func (s *Subscriber) dial() (*amqp.Connection, error) {
	var (
		mu    sync.Mutex
		stops []func() bool
	)
	props := amqp.NewConnectionProperties()
	props["connection_name"] = "onceflow subscriber, group " + s.cfg.Topology.ConsumerGroup
	conn, err := amqp.DialConfig(s.cfg.URL, amqp.Config{
		Locale:     "en_US",
		Properties: props,
		Dial: func(network, addr string) (net.Conn, error) {
			ctx, cancel := context.WithTimeout(s.stop, s.dialTimeout)
			defer cancel()
			c, err := new(net.Dialer).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// amqp091-go clears the deadline when the handshake is done.
			_ = c.SetDeadline(time.Now().Add(s.dialTimeout))
			stop := context.AfterFunc(s.stop, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
			mu.Lock()
			stops = append(stops, stop)
			mu.Unlock()
			return c, nil
		},
	})
	mu.Lock()
	for _, stop := range stops {
		stop()
	}
	mu.Unlock()
	return conn, err
}

// Subscribe starts one competing consumer of topic's queue in the consumer group: it declares
// the topology, opens a channel with the prefetch, and consumes with manual acks. Errors of
// that first attempt (a queue declared with other arguments, access refused) are returned;
// later losses are repaired in the background. The returned channel is closed when ctx ends or
// the Subscriber closes; then the acks given so far are sent, held nacks are given back at
// once, and what was delivered and not settled is given back by closing the channel.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.cfg.Topology.CheckTopic(topic); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	s.subs.Add(1)
	s.mu.Unlock()

	sub := &subscription{
		s:     s,
		ctx:   ctx,
		topic: topic,
		queue: s.cfg.Topology.QueueName(topic),
		out:   make(chan *message.Message),
	}
	ss, err := sub.open()
	for wait, attempt := s.cfg.ReconnectInitial, 1; err != nil && transient(err) && attempt < subscribeAttempts; attempt++ {
		if !sub.sleep(wait) {
			err = ErrClosed
			if s.stop.Err() == nil {
				err = ctx.Err()
			}
			break
		}
		wait = min(2*wait, s.cfg.ReconnectMax)
		ss, err = sub.open()
	}
	if err != nil {
		s.subs.Done()
		if errors.Is(err, ErrClosed) {
			return nil, ErrClosed
		}
		return nil, fmt.Errorf("broker/amqp: subscribe to %q: %w", topic, err)
	}
	go sub.run(ss)
	return sub.out, nil
}

// Close ends the subscriptions: each stops taking messages, sends the acks given before, gives
// back held and unsettled deliveries, and closes its channel; then Close closes the
// connection. It returns within about Config.CloseTimeout plus a second even when RabbitMQ does
// not answer: it then drops the connection, and RabbitMQ requeues what was unacked when it
// notices. Close is idempotent; concurrent calls return when the first is done, with its
// result.
func (s *Subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
		s.stopFn()

		done := make(chan struct{})
		go func() {
			s.subs.Wait()
			close(done)
		}()
		var errs []error
		var deadline time.Time
		t := time.NewTimer(s.cfg.CloseTimeout)
		select {
		case <-done:
			t.Stop()
			deadline = time.Now().Add(connCloseTimeout)
		case <-t.C:
			errs = append(errs, fmt.Errorf("subscriptions did not end within %s, connection dropped", s.cfg.CloseTimeout))
			deadline = time.Now()
		}
		s.mu.Lock()
		conn := s.conn
		s.conn = nil
		s.mu.Unlock()
		if conn != nil {
			if err := conn.CloseDeadline(deadline); err != nil && !errors.Is(err, amqp.ErrClosed) {
				errs = append(errs, fmt.Errorf("close connection: %w", err))
			}
		}
		// Every call on the connection has returned now; the subscriptions end at once.
		t = time.NewTimer(connCloseTimeout)
		select {
		case <-done:
		case <-t.C:
			errs = append(errs, errors.New("subscriptions still running after the connection closed"))
		}
		t.Stop()
		if err := errors.Join(errs...); err != nil {
			s.closeErr = fmt.Errorf("broker/amqp: close: %w", err)
		}
	})
	return s.closeErr
}

// subscription is one Subscribe call: a consumer of one queue that outlives the channels it
// consumes on.
type subscription struct {
	s     *Subscriber
	ctx   context.Context
	topic string
	queue string
	out   chan *message.Message
}

// open opens a channel, declares the topology and starts consuming on it.
func (sub *subscription) open() (*session, error) {
	s := sub.s
	conn, err := s.connection()
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open channel: %w", err)
	}
	fail := func(err error) (*session, error) {
		_ = ch.Close()
		return nil, err
	}
	if err := ch.Qos(s.cfg.Prefetch, 0, false); err != nil {
		return fail(fmt.Errorf("set prefetch %d: %w", s.cfg.Prefetch, err))
	}
	if err := s.cfg.Topology.Declare(ch, sub.topic); err != nil {
		return fail(err)
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	tag := consumerTag()
	deliveries, err := ch.Consume(sub.queue, tag, false, false, false, false, nil)
	if err != nil {
		return fail(fmt.Errorf("consume queue %q: %w", sub.queue, err))
	}
	var a acker = ch
	if s.wrapAcker != nil {
		a = s.wrapAcker(a)
	}
	return newSession(sub, ch, a, tag, deliveries, closed), nil
}

// run runs sessions until the subscription ends, reopening lost ones.
func (sub *subscription) run(ss *session) {
	defer sub.s.subs.Done()
	defer close(sub.out)
	for ss != nil && ss.run() {
		ss = sub.reopen()
	}
}

// reopen opens a new session after a loss, with exponential backoff; nil when the
// subscription ends first.
func (sub *subscription) reopen() *session {
	cfg := sub.s.cfg
	wait := cfg.ReconnectInitial
	for attempt := 1; ; attempt++ {
		if !sub.sleep(wait) {
			return nil
		}
		ss, err := sub.open()
		if err == nil {
			cfg.log.Info("Subscription resumed", watermill.LogFields{"queue": sub.queue, "attempt": attempt})
			return ss
		}
		if errors.Is(err, ErrClosed) {
			return nil
		}
		cfg.log.Error("Cannot resume subscription", err, watermill.LogFields{"queue": sub.queue, "attempt": attempt})
		wait = min(2*wait, cfg.ReconnectMax)
	}
}

// sleep waits for about d (±20%, so that the consumers of a restarted server do not all come
// back at once), and reports false when the subscription ends first.
func (sub *subscription) sleep(d time.Duration) bool {
	t := time.NewTimer(time.Duration(float64(d) * (0.8 + 0.4*rand.Float64())))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-sub.ctx.Done():
		return false
	case <-sub.s.stop.Done():
		return false
	}
}

// subscribeAttempts bounds the attempts of Subscribe to open its first session when they fail
// for a transient reason.
const subscribeAttempts = 5

// transient reports an error of opening a session that a retry may cure: the connection closed
// under it, or INTERNAL_ERROR, which RabbitMQ 3.10 answers (closing the connection) to some of
// the consumers that come at once to a quorum queue declared a moment before.
func transient(err error) bool {
	if errors.Is(err, amqp.ErrClosed) {
		return true
	}
	if e, ok := errors.AsType[*amqp.Error](err); ok {
		return e.Code == amqp.InternalError || e.Code == amqp.FrameError
	}
	return false
}
