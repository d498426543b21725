package conformance

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

// This file defines the Poison scenario's messages that cannot succeed, and the handler that
// meets them.

// poisonPayload is the payload of the scenario's messages.
type poisonPayload struct {
	Amount int  `json:"amount"`
	Panic  bool `json:"panic,omitempty"`
	Crash  bool `json:"crash,omitempty"`
}

// poisonMessage is one message that cannot succeed, and what must become of it.
type poisonMessage struct {
	kind    string
	id      string
	payload string
	// after is the number of good messages published before it.
	after int
	// reason is what its dead letter's reason must contain.
	reason string
	// deliveries is how many deliveries it takes to be dead-lettered.
	deliveries int
	// header are the values of its dead letter's deliveries header ("" for none); for a message
	// dead-lettered at its first processing, whether it may be missing.
	header []string
}

// poisonMessages returns the scenario's messages that cannot succeed: the crash loop, for the
// CrashLoop phase, and the others, in the order they are published, for the Handled phase.
func (f *fixture) poisonMessages() []poisonMessage {
	limit := fmt.Sprintf("delivery limit reached after %d deliveries: ", poisonMaxDeliveries)
	return []poisonMessage{
		{kind: "crash-loop", id: f.id("crash"), payload: `{"amount":1,"crash":true}`, after: 10,
			reason: limit + "the last one ended without an outcome", deliveries: poisonMaxDeliveries + 2,
			header: []string{fmt.Sprint(poisonMaxDeliveries + 2)}},
		// Its last delivery may die with the crash loop's consumer, which takes the messages it
		// holds with it: it is dead-lettered at the next one, for that.
		{kind: "panic", id: f.id("panic"), payload: `{"amount":2,"panic":true}`, after: 20,
			reason: limit, deliveries: poisonMaxDeliveries,
			header: []string{fmt.Sprint(poisonMaxDeliveries), fmt.Sprint(poisonMaxDeliveries + 1)}},
		{kind: "data-error", id: f.id("data"), payload: `{"amount":-1}`, after: 60,
			reason: "poison_amount_nonnegative", deliveries: 1, header: []string{"1"}},
		{kind: "malformed-payload", id: f.id("malformed"), payload: `{"amount":`, after: 100,
			reason: "decode JSON payload", deliveries: 1, header: []string{"1"}},
		// A broker that does not count deliveries leaves the count to the router's counter,
		// whose table cannot hold this id either: the count is unknown, and the header absent.
		{kind: "long-id", id: f.id("long-") + strings.Repeat("x", 300), payload: `{"amount":3}`, after: 140,
			reason: "dedup key too long", deliveries: 1, header: []string{"1", ""}},
	}
}

// poisonPanicValue is what the panic message's processor panics with.
const poisonPanicValue = "poison message: the processor panics on it every time (injected)"

// errCrashed is what the processor of a consumer in this process returns for the message that
// crashed it, once its delivery has ended.
var errCrashed = errors.New("the consumer crashed on this message (injected)")

// poisonSpec is the handler of the Poison scenario: ExactlyOnce in the fixture's mode, one
// delivery processed at a time per consumer, the delivery limit and the short redelivery
// delays. crash kills the consumer: it returns only in a consumer that runs in this process,
// once the delivery it was called for has ended.
func poisonSpec(name, topic string, crash func(ctx context.Context)) handlerSpec {
	apply := func(ctx context.Context, msgs []*messagedata.MessageData, vs []poisonPayload) error {
		for _, v := range vs {
			if v.Crash {
				crash(ctx)
				return errCrashed
			}
			if v.Panic {
				panic(poisonPanicValue)
			}
		}
		return writePoisonEffects(ctx, name, msgs, vs)
	}
	return handlerSpec{
		Name:  name,
		Topic: topic,
		Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, v poisonPayload) error {
			return apply(ctx, []*messagedata.MessageData{msg}, []poisonPayload{v})
		}),
		Batch:         processor.JSONBatch(apply),
		Concurrency:   1,
		MaxDeliveries: poisonMaxDeliveries,
		Redelivery:    poisonRedelivery,
	}
}

// writePoisonEffects writes an effect row per message with one statement, and the time it
// ran: the commit follows at once, so it stands for the message's commit time.
func writePoisonEffects(ctx context.Context, handler string, msgs []*messagedata.MessageData, vs []poisonPayload) error {
	tx, ok := processor.TxFromContext(ctx)
	if !ok {
		return errors.New("no transaction in the context")
	}
	now := time.Now().UnixMicro()
	var q strings.Builder
	q.WriteString(`INSERT INTO ` + poisonTable + ` (handler, message_id, amount, applied_at) VALUES `)
	args := make([]any, 0, 4*len(msgs))
	for i, msg := range msgs {
		if i > 0 {
			q.WriteString(", ")
		}
		q.WriteString("(?, ?, ?, ?)")
		args = append(args, handler, msg.ID, vs[i].Amount, now)
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(q.String()), args...)
	return err
}
