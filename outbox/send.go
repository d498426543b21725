package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
)

// send publishes the message of one delivered row to its destination topic and settles the
// row: ack once the destination has it (or the dead-letter topic, for a message given up),
// nack with a delay to send it again later. See Relay for the policy; health decides.
func (r *Relay) send(row *message.Message) {
	if r.isStopping() {
		return // not settled: the end of the subscription gives it back
	}
	deliveries := 1
	if info, ok := redelivery.FromContext(row.Context()); ok && info.Count > 0 {
		deliveries = info.Count
	}
	topic, msg, err := unwrap(row)
	if err != nil {
		md := &messagedata.MessageData{ID: row.UUID, Headers: row.Metadata, Payload: row.Payload, Attempt: 1, Delivery: deliveries}
		r.deadLetter(row, md, fmt.Errorf("outbox row %s cannot be relayed: %w", row.UUID, err))
		return
	}
	pause := r.cfg.ResendInterval
	for attempt := 1; ; attempt++ {
		err := r.publish(topic, msg)
		if r.killed.Load() {
			return
		}
		if err == nil {
			r.health.succeeded(row.UUID)
			row.Ack()
			return
		}
		log := r.logger.With("message_uuid", msg.UUID, "topic", topic, "deliveries", deliveries, "error", err)
		refused := r.cfg.Refused(err)
		switch r.health.failed(row.UUID, deliveries, r.cfg.MaxAttempts, refused) {
		case deadLetter:
			reason := fmt.Errorf("the destination failed the message at each of %d deliveries to topic %q while it accepted others: %w", deliveries, topic, err)
			if refused {
				reason = fmt.Errorf("the destination refused the message to topic %q, and publishing it again cannot succeed: %w", topic, err)
			}
			r.deadLetter(row, toMessageData(topic, msg, deliveries), reason)
			return
		case holdInPlace:
			if attempt == 1 {
				log.Warn("outbox relay: the destination fails every message; publishing this one again in place until it takes it", "retry_in", pause)
			} else {
				log.Debug("outbox relay: the destination still fails; publishing the message again in place", "retry_in", pause)
			}
			if !r.wait(row.Context(), pause) {
				if row.Context().Err() != nil {
					// Its lease has passed: the group claims it again, and the relay tries the
					// next message in its place.
					redelivery.NackAfter(row, 0)
				}
				return
			}
			pause = backoff(2, pause, r.cfg.MaxResendInterval)
			continue
		}
		delay := backoff(deliveries, r.cfg.ResendInterval, r.cfg.MaxResendInterval)
		log.Warn("outbox relay: publish failed; sending the message again later, after the ones behind it", "retry_in", delay)
		if !redelivery.NackAfter(row, delay) {
			row.Nack()
		}
		return
	}
}

// publish publishes msg to topic on the destination; a panic of the publisher is an error.
func (r *Relay) publish(topic string, msg *message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("the destination publisher panicked: %v", p)
		}
	}()
	return r.cfg.Publisher.Publish(topic, msg)
}

// deadLetter publishes md, the message of row, to the dead-letter topic with reason, and
// acknowledges row. When the dead-letter broker fails too, row is sent again later.
func (r *Relay) deadLetter(row *message.Message, md *messagedata.MessageData, reason error) {
	r.health.settled(row.UUID)
	if err := middleware.PublishDeadLetter(row.Context(), r.cfg.DeadLetterPublisher, r.cfg.DeadLetterTopic, r.handler, md, reason); err != nil {
		delay := backoff(md.Delivery, r.cfg.ResendInterval, r.cfg.MaxResendInterval)
		r.logger.Error("outbox relay: cannot dead-letter a message; sending it again later", "message_uuid", md.ID, "topic", md.Topic,
			"reason", reason, "error", err, "retry_in", delay)
		if !redelivery.NackAfter(row, delay) {
			row.Nack()
		}
		return
	}
	r.logger.Error("outbox relay: gave a message up to the dead-letter topic", "message_uuid", md.ID, "topic", md.Topic,
		"dead_letter_topic", r.cfg.DeadLetterTopic, "deliveries", md.Delivery, "reason", reason)
	row.Ack()
}

// toMessageData returns msg, bound for topic, as the dead-letter publisher takes it.
func toMessageData(topic string, msg *message.Message, deliveries int) *messagedata.MessageData {
	return &messagedata.MessageData{ID: msg.UUID, Topic: topic, Headers: msg.Metadata, Payload: msg.Payload, Attempt: 1, Delivery: deliveries}
}

// wait waits for d, and reports false when ctx ends or the relay stops first.
func (r *Relay) wait(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-r.stop:
	case <-r.stopping:
	}
	return false
}
