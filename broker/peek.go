package broker

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/redact"
)

// Peek, Move and Delete read a consumer group's messages directly from the broker's storage,
// beside the Subscribers: a subscription cannot list, because what it hands out it takes from
// the group's other consumers until it is settled, and a nacked message comes back to it. Each
// scheme has its own way (Backend.View), in its own package; docs/operations.md compares them.

// openView opens a view of topic for the Broker's consumer group.
func (b *Broker) openView(ctx context.Context, topic string) (View, error) {
	if err := b.usableTopic(topic); err != nil {
		return nil, err
	}
	if b.be.View == nil {
		return nil, fmt.Errorf("broker: inspect topic %q: the %s scheme keeps no store to inspect: %w", topic, b.scheme, errors.ErrUnsupported)
	}
	v, err := b.be.View(ctx, topic)
	if errors.Is(err, ErrNotFound) && !b.opts.ReportNotFound {
		return emptyView{}, nil
	}
	if err != nil {
		return nil, b.inspectErr("inspect", topic, err)
	}
	return v, nil
}

// emptyView is the view of a topic or group that does not exist, on a Broker that does not
// report it (Options.ReportNotFound).
type emptyView struct{}

func (emptyView) List(context.Context, int) ([]Entry, error) { return nil, nil }
func (emptyView) Remove(context.Context, Entry) error        { return nil }
func (emptyView) Close() error                               { return nil }

// usableTopic returns ErrClosed once the Broker is closed, and otherwise whether the scheme can
// carry topic.
func (b *Broker) usableTopic(topic string) error {
	if b.life.Closed() {
		return ErrClosed
	}
	return b.checkTopic(topic)
}

func (b *Broker) inspectErr(op, topic string, err error) error {
	return redact.Error(fmt.Errorf("broker: %s topic %q for consumer group %q on %s: %w", op, topic, b.opts.ConsumerGroup, b.redacted, err), b.secrets)
}

// Peek returns up to limit of the messages of topic that wait for the Broker's consumer group,
// oldest first, in the order the group would receive them, as a subscriber of the group would
// receive them, without consuming them. Waiting means published and not yet acknowledged by
// the group: a message that a consumer holds unacknowledged waits too, except on AMQP, where
// RabbitMQ hides it until it is given back. A topic that does not exist has no waiting
// messages, unless Options.ReportNotFound makes that an error (ErrNotFound).
//
// Each scheme reads in its own way (its View), which docs/operations.md compares; mem is not
// supported (the error wraps errors.ErrUnsupported). Peek takes no lock: it never waits for
// the group's consumers, nor holds them up (on AMQP, the messages it reads are unavailable to
// them for the moment of the read).
func (b *Broker) Peek(ctx context.Context, topic string, limit int) ([]*message.Message, error) {
	if limit <= 0 {
		return nil, fmt.Errorf("broker: peek topic %q: limit %d is not positive", topic, limit)
	}
	v, err := b.openView(ctx, topic)
	if err != nil {
		return nil, err
	}
	entries, err := v.List(ctx, limit)
	err = errors.Join(err, v.Close())
	if err != nil {
		return nil, b.inspectErr("peek", topic, err)
	}
	msgs := make([]*message.Message, len(entries))
	for i, e := range entries {
		msgs[i] = e.Message
	}
	return msgs, nil
}

// MoveFunc decides the fate of one message in a Move. To move msg it returns the topic to
// publish it to and the message to publish there: msg itself or a message made from it. To
// leave msg where it is it returns an empty topic.
type MoveFunc func(msg *message.Message) (to string, out *message.Message)

// Moved is a message that Move published to another topic and then removed.
type Moved struct {
	// Message is the message as it waited.
	Message *message.Message
	// To is the topic it was published to.
	To string
	// Published is the message published to To.
	Published *message.Message
}

// MoveReport says what Move did, in the order of the messages.
type MoveReport struct {
	// Moved are the messages published elsewhere and removed.
	Moved []Moved
	// Kept are the messages left waiting, in their place: those pick left, and those Move
	// did not reach because it stopped.
	Kept []*message.Message
	// Failed are the messages pick chose that could not be moved, each with why. Each waits in
	// its place, and, when the failure came after its publish, is published as well
	// (Failure.Err says so).
	Failed []Failure
}

// Failure is a message that Move or Delete could not handle, and why.
type Failure struct {
	Message *message.Message
	Err     error
}

// Move goes through up to limit of the messages of topic that wait for the Broker's consumer
// group, oldest first (those Peek returns), and asks pick about each one. A message that pick
// moves is published with the Broker's Publisher and, once Publish has returned nil, removed
// from topic. A message whose publish or removal fails goes in MoveReport.Failed with why, and
// Move goes on with the next one. The other messages stay in their place. Messages published
// to topic while Move runs wait for the next Move, so that none is moved in a circle.
//
// A crash (or an error) between the publish and the removal leaves the message in topic as
// well as published: the next Move moves it again, a duplicate that deduplication absorbs. On
// NATS, the moved message is published with a Nats-Msg-Id of its own (HeaderNATSMsgID),
// derived from its place in topic's stream, so that JetStream does not drop it as a duplicate
// of its first publish, and does drop a second move of it within the duplicate window.
//
// Removing, the same for Move and Delete, depends on where the broker keeps a group's
// messages (docs/operations.md compares the schemes): on AMQP and Kafka the other consumer
// groups of topic keep the message; on the other schemes every group reads one log per topic,
// and no longer sees it either. Kafka takes a group's commits only from its members, so Move
// and Delete join the group, subscribed to topic alone, until they end (the group rebalances
// when they join and when they leave), and fail, removing and publishing nothing, when a
// member of the group consumes topic itself. mem is not supported.
//
// The error says why Move could not go through: the topic could not be read, or ctx ended
// (the messages it did not reach are then kept); single messages' failures are in the report.
func (b *Broker) Move(ctx context.Context, topic string, limit int, pick MoveFunc) (MoveReport, error) {
	var rep MoveReport
	kept, failed, err := b.each(ctx, "move from", topic, limit, pick != nil, func(v View, e Entry) (bool, error) {
		to, out := pick(e.Message)
		if to == "" || out == nil {
			return false, nil
		}
		if err := b.moveOne(ctx, v, e, to, out); err != nil {
			return false, err
		}
		rep.Moved = append(rep.Moved, Moved{Message: e.Message, To: to, Published: out})
		return true, nil
	})
	rep.Kept, rep.Failed = kept, failed
	return rep, err
}

// DeleteFunc decides the fate of one message in a Delete: true removes it, false leaves it
// where it is.
type DeleteFunc func(msg *message.Message) bool

// DeleteReport says what Delete did, in the order of the messages.
type DeleteReport struct {
	// Deleted are the messages removed.
	Deleted []*message.Message
	// Kept are the messages left waiting, in their place: those pick left, and those Delete
	// did not reach because it stopped.
	Kept []*message.Message
	// Failed are the messages pick chose that could not be removed, each with why; they wait
	// in their place.
	Failed []Failure
}

// Delete goes through up to limit of the messages of topic that wait for the Broker's consumer
// group, oldest first (those Peek returns), and removes for good, as Move does, each one that
// pick returns true for, publishing nothing; the others, and those published while it runs,
// stay in their place. A message already gone (another Delete took it) counts as deleted. A
// message whose removal fails goes in DeleteReport.Failed with why, and Delete goes on with
// the next one. The error is as Move's.
func (b *Broker) Delete(ctx context.Context, topic string, limit int, pick DeleteFunc) (DeleteReport, error) {
	var rep DeleteReport
	kept, failed, err := b.each(ctx, "delete from", topic, limit, pick != nil, func(v View, e Entry) (bool, error) {
		if !pick(e.Message) {
			return false, nil
		}
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if err := v.Remove(ctx, e); err != nil {
			return false, fmt.Errorf("message %q: %w", e.Message.UUID, err)
		}
		rep.Deleted = append(rep.Deleted, e.Message)
		return true, nil
	})
	rep.Kept, rep.Failed = kept, failed
	return rep, err
}

// each lists up to limit of the messages of topic that wait for the group and runs step on
// each, in order, in one view, which it claims first when it is a Claimer. step reports
// whether it took the message out of topic; those it did not take are kept, those it failed
// on failed. The end of ctx stops each, and the messages after it are kept. The error is
// each's own: a limit that is not positive, no pick, a view that cannot be read or closed, or
// the end of ctx.
func (b *Broker) each(ctx context.Context, op, topic string, limit int, picked bool, step func(v View, e Entry) (took bool, err error)) (kept []*message.Message, failed []Failure, err error) {
	if limit <= 0 {
		return nil, nil, fmt.Errorf("broker: %s topic %q: limit %d is not positive", op, topic, limit)
	}
	if !picked {
		return nil, nil, fmt.Errorf("broker: %s topic %q: pick is nil", op, topic)
	}
	v, err := b.openView(ctx, topic)
	if err != nil {
		return nil, nil, err
	}
	if c, ok := v.(Claimer); ok {
		if err := c.Claim(ctx); err != nil {
			return nil, nil, b.inspectErr(op, topic, errors.Join(err, v.Close()))
		}
	}
	entries, err := v.List(ctx, limit)
	if err != nil {
		return nil, nil, b.inspectErr(op, topic, errors.Join(err, v.Close()))
	}
	for i, e := range entries {
		if err := ctx.Err(); err != nil {
			for _, rest := range entries[i:] {
				kept = append(kept, rest.Message)
			}
			return kept, failed, b.inspectErr(op, topic, errors.Join(err, v.Close()))
		}
		took, err := step(v, e)
		switch {
		case err != nil:
			failed = append(failed, Failure{Message: e.Message, Err: redact.Error(err, b.secrets)})
		case !took:
			kept = append(kept, e.Message)
		}
	}
	if err := v.Close(); err != nil {
		return kept, failed, b.inspectErr(op, topic, err)
	}
	return kept, failed, nil
}

// moveOne publishes out to topic to, then removes e.
func (b *Broker) moveOne(ctx context.Context, v View, e Entry, to string, out *message.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	pub := out.Copy()
	pub.SetContext(ctx)
	if e.PublishID != "" {
		pub.Metadata.Set(HeaderNATSMsgID, e.PublishID)
	}
	if err := b.pub.Publish(to, pub); err != nil {
		return fmt.Errorf("message %q: %w", e.Message.UUID, err)
	}
	if err := v.Remove(ctx, e); err != nil {
		return fmt.Errorf("message %q was published to %q but not removed (the next move publishes it again): %w", e.Message.UUID, to, err)
	}
	return nil
}

// Trim deletes the messages of topic that every consumer group of the topic has acknowledged,
// in short statements, and returns how many it deleted: the PostgreSQL, MySQL and SQLite
// queues keep a message after its acknowledgement (a consumer group that subscribes later
// reads the topic from its start), and grow until trimmed. A group that subscribes for the
// first time after a Trim does not see the deleted messages. The other schemes delete
// acknowledged messages themselves, or keep them by their own retention (Kafka, NATS,
// Redis): Trim returns an error wrapping errors.ErrUnsupported there. A topic that does not
// exist has nothing to trim, or is an error wrapping ErrNotFound with Options.ReportNotFound.
// Run it from one process at a time.
func (b *Broker) Trim(ctx context.Context, topic string) (int64, error) {
	if err := b.usableTopic(topic); err != nil {
		return 0, err
	}
	if b.be.Trim == nil {
		return 0, fmt.Errorf("broker: trim topic %q: %s keeps no acknowledged messages to trim (the broker deletes them, or keeps them by its own retention): %w",
			topic, b.scheme, errors.ErrUnsupported)
	}
	n, err := b.be.Trim(ctx, topic)
	if errors.Is(err, ErrNotFound) && !b.opts.ReportNotFound {
		return 0, nil
	}
	if err != nil {
		return n, b.inspectErr("trim", topic, err)
	}
	return n, nil
}
