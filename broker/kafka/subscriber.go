package kafka

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/broker/redelivery"
)

// Errors that end a delivery without an acknowledgement, as the cause of its context
// (context.Cause), and that a closed Subscriber or Publisher returns.
var (
	// ErrClosed is returned by Subscribe on a closed Subscriber and by Publish on a closed
	// Publisher, and is the cause of the contexts of the deliveries that a closing
	// subscription gives back.
	ErrClosed = errors.New("kafka: closed")
	// ErrRevoked is the cause of the context of a delivery whose partition the group gave to
	// another member, which delivers the record again; its ack or nack is ignored.
	ErrRevoked = errors.New("kafka: partition revoked: another member of the group delivers the record again")
	// ErrAckTimeout is the cause of the context of a delivery that stayed unsettled for
	// Config.AckTimeout: the record is handed out again; its ack or nack is ignored.
	ErrAckTimeout = errors.New("kafka: AckTimeout passed: the record is delivered again")
)

// Subscriber is a watermill message.Subscriber on Kafka that keeps many records in flight, as
// the package documentation says. NewSubscriber makes one. A Subscriber is safe for concurrent
// use.
type Subscriber struct {
	cfg  Config
	subs *inflight.Group
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber returns a Subscriber. It connects nothing: each Subscribe call has a client of
// its own.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	return &Subscriber{cfg: cfg, subs: inflight.NewGroup(ErrClosed)}, nil
}

// Subscribe joins the consumer group as a new member that consumes topic, creating the topic
// when it is missing, and hands out its records on the returned channel, as the package
// documentation says. When ctx ends or the Subscriber closes, the subscription commits what is
// acked, leaves the group and closes the channel. A message's context ends with its delivery,
// with the cause ErrRevoked, ErrAckTimeout or ErrClosed when it is not settled.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.subs.Begin("kafka", topic); err != nil {
		return nil, err
	}
	sub := newSubscription(s, topic, rules.Window(ctx, s.cfg.Prefetch))
	// The engine is made first: the group's callbacks (revoked, lost) may come as soon as the
	// client exists.
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:     sub.prefetch,
		AckTimeout:   s.cfg.AckTimeout,
		NackDelay:    s.cfg.NackDelay,
		HoldNacks:    true,
		CloseTimeout: s.cfg.CloseTimeout,
		ErrExpired:   ErrAckTimeout,
		Log:          sub.logger,
	})
	opts := []kgo.Opt{kgo.SeedBrokers(s.cfg.Brokers...)}
	if st := s.cfg.SessionTimeout; st > 0 {
		opts = append(opts, kgo.SessionTimeout(st), kgo.HeartbeatInterval(min(st/10, 3*time.Second)))
	}
	// As long as a revoke can take (Config.RevokeTimeout), not kgo's 60 s: a member that
	// neither rejoins nor lets its session lapse (kfake keeps one that heartbeats but does not
	// rejoin) holds every member of the group still until then.
	opts = append(opts, kgo.RebalanceTimeout(s.cfg.RevokeTimeout+commitTimeout+s.cfg.CloseTimeout+rebalanceSlack))
	opts = append(opts, s.cfg.ClientOptions...)
	opts = append(opts,
		kgo.ConsumerGroup(s.cfg.ConsumerGroup),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(),
		// Records are taken into the subscription's books between a poll and
		// AllowRebalance, so a revoke never races with them.
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(sub.revoked),
		kgo.OnPartitionsLost(sub.lost),
	)
	if pos, ok := redelivery.PositionsFrom(ctx); ok {
		sub.positions, sub.window = pos, redelivery.PositionWindow(ctx)
		opts = append(opts, kgo.AdjustFetchOffsetsFn(sub.startOffsets))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka: subscribe to %q: %w", topic, err)
	}
	sub.cl, sub.adm = cl, kadm.NewClient(cl)
	fail := func(err error) (<-chan *message.Message, error) {
		cl.Close()
		return nil, err
	}
	topics := s.cfg.Topics
	if topics == nil {
		topics = NewTopics(cl, -1, -1)
	}
	setup, stop := s.subs.Setup(ctx)
	defer stop()
	if err := topics.Ensure(setup, topic); err != nil {
		return fail(s.subs.SetupError(fmt.Errorf("kafka: subscribe to %q: %w", topic, err)))
	}
	// The commits start first: a subscription whose context has ended stops as soon as it
	// starts, and its Close waits for them.
	sub.loops.Go(sub.commits)
	out, err := sub.sub.Start(s.subs)
	if err != nil {
		return fail(err)
	}
	return out, nil
}

// Close ends every subscription: each stops polling, gives back the records it holds
// unsettled (an ack given before Close counts), commits the offsets of what is acked (within
// Config.CloseTimeout), leaves the group and closes its channel. Close returns when they
// all have. It is idempotent.
func (s *Subscriber) Close() error { return s.subs.Close(nil) }
