package onceflow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file holds one delivery at run time: from the subscriber's message to its ack or nack.

type convErrKey struct{}

// consumer is one Handler at run time: what every delivery of its messages goes through.
type consumer struct {
	router *Router
	name   string
	topic  string
	sub    *onceClosingSubscriber
	// subscriptions is how many times the handler subscribes: Handler.Concurrency.
	subscriptions int
	// positions, for a handler that detects duplicates by offset, are given to its
	// subscriber on the Subscribe context (redelivery.WithPositions), or, with group commit,
	// positionWindow set (redelivery.WithPositionWindow).
	positions      redelivery.Positions
	positionWindow bool
	// work hands deliveries to idle workers; closed when the subscriptions have ended.
	work         chan *message.Message
	conv         converter.MessageConverter
	chain        processor.Processor
	reject       processor.Processor
	ackOnReceipt bool
	// slots bounds the deliveries being processed at once: a subscription's reader takes a
	// slot before it starts a delivery's goroutine, and the deliveries beyond wait in their
	// subscriptions. Concurrency slots; with group commit, enough for Concurrency full groups
	// running and one collecting (GroupCommit bounds the transactions).
	slots chan struct{}
	// counter counts deliveries that the broker does not count, for the delivery limit; nil
	// when the handler has no limit.
	counter *dedup.Counter
	// isolation runs a redelivered message of a handler with a counter alone: it holds the
	// lock, where the other deliveries share it. A message whose processing kills the process
	// then takes no other message's processing with it, and the attempts counted for the
	// delivery limit are its own.
	isolation sync.RWMutex
	// shared is set for a handler whose subscriber hands out a partition's records several at
	// once and in order (positionWindow): a redelivery there comes only once every record
	// before it is acked, while the records behind it that are out wait in the chain for it
	// to be applied; run alone, it would wait for them. Its subscriber hands out alone, by
	// itself, the records that a consumer may have died of (the Kafka subscriber's gate).
	shared     bool
	redelivery RedeliveryConfig
	logger     *slog.Logger
	attrs      metric.MeasurementOption
	// recordAttrs is attrs as the options of a Record, built once: a slice per call would be
	// an allocation per message.
	recordAttrs []metric.RecordOption
	settlement  *telemetry.Settlement
}

// newSettlement returns the settle span starts of a handler's topic.
func newSettlement(topic, system, group string) *telemetry.Settlement {
	attrs := []attribute.KeyValue{semconv.MessagingSystemKey.String(system)}
	if group != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(group))
	}
	return telemetry.NewSettlement(topic, attrs...)
}

// read starts a delivery for each message of one subscription, until the subscription ends.
// Once the router closes, the messages that still arrive are nacked without being processed.
func (c *consumer) read(msgs <-chan *message.Message) {
	for msg := range msgs {
		if !c.router.gate.enter() {
			msg.Nack()
			redelivery.Settle(msg)
			continue
		}
		if c.slots != nil {
			select {
			case c.slots <- struct{}{}:
			case <-msg.Context().Done():
				// The delivery ended while it waited for its turn (its ack deadline passed,
				// its subscription closed): the broker delivers it again.
				msg.Nack()
				redelivery.Settle(msg)
				c.router.gate.leave()
				continue
			}
		}
		c.start(msg)
	}
}

// start runs the delivery of msg on an idle worker of the handler, or on a new one when none
// is idle. Workers outlive their deliveries so that the next one reuses a goroutine whose
// stack has grown to the chain's depth already; there are never many more than the deliveries
// admitted at once (the slots), and they end when the handler's subscriptions have.
func (c *consumer) start(msg *message.Message) {
	select {
	case c.work <- msg:
	default:
		go c.worker(msg)
	}
}

func (c *consumer) worker(msg *message.Message) {
	for {
		c.handle(msg)
		var open bool
		if msg, open = <-c.work; !open {
			return
		}
	}
}

// handle runs one delivery, which has entered the router's gate (and taken a slot, when the
// handler has slots), and acks or nacks it.
func (c *consumer) handle(msg *message.Message) {
	defer c.router.gate.leave()
	slot := c.slots != nil
	defer func() {
		if slot {
			<-c.slots
		}
		if v := recover(); v != nil {
			// A chain without Recover: the delivery fails, and the broker delivers it again.
			c.logger.Error("panic in the handler's chain; message nacked", "message_id", msg.UUID, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			msg.Nack()
			redelivery.Settle(msg)
		}
	}()

	ctx, st := delivery.Start(msg.Context(), c.name, time.Now())
	if c.ackOnReceipt {
		msg.Ack()
		redelivery.Settle(msg)
		// The delivery is over for the broker, and subscribers end a message's context once it
		// is acked: the processing that follows must not end with it.
		ctx = context.WithoutCancel(ctx)
	}

	md, convErr := c.conv.FromMessage(c.topic, msg)
	var err error
	if convErr != nil {
		err = c.reject.Process(context.WithValue(ctx, convErrKey{}, convErr), md)
	} else {
		if !c.ackOnReceipt {
			md.Delivery = c.deliveries(ctx, msg, md)
		}
		err = c.process(ctx, md, st)
	}
	if slot {
		slot = false
		<-c.slots // the next delivery may start while this one is settled
	}

	outcome := processor.OutcomeOf(err)
	if errors.Is(err, middleware.ErrDeadLetterFailed) {
		c.router.instruments.DeadLetterFails.Add(ctx, 1, c.attrs)
	}
	if !c.ackOnReceipt {
		c.settle(ctx, msg, md, st, outcome)
	}
	c.log(md, st, outcome, err)
	if st.Span != nil {
		st.Span.End() // last: the delivery's ack, metrics and log are done
	}
}

// deliveries returns the delivery count of msg: the broker's, when it counts; 1 for a
// delivery the broker says is the first; otherwise the durable count of the handler's counter
// (0 when the handler has none, or it cannot be read).
func (c *consumer) deliveries(ctx context.Context, msg *message.Message, md *messagedata.MessageData) int {
	info, known := redelivery.FromContext(msg.Context())
	switch {
	case known && info.Count > 0:
		return info.Count
	case known && !info.Redelivered:
		return 1
	case c.counter == nil || md.ID == "":
		return 0
	}
	initial := 1 // every delivery is counted here
	if known {
		initial = 2 // the first went uncounted: the broker said it was the first
	}
	n, err := c.counter.Count(ctx, c.name, counterID(md), initial)
	if err != nil {
		c.logger.Warn("cannot count the delivery; the delivery limit does not apply to it", "message_id", md.ID, "error", err)
		return 0
	}
	return n
}

// process runs the chain on md under the handler's isolation lock, which it releases once the
// processing is over, before the settlement, which may wait out a redelivery delay.
func (c *consumer) process(ctx context.Context, md *messagedata.MessageData, st *delivery.State) error {
	switch c.isolate(ctx, md, st) {
	case heldShared:
		defer c.isolation.RUnlock()
	case heldAlone:
		defer c.isolation.Unlock()
	}
	return c.chain.Process(ctx, md)
}

// held is how a delivery holds the handler's isolation lock.
type held int

const (
	heldNone   held = iota // the handler has no counter: no lock
	heldShared             // the read lock, shared with the other deliveries
	heldAlone              // the lock, alone
)

// isolate takes the handler's isolation lock for a delivery: alone for a redelivery, when the
// handler counts attempts, shared otherwise; none without a counter. A redelivery's attempt is
// recorded once it holds the lock, before its processing begins. It returns how it holds the
// lock; a function to release it would be an allocation per delivery.
func (c *consumer) isolate(ctx context.Context, md *messagedata.MessageData, st *delivery.State) held {
	switch {
	case c.counter == nil || c.shared:
		return heldNone
	case md.Delivery <= 1 || md.ID == "":
		c.isolation.RLock()
		return heldShared
	}
	c.isolation.Lock()
	n, err := c.counter.Attempt(ctx, c.name, counterID(md))
	if err != nil {
		c.logger.Warn("cannot record the attempt; the delivery limit counts its deliveries", "message_id", md.ID, "error", err)
	} else {
		st.Attempts = n + 1 // the first delivery is not recorded: it is taken to have begun
	}
	return heldAlone
}

// settle acknowledges or rejects msg for outcome and records it: the settle span ("ack <topic>" or "nack <topic>"), the
// commit-to-ack latency, and acknowledgements lost because the delivery had ended. A message
// that failed is nacked so that the broker delivers it again after the handler's redelivery
// delay for its delivery count.
//
// watermill's Ack only hands the acknowledgement to the subscriber, which sends it to the
// broker later and reports nothing back. What the router can see is whether anyone still
// listens: a delivery whose context has ended (every adapter ends it when it stops waiting for
// the ack: ack deadline, closing subscription, lost connection) or that was nacked will not
// pass the ack on. Those are counted in onceflow.ack.failures. An ack that the subscriber
// accepts and then fails to send, or that is lost on the wire, is invisible here; it shows as a
// redelivery counted with outcome duplicate.
func (c *consumer) settle(ctx context.Context, msg *message.Message, md *messagedata.MessageData, st *delivery.State, outcome processor.Outcome) {
	if !outcome.Acks() {
		c.router.nackLater(msg, c.redelivery.delay(md.Delivery))
		c.settlement.Settle(st.Span, false, nil)
		return
	}
	var lost error
	if err := msg.Context().Err(); err != nil {
		lost = fmt.Errorf("%w: the delivery ended before the acknowledgement (%w)", ErrAckLost, err)
	}
	if !msg.Ack() && lost == nil {
		lost = fmt.Errorf("%w: the delivery was nacked before", ErrAckLost)
	}
	redelivery.Settle(msg)
	switch {
	case lost != nil:
		c.router.instruments.AckFailures.Add(ctx, 1, metric.WithAttributes(telemetry.AttrHandler.String(c.name), telemetry.AttrOutcome.String(string(outcome))))
		c.logger.Warn("acknowledgement lost; the broker will deliver the message again", "message_id", md.ID,
			"attempt", st.Retries+1, "delivery", md.Delivery, "outcome", string(outcome), "committed", !st.CommittedAt.IsZero(), "error", lost)
	case !st.CommittedAt.IsZero():
		c.router.instruments.CommitToAck.Record(ctx, secondsSince(st.CommittedAt), c.recordAttrs...)
	}
	c.settlement.Settle(st.Span, true, lost)
}

func (c *consumer) log(md *messagedata.MessageData, st *delivery.State, outcome processor.Outcome, err error) {
	attempt := st.Retries + 1
	switch outcome {
	case processor.Processed, processor.Duplicate:
		if c.logger.Enabled(context.Background(), slog.LevelDebug) {
			c.logger.Debug("message "+string(outcome), "message_id", md.ID, "attempt", attempt, "delivery", md.Delivery)
		}
	case processor.DeadLettered:
		c.logger.Warn("message dead-lettered", "message_id", md.ID, "attempt", attempt, "delivery", md.Delivery, "reason", err)
	case processor.Panicked:
		var p *processor.PanicError
		errors.As(err, &p)
		c.logger.Error("processor panicked; rolled back, message nacked", "message_id", md.ID, "attempt", attempt, "delivery", md.Delivery,
			"redelivery_in", c.redelivery.delay(md.Delivery), "panic", fmt.Sprint(p.Value), "stack", string(p.Stack))
	default:
		level := slog.LevelWarn
		if c.ackOnReceipt {
			level = slog.LevelError // the message is acked already: its effect is lost
		} else if errors.Is(err, middleware.ErrDeadLetterFailed) {
			level = slog.LevelError // the dead-letter broker refuses messages: an operator must look
		}
		attrs := []any{"message_id", md.ID, "attempt", attempt, "delivery", md.Delivery, "error", err, "lost", c.ackOnReceipt}
		if !c.ackOnReceipt {
			attrs = append(attrs, "redelivery_in", c.redelivery.delay(md.Delivery))
		}
		c.logger.Log(context.Background(), level, "message processing failed", attrs...)
	}
}

// nackLater nacks msg so that the broker delivers it again no sooner than after d: at once,
// with the delay, when its subscriber can delay redelivery; otherwise after holding it for d,
// in the delivery's goroutine (watermill acks a message whose handler returns, so the nack must
// come first). Close ends the holds at once.
func (r *Router) nackLater(msg *message.Message, d time.Duration) {
	if d > 0 && !redelivery.NackAfter(msg, d) {
		r.holds.wait(d)
	}
	msg.Nack() // a no-op after NackAfter
	redelivery.Settle(msg)
}

// holds lets the deliveries that wait out their redelivery delay in the router go at once when
// the router closes.
type holds struct {
	once    sync.Once
	closing chan struct{}
}

func (h *holds) init() { h.once.Do(func() { h.closing = make(chan struct{}) }) }

// wait waits for d, or until release.
func (h *holds) wait(d time.Duration) {
	h.init()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-h.closing:
	}
}

// release ends every wait, now and from now on.
func (h *holds) release() {
	h.init()
	select {
	case <-h.closing:
	default:
		close(h.closing)
	}
}

// gate counts deliveries in flight and refuses new ones once closing.
type gate struct {
	mu      sync.Mutex
	n       int
	closing bool
	idle    chan struct{}
}

func (g *gate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing {
		return false
	}
	g.n++
	return true
}

func (g *gate) leave() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n--
	if g.closing && g.n == 0 {
		close(g.idle)
	}
}

// close refuses new deliveries and returns a channel closed when none is in flight.
func (g *gate) close() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closing {
		g.closing = true
		if g.n == 0 {
			close(g.idle)
		}
	}
	return g.idle
}

// onceClosingSubscriber is a handler's subscriber, which the router closes once however
// often Close is called.
type onceClosingSubscriber struct {
	message.Subscriber
	once sync.Once
	err  error
}

func (s *onceClosingSubscriber) Close() error {
	s.once.Do(func() { s.err = s.Subscriber.Close() })
	return s.err
}

// counterID is the id under which the delivery counter keeps md: its id, and for a replayed
// dead letter (messagedata.HeaderReplayCount) its replay count too, so that a replay starts
// with no deliveries, attempts or dead letter of the message before it.
func counterID(md *messagedata.MessageData) string {
	if n := md.Header(messagedata.HeaderReplayCount); n != "" {
		return md.ID + "#replay-" + n
	}
	return md.ID
}

// deadLetterRecord keeps a handler's dead letters in its delivery counter.
type deadLetterRecord struct {
	counter *dedup.Counter
	handler string
}

func (r deadLetterRecord) DeadLettered(ctx context.Context, md *messagedata.MessageData) (bool, error) {
	if md.ID == "" {
		return false, nil
	}
	return r.counter.DeadLettered(ctx, r.handler, counterID(md))
}

func (r deadLetterRecord) MarkDeadLettered(ctx context.Context, md *messagedata.MessageData) error {
	if md.ID == "" {
		return nil // dead-lettered under a fresh id: no redelivery can be told from another message
	}
	return r.counter.MarkDeadLettered(ctx, r.handler, counterID(md))
}

// Processed reports whether a redelivery of md was processed (MarkProcessed), for a handler
// without duplicate detection.
func (r deadLetterRecord) Processed(ctx context.Context, md *messagedata.MessageData) (bool, error) {
	if md.ID == "" {
		return false, nil
	}
	return r.counter.Processed(ctx, r.handler, counterID(md))
}

// MarkProcessed records that a redelivery of md was processed and committed.
func (r deadLetterRecord) MarkProcessed(ctx context.Context, md *messagedata.MessageData) error {
	if md.ID == "" {
		return nil
	}
	return r.counter.MarkProcessed(ctx, r.handler, counterID(md))
}
