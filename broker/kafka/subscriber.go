package kafka

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
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
	// another member: that member delivers the record again, and an ack or nack of this
	// delivery is ignored.
	ErrRevoked = errors.New("kafka: partition revoked: another member of the group delivers the record again")
	// ErrAckTimeout is the cause of the context of a delivery that stayed unsettled for
	// Config.AckTimeout: the subscription hands the record out again, and an ack or nack of
	// this delivery is ignored.
	ErrAckTimeout = errors.New("kafka: AckTimeout passed: the record is delivered again")
)

// Subscriber is a watermill message.Subscriber on Kafka that keeps many records in flight:
// each Subscribe call is one member of the consumer group, with a client of its own, that
// polls up to Config.Prefetch records ahead of their acknowledgements and commits, for each
// partition, the offset below which every record is acked. NewSubscriber makes one. A
// Subscriber is safe for concurrent use.
type Subscriber struct {
	cfg Config
	// prefetch is Config.Prefetch as given: 0 lets each subscription take the window its
	// consumer asks for (redelivery.WithWindow, inflight.Rules.Window).
	prefetch int
	logger   watermill.LoggerAdapter
	subs     *inflight.Group
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber returns a Subscriber. It connects nothing: each Subscribe call has a client of
// its own.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	prefetch := cfg.Prefetch
	cfg = cfg.withDefaults()
	return &Subscriber{
		cfg:      cfg,
		prefetch: prefetch,
		logger:   cfg.log.With(watermill.LogFields{"consumer_group": cfg.ConsumerGroup}),
		subs:     inflight.NewGroup(ErrClosed),
	}, nil
}

// Subscribe joins the consumer group as a new member that consumes topic, creating the topic
// when it is missing, and hands out its records on the returned channel.
//
// Each message carries, in its context, a redelivery.Info (see the package documentation for
// its Count) with DelaysNacks set. The context derives from ctx and is cancelled when the
// delivery ends unsettled: its partition is revoked (ErrRevoked), its AckTimeout passes
// (ErrAckTimeout), ctx ends or the Subscriber closes (ErrClosed); and after it is settled.
//
// Ack marks the record done; the subscription commits, per partition, the offset of the
// first record not acked. Nack hands the record out again after redelivery.RequestedDelay, or
// Config.NackDelay, without holding back the records behind it; it holds back the commits of
// its partition until it is acked. When ctx ends or the Subscriber closes, the subscription
// commits what is acked, leaves the group and closes the channel.
//
// When ctx carries the consumer's positions (redelivery.WithPositions), each partition the
// member is assigned starts after the offset applied there, when the group's committed offset
// is below it, and a partition's records are handed out in offset order, one at a time: the
// next once the one before is acked, a nacked record again before the ones behind it; with
// redelivery.WithPositionWindow, several at once, in offset order, a redelivery still once
// every record before it is acked. When ctx says that the consumer settles each message itself
// (redelivery.WithDirectSettle), the subscription books each ack or nack when the consumer
// calls redelivery.Settle, instead of waiting on the message's channels in a goroutine per
// delivery.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if topic == "" {
		return nil, errors.New("kafka: subscribe: topic is empty")
	}
	if err := s.subs.Check(); err != nil {
		return nil, err
	}
	sub := newSubscription(s, topic, rules.Window(ctx, s.prefetch))
	// The engine is made first: the group's callbacks (revoked, lost) may come as soon as the
	// client exists.
	sub.sub = inflight.New(ctx, sub, inflight.Options{
		Prefetch:     sub.prefetch,
		AckTimeout:   s.cfg.AckTimeout,
		NackDelay:    s.cfg.NackDelay,
		HoldNacks:    true,
		CloseTimeout: s.cfg.CloseTimeout,
		ErrClosed:    ErrClosed,
		ErrExpired:   ErrAckTimeout,
		Log:          sub.logger,
	})
	opts := []kgo.Opt{kgo.SeedBrokers(s.cfg.Brokers...)}
	if st := s.cfg.SessionTimeout; st > 0 {
		opts = append(opts, kgo.SessionTimeout(st), kgo.HeartbeatInterval(min(st/10, 3*time.Second)))
	}
	// The group waits this long for its members to rejoin at a rebalance: as long as a
	// member's revoke can take (revoked), and not kgo's 60 s. A member that neither rejoins
	// nor lets its session lapse (kfake keeps a member that heartbeats but does not rejoin)
	// holds every member of the group still until then.
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
		sub.cancel()
		return nil, fmt.Errorf("kafka: subscribe to %q: %w", topic, err)
	}
	sub.cl, sub.adm = cl, kadm.NewClient(cl)
	fail := func(err error) (<-chan *message.Message, error) {
		cl.Close()
		sub.cancel()
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
	// The hand-out and the commits start first: a subscription whose context has ended
	// already stops as soon as it starts, and its Close waits for them.
	sub.start()
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
