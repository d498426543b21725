package middleware_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/brokertest"
	"github.com/onceflow/onceflow/internal/delivery"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

func delivered(id string, n int) *messagedata.MessageData {
	m := msg(id)
	m.Delivery = n
	return m
}

func TestDeadLetter_LastAllowedDeliveryThatFailsIsDeadLetteredWithTheLimitAndItsError(t *testing.T) {
	b := brokertest.New()
	boom := errors.New("downstream says no")
	var calls int
	p := must(middleware.DeadLetter{MaxDeliveries: 3}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error {
		calls++
		return boom
	}))

	for n := 1; n < 3; n++ {
		err := p.Process(context.Background(), delivered("a", n))
		require.ErrorIs(t, err, boom)
		require.Equal(t, processor.Failed, processor.OutcomeOf(err), "delivery %d is nacked", n)
	}
	require.Empty(t, b.Drain("dead"))

	err := p.Process(context.Background(), delivered("a", 3))
	require.ErrorIs(t, err, middleware.ErrDeliveryLimit)
	require.ErrorIs(t, err, boom)
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(err))
	require.Equal(t, 3, calls)
	dead := b.Drain("dead")
	require.Len(t, dead, 1)
	require.Equal(t, "permanent: delivery limit reached after 3 deliveries: downstream says no", dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason))
	require.Equal(t, "3", dead[0].Metadata.Get(messagedata.HeaderDeadLetterDeliveries))
}

func TestDeadLetter_PanicAtTheLimitIsDeadLettered(t *testing.T) {
	b := brokertest.New()
	p := must(middleware.DeadLetter{MaxDeliveries: 2}.Middleware(b, "dead", "h"))(middleware.Recover()(
		processor.Func(func(context.Context, *messagedata.MessageData) error { panic("nil map") })))
	err := p.Process(context.Background(), delivered("a", 2))
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(err))
	dead := b.Drain("dead")
	require.Len(t, dead, 1)
	require.Equal(t, "permanent: delivery limit reached after 2 deliveries: processor panicked: nil map", dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason))
}

func TestDeadLetter_MessageBeyondTheLimitIsDeadLetteredWithoutProcessing(t *testing.T) {
	// Its last allowed delivery ended without an outcome: the consumer died processing it.
	b := brokertest.New()
	called := false
	p := must(middleware.DeadLetter{MaxDeliveries: 3}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error {
		called = true
		return nil
	}))
	err := p.Process(context.Background(), delivered("a", 4))
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(err))
	require.False(t, called, "a message that killed its consumer three times is not run a fourth time")
	dead := b.Drain("dead")
	require.Len(t, dead, 1)
	require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "delivery limit reached after 3 deliveries: the last one ended without an outcome")
}

func TestDeadLetter_LimitCountsTheDeliveriesWhoseProcessingBegan(t *testing.T) {
	// Delivered 7 times, but its processing began twice: it waited behind a message that
	// killed its consumer.
	b := brokertest.New()
	calls := 0
	p := must(middleware.DeadLetter{MaxDeliveries: 3}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error {
		calls++
		return nil
	}))
	ctx := delivery.With(context.Background(), &delivery.State{Attempts: 2})
	require.NoError(t, p.Process(ctx, delivered("a", 7)))
	require.Equal(t, 1, calls)
	require.Empty(t, b.Drain("dead"))

	ctx = delivery.With(context.Background(), &delivery.State{Attempts: 4})
	err := p.Process(ctx, delivered("b", 4))
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(err))
	require.Equal(t, 1, calls, "its fourth began processing: the third ended without an outcome")
	dead := b.Drain("dead")
	require.Len(t, dead, 1)
	require.Contains(t, dead[0].Metadata.Get(messagedata.HeaderDeadLetterReason), "after 3 deliveries: the last one ended without an outcome")
}

func TestDeadLetter_MessageBeyondTheLimitThatWasProcessedIsADuplicate(t *testing.T) {
	// Processed, and its acknowledgement lost at every delivery since.
	b := brokertest.New()
	processed := map[string]bool{"done": true}
	// The router's record of what was processed.
	ctx := underRouter(&delivery.Records{Processed: func(_ context.Context, m *messagedata.MessageData) (bool, error) {
		return processed[m.ID], nil
	}})
	calls := 0
	p := must(middleware.DeadLetter{MaxDeliveries: 3}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error {
		calls++
		return nil
	}))
	err := p.Process(ctx, delivered("done", 4))
	require.Equal(t, processor.Duplicate, processor.OutcomeOf(err))
	require.Empty(t, b.Drain("dead"))

	err = p.Process(ctx, delivered("new", 4))
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(err))
	require.Len(t, b.Drain("dead"), 1)
	require.Zero(t, calls)
}

func TestDeadLetter_LimitSparesWhatIsNotTheMessagesFault(t *testing.T) {
	b := brokertest.New()
	for name, tc := range map[string]struct {
		err    error
		cancel bool
	}{
		"commit outcome unknown": {err: fmt.Errorf("%w: connection reset", middleware.ErrCommitOutcomeUnknown)},
		"delivery ended":         {err: context.Canceled, cancel: true},
		"duplicate":              {err: processor.AlreadyProcessed("seen")},
		"success":                {},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if tc.cancel {
				cancel()
			}
			p := must(middleware.DeadLetter{MaxDeliveries: 1}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error { return tc.err }))
			err := p.Process(ctx, delivered("a", 1))
			require.Equal(t, tc.err, err)
			require.Empty(t, b.Drain("dead"))
		})
	}
}

func TestDeadLetter_UnknownDeliveryCountIsNeverGivenUp(t *testing.T) {
	b := brokertest.New()
	boom := errors.New("boom")
	p := must(middleware.DeadLetter{MaxDeliveries: 1}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error { return boom }))
	require.ErrorIs(t, p.Process(context.Background(), delivered("a", 0)), boom)
	require.Empty(t, b.Drain("dead"))
}

// pickyPublisher refuses messages whose id is longer than maxID, or whose payload is longer
// than maxPayload, as brokers do; it keeps the rest.
type pickyPublisher struct {
	maxID, maxPayload int
	kept              []*message.Message
	refused           int
}

func (p *pickyPublisher) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if len(m.UUID) > p.maxID {
			p.refused++
			return fmt.Errorf("message id %q is %d bytes, the broker allows %d", m.UUID, len(m.UUID), p.maxID)
		}
		if len(m.Payload) > p.maxPayload {
			p.refused++
			return errors.New("maximum payload exceeded")
		}
	}
	p.kept = append(p.kept, msgs...)
	return nil
}

func (*pickyPublisher) Close() error { return nil }

func TestPublishDeadLetter_IDTheBrokerRefusesIsReplacedAndKeptInAHeader(t *testing.T) {
	pub := &pickyPublisher{maxID: 36, maxPayload: 1 << 20}
	long := strings.Repeat("x", 300)
	m := msg(long)
	m.Payload = []byte("body")
	for range 2 { // the same derived id each time
		require.NoError(t, middleware.PublishDeadLetter(context.Background(), pub, "dead", "h", m, errors.New("bad")))
	}
	require.Len(t, pub.kept, 2)
	require.Equal(t, 2, pub.refused)
	d := pub.kept[0]
	require.Len(t, d.UUID, 26)
	require.Equal(t, d.UUID, pub.kept[1].UUID)
	require.Equal(t, long, d.Metadata.Get(messagedata.HeaderDeadLetterOriginalID))
	require.Equal(t, "body", string(d.Payload))
	require.Equal(t, "bad", d.Metadata.Get(messagedata.HeaderDeadLetterReason))
}

// lineBreakRefuser refuses a message with a line break in a header value, as NATS does.
type lineBreakRefuser struct{ kept []*message.Message }

func (p *lineBreakRefuser) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		for k, v := range m.Metadata {
			if strings.ContainsAny(v, "\r\n") {
				return fmt.Errorf("metadata %q: headers cannot carry line breaks", k)
			}
		}
	}
	p.kept = append(p.kept, msgs...)
	return nil
}

func (*lineBreakRefuser) Close() error { return nil }

func TestPublishDeadLetter_ReasonWithLineBreaksIsMadeHeaderSafeAndKeepsThePayload(t *testing.T) {
	pub := &lineBreakRefuser{}
	m := msg("m-1")
	m.Payload = []byte("body")
	require.NoError(t, middleware.PublishDeadLetter(context.Background(), pub, "dead", "h", m,
		errors.Join(errors.New("first"), errors.New("second"))))
	require.Len(t, pub.kept, 1)
	d := pub.kept[0]
	require.Equal(t, "first\uFFFDsecond", d.Metadata.Get(messagedata.HeaderDeadLetterReason))
	require.Equal(t, "body", string(d.Payload), "the payload is kept")
	require.Equal(t, "m-1", d.Metadata.Get(messagedata.HeaderDeadLetterOriginalID))
	require.Empty(t, d.Metadata.Get(messagedata.HeaderDeadLetterPayloadDropped))
}

func TestPublishDeadLetter_PayloadTheBrokerRefusesIsDroppedAndSaid(t *testing.T) {
	pub := &pickyPublisher{maxID: 255, maxPayload: 10}
	m := msg("big")
	m.Payload = []byte(strings.Repeat("y", 100))
	m.Headers = map[string]string{"h1": "v"}
	require.NoError(t, middleware.PublishDeadLetter(context.Background(), pub, "dead", "h", m, errors.New("bad")))
	require.Len(t, pub.kept, 1)
	d := pub.kept[0]
	require.Empty(t, d.Payload)
	require.Equal(t, "big", d.Metadata.Get(messagedata.HeaderDeadLetterOriginalID))
	require.Contains(t, d.Metadata.Get(messagedata.HeaderDeadLetterPayloadDropped), "100 bytes and 1 headers dropped")
	require.Equal(t, "bad", d.Metadata.Get(messagedata.HeaderDeadLetterReason))
}

func TestDeadLetter_FailingDeadLetterBrokerIsRetryableAndSaysSo(t *testing.T) {
	p := must(middleware.DeadLetter{}.Middleware(failingPublisher{errors.New("broker down")}, "dead", "h"))(
		processor.Func(func(context.Context, *messagedata.MessageData) error { return processor.Permanent(errors.New("bad")) }))
	err := p.Process(context.Background(), msg("a"))
	require.ErrorIs(t, err, middleware.ErrDeadLetterFailed)
	require.False(t, processor.IsPermanent(err), "the broker's failure, not the message's")
	require.Equal(t, processor.Failed, processor.OutcomeOf(err))
}

func TestDefaultClassifier(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("insert: %w", &pgconn.PgError{Code: code}) }
	var v map[string]any
	syntax := json.Unmarshal([]byte(`{"a": tru}`), &v)
	require.Error(t, syntax)
	for name, tc := range map[string]struct {
		err       error
		permanent bool
	}{
		"value too long (22001)":         {pg("22001"), true},
		"not null (23502)":               {pg("23502"), true},
		"check (23514)":                  {pg("23514"), true},
		"business unique key (23505)":    {pg("23505"), true},
		"serialization failure (40001)":  {pg("40001"), false},
		"deadlock (40P01)":               {pg("40P01"), false},
		"connection":                     {pg("08006"), false},
		"JSON syntax":                    {syntax, true},
		"no id":                          {messagedata.ErrNoMessageID, true},
		"processor.Permanent":            {processor.Permanent(errors.New("x")), true},
		"commit outcome unknown":         {fmt.Errorf("%w: %w", middleware.ErrCommitOutcomeUnknown, pg("22001")), false},
		"another member's group failure": {fmt.Errorf("%w: %w", middleware.ErrGroupAborted, pg("23502")), false},
		"canceled":                       {context.Canceled, false},
		"unknown":                        {errors.New("remote service 503"), false},
	} {
		require.Equal(t, tc.permanent, middleware.DefaultClassifier(tc.err), name)
	}
}

func TestRetry_PermanentClassIsNotRetriedAndBecomesPermanent(t *testing.T) {
	var calls int
	tooLong := &pgconn.PgError{Code: "22001", Message: "value too long for type character varying(10)"}
	p := must(middleware.Retry{InitialInterval: time.Nanosecond}.Middleware())(processor.Func(func(context.Context, *messagedata.MessageData) error {
		calls++
		return fmt.Errorf("insert: %w", tooLong)
	}))
	err := p.Process(context.Background(), msg("a"))
	require.Equal(t, 1, calls)
	require.True(t, processor.IsPermanent(err))
	require.ErrorIs(t, err, tooLong)
}

// The dead-letter stage's classifier is the chain's: Retry, inside it, retries what it calls
// retryable, and the stage dead-letters only what it calls permanent.
func TestDeadLetter_ClassifierOverridesTheDefaultForRetryInside(t *testing.T) {
	b := brokertest.New()
	var calls int
	retryAnyway := func(error) bool { return false }
	p := middleware.Chain(must(middleware.DeadLetter{Classifier: retryAnyway}.Middleware(b, "dead", "h")),
		must(middleware.Retry{MaxAttempts: 3, InitialInterval: time.Nanosecond}.Middleware()))(
		processor.Func(func(context.Context, *messagedata.MessageData) error {
			calls++
			return &pgconn.PgError{Code: "23502"}
		}))
	err := p.Process(underRouter(nil), msg("a"))
	require.Equal(t, 3, calls)
	require.False(t, processor.IsPermanent(err))
	require.Empty(t, b.Drain("dead"))

	// Without it, the default classifier takes a NOT NULL violation for permanent: no retry,
	// and a dead letter.
	calls = 0
	p = middleware.Chain(must(middleware.DeadLetter{}.Middleware(b, "dead", "h")),
		must(middleware.Retry{MaxAttempts: 3, InitialInterval: time.Nanosecond}.Middleware()))(
		processor.Func(func(context.Context, *messagedata.MessageData) error {
			calls++
			return &pgconn.PgError{Code: "23502"}
		}))
	err = p.Process(underRouter(nil), msg("b"))
	require.Equal(t, 1, calls)
	require.True(t, processor.IsDeadLettered(err))
	require.Len(t, b.Drain("dead"), 1)
}

// The dead-letter stage applies its classifier itself: a chain without Retry dead-letters a
// data error on first sight too.
func TestDeadLetter_ClassifiesTheOutcomeWithoutRetry(t *testing.T) {
	b := brokertest.New()
	p := must(middleware.DeadLetter{}.Middleware(b, "dead", "h"))(processor.Func(func(context.Context, *messagedata.MessageData) error {
		return &pgconn.PgError{Code: "22001"}
	}))
	require.True(t, processor.IsDeadLettered(p.Process(context.Background(), msg("a"))))
	require.Len(t, b.Drain("dead"), 1)
}

// Every publish of one message's dead letter by one handler carries the same key, whatever id
// or form the dead-letter broker accepted and whatever the reason or the time; another handler
// and another replay of the message have keys of their own.
func TestPublishDeadLetter_KeyIsTheSameAtEveryPublishOfOneDeadLetter(t *testing.T) {
	key := func(pub message.Publisher, kept func() []*message.Message, handler string, m *messagedata.MessageData, reason string) string {
		t.Helper()
		require.NoError(t, middleware.PublishDeadLetter(context.Background(), pub, "dead", handler, m, errors.New(reason)))
		all := kept()
		k := all[len(all)-1].Metadata.Get(messagedata.HeaderDeadLetterKey)
		require.Len(t, k, 26)
		return k
	}
	plain := &pickyPublisher{maxID: 255, maxPayload: 1 << 20}
	kept := func() []*message.Message { return plain.kept }
	m := msg("order-7")
	first := key(plain, kept, "billing", m, "bad")
	require.Equal(t, middleware.DeadLetterKey("billing", "order-7", ""), first)
	require.Equal(t, first, key(plain, kept, "billing", m, "delivery limit reached after 6 deliveries"), "published again at a redelivery")
	require.NotEqual(t, first, key(plain, kept, "shipping", m, "bad"), "another handler")
	replayed := msg("order-7")
	replayed.Headers = map[string]string{messagedata.HeaderReplayCount: "1"}
	require.NotEqual(t, first, key(plain, kept, "billing", replayed, "bad"), "dead-lettered again after a replay")

	// Under a derived id, and without the payload: the key of the message's own id.
	long := msg(strings.Repeat("x", 300))
	noLong := &pickyPublisher{maxID: 36, maxPayload: 1 << 20}
	require.Equal(t, middleware.DeadLetterKey("billing", long.ID, ""), key(noLong, func() []*message.Message { return noLong.kept }, "billing", long, "bad"))
	big := msg("big")
	big.Payload = []byte(strings.Repeat("y", 100))
	noBig := &pickyPublisher{maxID: 255, maxPayload: 10}
	require.Equal(t, middleware.DeadLetterKey("billing", "big", ""), key(noBig, func() []*message.Message { return noBig.kept }, "billing", big, "bad"))

	// A message without an id is dead-lettered under a fresh one: each form tried carries the
	// key of that one.
	anon := msg("")
	anon.Payload = []byte(strings.Repeat("z", 100))
	noAnon := &pickyPublisher{maxID: 255, maxPayload: 10}
	got := key(noAnon, func() []*message.Message { return noAnon.kept }, "billing", anon, "message has no id")
	d := noAnon.kept[0]
	require.Equal(t, middleware.DeadLetterKey("billing", d.Metadata.Get(messagedata.HeaderDeadLetterOriginalID), ""), got)
}

// ctxRecord is a DeadLetterRecord that fails, as a database call does, when its context has
// ended.
type ctxRecord struct{ marked, looked int }

func (r *ctxRecord) DeadLettered(ctx context.Context, _ *messagedata.MessageData) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	r.looked++
	return false, nil
}

func (r *ctxRecord) MarkDeadLettered(ctx context.Context, _ *messagedata.MessageData) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	r.marked++
	return nil
}

// A delivery whose context ends while it fails (its ack deadline passed: the broker delivers
// it again) still records its dead letter, so that the redelivery finds it.
func TestDeadLetter_RecordIsWrittenAfterTheDeliveryEnded(t *testing.T) {
	b := brokertest.New()
	rec := &ctxRecord{}
	ctx, cancel := context.WithCancel(context.Background())
	ctx = delivery.With(ctx, &delivery.State{Records: &delivery.Records{DeadLettered: rec.DeadLettered, MarkDeadLettered: rec.MarkDeadLettered}})
	p := must(middleware.DeadLetter{}.Middleware(b, "dead", "h"))(
		processor.Func(func(context.Context, *messagedata.MessageData) error {
			cancel() // the delivery ends while the message fails
			return processor.Permanent(errors.New("bad"))
		}))
	err := p.Process(ctx, delivered("a", 2))
	require.True(t, processor.IsDeadLettered(err), "%v", err)
	require.NotContains(t, err.Error(), "not recorded")
	require.Equal(t, 1, rec.looked, "looked up")
	require.Equal(t, 1, rec.marked, "recorded")
	require.Len(t, b.Drain("dead"), 1)
}

// underRouter returns a context with the state of a delivery that the router runs, with the
// router's records rec (nil for none).
func underRouter(rec *delivery.Records) context.Context {
	ctx, st := delivery.Start(context.Background(), "h", time.Now())
	st.Records = rec
	return ctx
}
