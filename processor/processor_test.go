package processor_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
)

type payment struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

func TestJSON_DecodesPayload(t *testing.T) {
	var got payment
	p := processor.JSON(func(_ context.Context, _ *messagedata.MessageData, v payment) error {
		got = v
		return nil
	})
	require.NoError(t, p.Process(context.Background(), &messagedata.MessageData{Payload: []byte(`{"id":"p1","amount":5,"extra":true}`)}))
	require.Equal(t, payment{ID: "p1", Amount: 5}, got)
}

func TestJSON_MalformedPayloadIsPermanent(t *testing.T) {
	called := false
	p := processor.JSON(func(context.Context, *messagedata.MessageData, payment) error { called = true; return nil })
	for _, payload := range []string{`{"id":`, `{"amount":"five"}`, `{"id":"a"} {"id":"b"}`, ``} {
		err := p.Process(context.Background(), &messagedata.MessageData{ID: "m", Payload: []byte(payload)})
		require.True(t, processor.IsPermanent(err), "payload %q: %v", payload, err)
		require.Equal(t, processor.Failed, processor.OutcomeOf(err), "a permanent error is a failure until dead-lettered")
	}
	require.False(t, called)
}

func TestOutcomeOf(t *testing.T) {
	base := errors.New("x")
	require.Equal(t, processor.Processed, processor.OutcomeOf(nil))
	require.Equal(t, processor.Duplicate, processor.OutcomeOf(processor.AlreadyProcessed("seen")))
	require.Equal(t, processor.Duplicate, processor.OutcomeOf(errors.Join(base, processor.ErrDuplicate)))
	require.Equal(t, processor.DeadLettered, processor.OutcomeOf(errors.Join(processor.ErrDeadLettered, processor.Permanent(base))))
	require.Equal(t, processor.Panicked, processor.OutcomeOf(&processor.PanicError{Value: "p"}))
	require.Equal(t, processor.Failed, processor.OutcomeOf(base))
	require.True(t, processor.Duplicate.Acks())
	require.False(t, processor.Failed.Acks())
}

type result struct{ n int64 }

func (r result) LastInsertId() (int64, error) { return 0, nil }
func (r result) RowsAffected() (int64, error) { return r.n, nil }

func TestRowsAffectedOrDuplicate(t *testing.T) {
	require.NoError(t, processor.RowsAffectedOrDuplicate(result{1}, nil))
	require.ErrorIs(t, processor.RowsAffectedOrDuplicate(result{0}, nil), processor.ErrDuplicate)
	boom := errors.New("boom")
	require.ErrorIs(t, processor.RowsAffectedOrDuplicate(nil, boom), boom)
}

func TestPermanent_NilStaysNil(t *testing.T) {
	require.NoError(t, processor.Permanent(nil))
	require.True(t, errors.Is(processor.Permanent(context.Canceled), context.Canceled))
}
