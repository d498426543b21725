package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// consumerConfig is the configuration of the durable pull consumer of the subscriber's group on
// topic, delivering from policy (and start, for jetstream.DeliverByStartSequencePolicy).
func (s *Subscriber) consumerConfig(name, topic string, policy jetstream.DeliverPolicy, start uint64) jetstream.ConsumerConfig {
	return s.withLimits(jetstream.ConsumerConfig{
		Durable:       name,
		FilterSubject: topic,
		DeliverPolicy: policy,
		OptStartSeq:   start,
		AckPolicy:     jetstream.AckExplicitPolicy,
	})
}

// withLimits returns cfg with the AckWait and the limits that the subscriber sets on every
// consumer.
func (s *Subscriber) withLimits(cfg jetstream.ConsumerConfig) jetstream.ConsumerConfig {
	cfg.AckWait = s.cfg.AckWait
	// No delivery limit and no limit on pending acknowledgements: the package documentation
	// says why.
	cfg.MaxDeliver = -1
	cfg.MaxAckPending = -1
	// A BackOff would replace AckWait for redeliveries after a timeout: the deadline of a
	// delivery's context would no longer match the server's.
	cfg.BackOff = nil
	return cfg
}

// createAttempts bounds how many times ensureConsumer tries to create a consumer that another
// subscriber creates at the same time, or that the server refuses while it creates the stream;
// it waits createRetryStep times the attempt after a refusal.
const (
	createAttempts  = 5
	createRetryStep = 50 * time.Millisecond
)

// ensureConsumer returns the durable pull consumer of the subscriber's group on topic, in
// stream, creating it when there is none, or replacing a push consumer (replacePushConsumer),
// and updating its AckWait and limits to the subscriber's when they differ (the last
// subscriber to subscribe sets them).
func (s *Subscriber) ensureConsumer(ctx context.Context, stream, topic string) (jetstream.Consumer, error) {
	name := ConsumerName(s.cfg.ConsumerGroup, topic)
	for attempt := 1; ; attempt++ {
		c, err := s.js.Consumer(ctx, stream, name)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			c, err = s.js.CreateConsumer(ctx, stream, s.consumerConfig(name, topic, jetstream.DeliverAllPolicy, 0))
			if errors.Is(err, jetstream.ErrConsumerExists) && attempt < createAttempts {
				continue // another subscriber created it in the meantime: look again
			}
			if errors.Is(err, jetstream.ErrConsumerCreate) && attempt < createAttempts {
				// The server lists a new stream, and answers its create with success, before
				// the stream's storage is ready; a consumer meanwhile gets "invalid stream".
				if inflight.Pause(ctx.Done(), time.Duration(attempt)*createRetryStep) {
					continue
				}
				err = context.Cause(ctx)
			}
			if err != nil {
				return nil, fmt.Errorf("create JetStream consumer %q of stream %q: %w", name, stream, err)
			}
			return c, nil
		}
		if err != nil {
			return nil, fmt.Errorf("look up JetStream consumer %q of stream %q: %w", name, stream, err)
		}
		info := c.CachedInfo()
		if isPush(info) {
			return s.replacePushConsumer(ctx, stream, topic, info)
		}
		if info.Config.AckPolicy != jetstream.AckExplicitPolicy {
			return nil, fmt.Errorf("JetStream consumer %q of stream %q acknowledges with policy %s, not explicitly: onceflow did not create it; delete it, or use another consumer group", name, stream, info.Config.AckPolicy)
		}
		want := s.withLimits(info.Config)
		if want.AckWait == info.Config.AckWait && want.MaxDeliver == info.Config.MaxDeliver &&
			want.MaxAckPending == info.Config.MaxAckPending && len(info.Config.BackOff) == 0 {
			return c, nil
		}
		c, err = s.js.UpdateConsumer(ctx, stream, want)
		if err != nil {
			return nil, fmt.Errorf("update JetStream consumer %q of stream %q (AckWait %s, no delivery or pending limit): %w", name, stream, s.cfg.AckWait, err)
		}
		return c, nil
	}
}

// replacePushConsumer replaces the push consumer that info describes, left by onceflow's
// earlier watermill-nats subscriber (JetStream cannot turn one into the other, and keeps
// consumers across restarts), by a pull consumer of the same name. It starts right after the
// push consumer's ack floor: nothing is lost; messages acknowledged out of order above the
// floor come again (deduplication absorbs them), and delivery counts start again from 1.
// While a subscriber still receives from the push consumer, replacing it would take its
// messages away mid-processing: the subscription fails instead, saying what to do.
func (s *Subscriber) replacePushConsumer(ctx context.Context, stream, topic string, info *jetstream.ConsumerInfo) (jetstream.Consumer, error) {
	name := info.Name
	if info.PushBound {
		return nil, fmt.Errorf("JetStream consumer %q of stream %q is a push consumer that a subscriber still receives from "+
			"(an onceflow process of group %q from before pull consumers, or another watermill-nats subscriber): "+
			"stop those consumers of %q, then subscribe again; the pull consumer that replaces it starts after its ack floor (stream sequence %d)",
			name, stream, s.cfg.ConsumerGroup, topic, info.AckFloor.Stream)
	}
	policy, start := jetstream.DeliverAllPolicy, uint64(0)
	if floor := info.AckFloor.Stream; floor > 0 {
		policy, start = jetstream.DeliverByStartSequencePolicy, floor+1
	}
	s.logger.Info("Replacing the push consumer of a consumer group by a pull consumer", watermill.LogFields{
		"consumer": name, "stream": stream, "ack_floor": info.AckFloor.Stream, "pending": info.NumAckPending,
	})
	if err := s.js.DeleteConsumer(ctx, stream, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, fmt.Errorf("delete push consumer %q of stream %q to replace it by a pull consumer: %w", name, stream, err)
	}
	c, err := s.js.CreateConsumer(ctx, stream, s.consumerConfig(name, topic, policy, start))
	if err != nil {
		return nil, fmt.Errorf("create pull consumer %q of stream %q from stream sequence %d, in place of the push consumer deleted: %w", name, stream, start, err)
	}
	return c, nil
}

// isPush reports whether info describes a push consumer. The jetstream package, made for pull
// consumers, leaves out the DeliverSubject of the configuration; but JetStream gives every
// pull consumer a MaxWaiting (512 by default, never 0) and refuses one for a push consumer.
func isPush(info *jetstream.ConsumerInfo) bool { return info.Config.MaxWaiting == 0 }
