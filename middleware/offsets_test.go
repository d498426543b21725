package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// at returns a message at offset of partition 0, received after prev.
func at(id string, offset, prev int64) *messagedata.MessageData {
	m := msg(id)
	m.Headers = messagedata.Position{Partition: 0, Offset: offset, Previous: prev}.Headers()
	return m
}

func offsetsChain(t *testing.T, proc processor.Func) (processor.Processor, *dedup.Positions) {
	t.Helper()
	db := newDB(t)
	pos, err := dedup.NewPositions(db, dedup.PositionsConfig{})
	require.NoError(t, err)
	require.NoError(t, pos.Migrate(context.Background()))
	offsets := must(middleware.Dedup{Mode: middleware.DedupByOffset}.Middleware(db, "h"))
	return middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), offsets)(proc), pos
}

func TestOffsets_MessageAtOrBelowTheAppliedOffsetIsADuplicate(t *testing.T) {
	calls := 0
	p, pos := offsetsChain(t, func(ctx context.Context, m *messagedata.MessageData) error {
		calls++
		return write(ctx, m)
	})
	ctx := context.Background()
	require.NoError(t, p.Process(ctx, at("a", 10, -1)))
	require.NoError(t, p.Process(ctx, at("b", 11, 10)))
	for _, m := range []*messagedata.MessageData{at("a", 10, -1), at("b", 11, 10)} {
		err := p.Process(ctx, m)
		require.Equal(t, processor.Duplicate, processor.OutcomeOf(err), "offset %s", m.Header(messagedata.HeaderOffset))
	}
	require.Equal(t, 2, calls)
	got, err := pos.Load(ctx, "h", "t")
	require.NoError(t, err)
	require.Equal(t, map[int32]int64{0: 11}, got, "a consumer that takes the partition over resumes after 11")
}

func TestOffsets_FailedMessageLeavesThePositionWhereItWas(t *testing.T) {
	boom := errors.New("boom")
	fail := true
	p, pos := offsetsChain(t, func(ctx context.Context, m *messagedata.MessageData) error {
		if err := write(ctx, m); err != nil {
			return err
		}
		if fail {
			return boom
		}
		return nil
	})
	ctx := context.Background()
	require.ErrorIs(t, p.Process(ctx, at("a", 5, -1)), boom)
	got, err := pos.Load(ctx, "h", "t")
	require.NoError(t, err)
	require.Empty(t, got, "the failed attempt rolled its offset back with its writes")
	fail = false
	require.NoError(t, p.Process(ctx, at("a", 5, -1)))
}

func TestOffsets_MessageAheadOfItsPredecessorIsRetriedNotSkipped(t *testing.T) {
	p, _ := offsetsChain(t, write)
	ctx := context.Background()
	require.NoError(t, p.Process(ctx, at("a", 1, -1)))
	err := p.Process(ctx, at("c", 3, 2))
	require.ErrorIs(t, err, middleware.ErrPositionAhead)
	require.Equal(t, processor.Failed, processor.OutcomeOf(err), "retryable: it comes again after offset 2")
	require.NoError(t, p.Process(ctx, at("b", 2, 1)))
	require.NoError(t, p.Process(ctx, at("c", 3, 2)))
}

func TestOffsets_MessageWithoutAPositionIsRefused(t *testing.T) {
	p, _ := offsetsChain(t, write)
	err := p.Process(context.Background(), msg("a"))
	require.True(t, processor.IsPermanent(err), "%v", err)
	require.ErrorContains(t, err, "message has no position in an ordered log")

	m := msg("b")
	m.Headers = map[string]string{messagedata.HeaderPartition: "0", messagedata.HeaderOffset: "x"}
	err = p.Process(context.Background(), m)
	require.True(t, processor.IsPermanent(err))
	require.ErrorContains(t, err, `header onceflow_offset holds "x"`)
}
