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

	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/internal/crashpoint"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
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
	// window is how many deliveries of one subscription the handler can take at once (its
	// share of slots), asked of the subscriber on the Subscribe context
	// (redelivery.WithWindow): a subscriber whose prefetch was left unset holds that many.
	window int
	// work hands deliveries to idle workers; closed when the subscriptions have ended.
	work         chan *message.Message
	conv         converter.MessageConverter
	chain        processor.Processor
	reject       processor.Processor
	ackOnReceipt bool
	// slots bounds the deliveries being processed at once: a subscription's reader takes a
	// slot before it starts a delivery's goroutine, and the deliveries beyond wait in their
	// subscriptions. Concurrency slots; with group commit, enough for Concurrency full groups
	// running and one collecting, or with a lane as many full groups waiting as running
	// (GroupCommit bounds the transactions).
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
	// lane runs the first deliveries of a handler with group commit without a goroutine each
	// (lane.go); nil for a handler whose chain has none.
	lane *lane
	// stats are the handler's counts and state, for Router.Status (status.go).
	stats *handlerStats
	// records are what the router keeps for the handler's built-in stages, given to each
	// delivery (delivery.State.Records); nil for a BestEffort handler.
	records *delivery.Records
	// outage pauses the handler while a failure that is not its messages' lasts (outage.go);
	// nil for a BestEffort handler, which acknowledges on receipt.
	outage *outage
}

// newConsumer returns the run-time consumer of the handler of env: its messages go through
// ch.chain, and through ch.reject when they cannot be converted.
func newConsumer(r *Router, env *stageEnv, ch chains) (*consumer, error) {
	h, info := env.Handler, env.HandlerInfo
	n := max(h.Concurrency, 1)
	c := &consumer{
		router:       r,
		name:         h.Name,
		topic:        h.Topic,
		conv:         h.converter(info.Logger),
		chain:        ch.chain,
		reject:       ch.reject,
		lane:         ch.lane,
		ackOnReceipt: h.qos() == BestEffort,
		redelivery:   h.Redelivery,
		logger:       info.Logger,
		attrs:        metric.WithAttributeSet(attribute.NewSet(telemetry.AttrHandler.String(h.Name))),
		settlement:   newSettlement(h.Topic, info.MessagingSystem, info.ConsumerGroup),
		stats:        newHandlerStats(h.qos()),
	}
	c.recordAttrs = []metric.RecordOption{c.attrs}
	if env.plan.group {
		// Enough deliveries for every group transaction to run full, and the next group to
		// collect: more would only wait, each in a goroutine of its own. A lane keeps no
		// goroutine per delivery: there, as many groups as run may be full and ready, so that
		// one starts full as soon as a transaction ends.
		size := h.GroupCommit.maxSize()
		groups := n + 1
		if ch.lane != nil {
			groups = 2 * n
		}
		c.slots = make(chan struct{}, groups*size)
	} else {
		c.slots = make(chan struct{}, n)
	}
	c.window = (cap(c.slots) + n - 1) / n
	if env.plan.deadLetter && h.DeadLetter.MaxDeliveries >= 0 {
		counter, err := r.counterFor(h)
		if err != nil {
			return nil, err
		}
		c.counter = counter
	}
	if byOffset, windowed := env.plan.byOffset(); byOffset {
		p, err := r.positionsFor(h)
		if err != nil {
			return nil, err
		}
		c.positions = handlerPositions{positions: p, handler: h.Name}
		c.positionWindow, c.shared = windowed, windowed
	}
	records, err := r.records(env)
	if err != nil {
		return nil, err
	}
	c.records = records
	if !c.ackOnReceipt {
		c.outage = newOutage(c, h.DB)
	}
	c.sub = &onceClosingSubscriber{Subscriber: h.Subscriber}
	c.subscriptions = n
	return c, nil
}

// read starts a delivery for each message of one subscription, the handler's sub-th, until the
// subscription ends. While the handler is paused by an outage it takes none (outage.wait).
// Once the router closes, the messages that still arrive are nacked without being processed.
func (c *consumer) read(msgs <-chan *message.Message, sub int) {
	for {
		if c.outage != nil {
			c.outage.wait(c.router.closing)
		}
		msg, open := <-msgs
		if !open {
			return
		}
		if c.outage != nil && !c.outage.admit(msg.Context(), c.router.closing) {
			msg.Nack() // it ended while the handler was paused
			redelivery.Settle(msg)
			continue
		}
		if !c.router.gate.enter() {
			msg.Nack()
			redelivery.Settle(msg)
			c.abandonTrial()
			continue
		}
		if c.slots != nil && !c.takeSlot() {
			select {
			case c.slots <- struct{}{}:
			case <-msg.Context().Done():
				// The delivery ended while it waited for its turn (its ack deadline passed,
				// its subscription closed): the broker delivers it again.
				msg.Nack()
				redelivery.Settle(msg)
				c.router.gate.leave()
				c.abandonTrial()
				continue
			}
		}
		if c.lane != nil && c.lane.take(c, msg, sub) {
			continue
		}
		c.start(msg)
	}
}

// abandonTrial gives up the outage's trial delivery, if the reader took it, for a delivery
// that ends without an outcome.
func (c *consumer) abandonTrial() {
	if c.outage != nil {
		c.outage.abandon()
	}
}

// takeSlot takes a slot if one is free, without waiting. Waiting selects on the delivery's
// context too, and asking a context for its Done channel makes one: a free slot, the usual
// case, costs no allocation.
func (c *consumer) takeSlot() bool {
	select {
	case c.slots <- struct{}{}:
		return true
	default:
		return false
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
	st.Records = c.records
	st.GivesBackOutages = c.outage != nil
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
		if md == nil { // a converter of the user's may return nothing with its error
			md = &messagedata.MessageData{ID: msg.UUID, Topic: c.topic, Headers: msg.Metadata, Payload: msg.Payload}
		}
		crashpoint.Reach(crashpoint.Received, md.ID)
		err = c.reject.Process(context.WithValue(ctx, convErrKey{}, convErr), md)
	} else {
		crashpoint.Reach(crashpoint.Received, md.ID)
		switch {
		case c.outage != nil && c.outage.paused():
			err = errPaused // taken before the pause: it goes back unprocessed
		case c.outage != nil && msg.Context().Err() != nil:
			// It ended while it waited for its turn (its ack deadline passed in the
			// subscriber's window, during a pause say): the broker has it again already.
			err = errEnded
		case c.ackOnReceipt:
			err = c.process(ctx, md, st)
		default:
			if md.Delivery, err = c.deliveries(ctx, msg, md); err == nil {
				st.Uncounted = c.outage.uncountedOf(md)
				err = c.process(ctx, md, st)
			}
		}
	}
	if slot {
		slot = false
		<-c.slots // the next delivery may start while this one is settled
	}
	c.finish(ctx, msg, md, st, err)
}

// finish acks or nacks a delivery whose chain returned err, logs it and ends its span.
func (c *consumer) finish(ctx context.Context, msg *message.Message, md *messagedata.MessageData, st *delivery.State, err error) {
	outcome := processor.OutcomeOf(err)
	if errors.Is(err, middleware.ErrDeadLetterFailed) {
		c.router.instruments.DeadLetterFails.Add(ctx, 1, c.attrs)
	}
	if c.outage != nil {
		if outcome == processor.Failed && (sqldb.IsOutage(err) || err == errEnded) {
			c.giveBack(ctx, msg, md, st, err)
			return
		}
		if outcome.Acks() {
			c.outage.forget(md)
		}
		if msg.Context().Err() == nil {
			c.outage.ok()
		} else {
			c.outage.abandon() // the delivery ended first: it tells nothing
		}
	}
	if st.AttemptOnNack && !outcome.Acks() {
		c.recordGrouped(ctx, msg, md)
	}
	if !c.ackOnReceipt {
		c.settle(ctx, msg, md, st, outcome)
	}
	c.stats.record(outcome, err)
	c.log(md, st, outcome, err)
	if st.Span != nil {
		st.Span.End() // last: the delivery's ack, metrics and log are done
	}
}

// errPaused is the failure of a delivery that the handler took before an outage paused it:
// it goes back to the broker unprocessed.
var errPaused error = outageError("the handler is paused by an outage")

// errEnded is the failure of a delivery that ended before its processing began: it goes back
// unprocessed and uncounted, without pausing the handler.
var errEnded = errors.New("the delivery ended before its processing began")

// outageError is an error that sqldb.IsOutage reports.
type outageError string

func (e outageError) Error() string { return string(e) }

// Outage reports true: the error is an outage.
func (outageError) Outage() bool { return true }

// giveBack hands msg back to the broker, to be delivered again at once, unprocessed by the
// failure err, an outage (the handler pauses: outage.fail) or errEnded; the delivery does not
// count against the message's delivery limit. It is logged at debug level only: the pause has its
// own line.
func (c *consumer) giveBack(ctx context.Context, msg *message.Message, md *messagedata.MessageData, st *delivery.State, err error) {
	// Only a delivery that a count has in it is taken out of the count: the broker's, or the
	// durable count, which an outage may have kept from counting it.
	id := ""
	if info, _ := redelivery.FromContext(msg.Context()); info.Count > 0 || md.Delivery > 0 {
		id = counterID(md)
	}
	if err == errEnded {
		c.outage.note(id)
		c.outage.abandon() // if it was the trial, it tells nothing
	} else {
		c.outage.fail(id, err)
	}
	if !redelivery.NackAfter(msg, 0) {
		msg.Nack()
	}
	redelivery.Settle(msg)
	c.settlement.Settle(st.Span, false, nil)
	c.stats.givenBack.Add(1)
	if c.logger.Enabled(ctx, slog.LevelDebug) {
		c.logger.Debug("message given back during an outage", "message_id", md.ID, "delivery", md.Delivery, "error", err)
	}
	if st.Span != nil {
		st.Span.End()
	}
}

// process runs the chain on md under the handler's isolation lock, which it releases once the
// processing is over, before the settlement, which may wait out a redelivery delay.
func (c *consumer) process(ctx context.Context, md *messagedata.MessageData, st *delivery.State) error {
	h, err := c.isolate(ctx, md, st)
	switch h {
	case heldShared:
		defer c.isolation.RUnlock()
	case heldAlone:
		defer c.isolation.Unlock()
	}
	if err != nil {
		return err
	}
	return c.chain.Process(ctx, md)
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
		c.nackLater(msg, c.redelivery.delay(md.Delivery))
		c.settlement.Settle(st.Span, false, nil)
		return
	}
	crashpoint.Reach(crashpoint.AfterCommit, md.ID)
	var lost error
	if err := msg.Context().Err(); err != nil {
		lost = fmt.Errorf("%w: the delivery ended before the acknowledgement (%w)", ErrAckLost, err)
	}
	if !msg.Ack() && lost == nil {
		lost = fmt.Errorf("%w: the delivery was nacked before", ErrAckLost)
	}
	redelivery.Settle(msg)
	if st.EndsGroup {
		redelivery.Flush(msg) // the group's acknowledgements go together, now
	}
	switch {
	case lost != nil:
		c.router.instruments.AckFailures.Add(ctx, 1, metric.WithAttributes(telemetry.AttrHandler.String(c.name), telemetry.AttrOutcome.String(string(outcome))))
		c.logger.Warn("acknowledgement lost; the broker will deliver the message again", "message_id", md.ID,
			"attempt", st.Attempt(), "delivery", st.Delivery(md.Delivery), "outcome", string(outcome), "committed", !st.CommittedAt.IsZero(), "error", lost)
	case !st.CommittedAt.IsZero():
		c.router.instruments.CommitToAck.Record(ctx, secondsSince(st.CommittedAt), c.recordAttrs...)
	}
	c.settlement.Settle(st.Span, true, lost)
}

func (c *consumer) log(md *messagedata.MessageData, st *delivery.State, outcome processor.Outcome, err error) {
	attempt, deliveries := st.Attempt(), st.Delivery(md.Delivery)
	switch outcome {
	case processor.Processed, processor.Duplicate:
		if c.logger.Enabled(context.Background(), slog.LevelDebug) {
			c.logger.Debug("message "+string(outcome), "message_id", md.ID, "attempt", attempt, "delivery", deliveries)
		}
	case processor.DeadLettered:
		c.logger.Warn("message dead-lettered", "message_id", md.ID, "attempt", attempt, "delivery", deliveries, "reason", err)
	case processor.Panicked:
		var p *processor.PanicError
		errors.As(err, &p)
		c.logger.Error("processor panicked; rolled back, message nacked", "message_id", md.ID, "attempt", attempt, "delivery", deliveries,
			"redelivery_in", c.redelivery.delay(md.Delivery), "panic", fmt.Sprint(p.Value), "stack", string(p.Stack))
	default:
		level := slog.LevelWarn
		if c.ackOnReceipt {
			level = slog.LevelError // the message is acked already: its effect is lost
		} else if errors.Is(err, middleware.ErrDeadLetterFailed) {
			level = slog.LevelError // the dead-letter broker refuses messages: an operator must look
		}
		attrs := []any{"message_id", md.ID, "attempt", attempt, "delivery", deliveries, "error", err, "lost", c.ackOnReceipt}
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
func (c *consumer) nackLater(msg *message.Message, d time.Duration) {
	if d > 0 && !redelivery.NackAfter(msg, d) {
		c.router.holds.wait(d)
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
