package ordering_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/ordercheck"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

func TestInOrder_MessagesInSequenceAreAppliedAsTheyCome(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		for seq := uint64(1); seq <= 3; seq++ {
			e.mustDeliver(t, fmt.Sprintf("m%d", seq), "acct-1", seq)
		}
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3"}, e.applied(t))
		require.Equal(t, ordering.Stats{}, e.stats(t))
	})
}

func TestInOrder_OlderSequenceIsADuplicateWhateverItsID(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m1", "acct-1", 1)
		e.mustDeliver(t, "m2", "acct-1", 2)

		err := e.deliver("m1", "acct-1", 1)
		require.ErrorIs(t, err, processor.ErrDuplicate, "same id: the dedup record")
		err = e.deliver("m1-resent", "acct-1", 1)
		require.ErrorIs(t, err, processor.ErrDuplicate, "a new id with an applied sequence")
		require.Contains(t, err.Error(), "sequence 1 of key \"acct-1\" was applied already (last applied: 2)")
		require.Equal(t, processor.Duplicate, processor.OutcomeOf(err), "the router acks it")

		require.Equal(t, []string{"acct-1#1", "acct-1#2"}, e.applied(t))
	})
}

func TestInOrder_EarlyMessagesAreParkedAndAppliedWhenTheGapFills(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m3", "acct-1", 3)
		e.mustDeliver(t, "m2", "acct-1", 2)
		require.Empty(t, e.applied(t), "nothing before sequence 1")
		st := e.stats(t)
		require.Equal(t, int64(2), st.Parked)
		require.Equal(t, int64(1), st.BlockedKeys)
		require.Equal(t, t0, st.OldestBlocked.UTC(), "the key waits since its first message was parked")

		e.clock.Advance(time.Minute)
		e.mustDeliver(t, "m1", "acct-1", 1)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3"}, e.applied(t), "the gap filled: the parked ones follow, in order, in the same transaction")
		require.Equal(t, ordering.Stats{}, e.stats(t))

		// A parked message reaches the processor as it arrived.
		want := msg("m3", "acct-1", 3)
		got := e.seen["m3"]
		require.Equal(t, want.ID, got.ID)
		require.Equal(t, want.Topic, got.Topic)
		require.Equal(t, want.Key, got.Key)
		require.Equal(t, want.Sequence, got.Sequence)
		require.Equal(t, want.Headers, got.Headers)
		require.Equal(t, want.Payload, got.Payload)
		require.True(t, want.Timestamp.Equal(got.Timestamp), "timestamp %s, want %s", got.Timestamp, want.Timestamp)
		require.Equal(t, 1, got.Attempt)

		// Their ids were recorded when they were parked: a redelivery is a duplicate.
		require.ErrorIs(t, e.deliver("m3", "acct-1", 3), processor.ErrDuplicate)
		e.mustDeliver(t, "m4", "acct-1", 4)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3", "acct-1#4"}, e.applied(t))
	})
}

func TestInOrder_SecondMessageWithAParkedSequenceIsADuplicate(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m3", "acct-1", 3)
		err := e.deliver("m3-resent", "acct-1", 3)
		require.ErrorIs(t, err, processor.ErrDuplicate)
		require.Contains(t, err.Error(), "is parked already")
		require.Equal(t, int64(1), e.stats(t).Parked)

		e.mustDeliver(t, "m1", "acct-1", 1)
		e.mustDeliver(t, "m2", "acct-1", 2)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3"}, e.applied(t))
		require.Contains(t, e.seen, "m3", "the first one parked is the one applied")
		require.NotContains(t, e.seen, "m3-resent")
	})
}

func TestInOrder_KeysAreIndependent(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "a2", "acct-a", 2) // acct-a waits for its first message
		e.mustDeliver(t, "b1", "acct-b", 1)
		e.mustDeliver(t, "b2", "acct-b", 2)
		require.Equal(t, []string{"acct-b#1", "acct-b#2"}, e.applied(t), "a gap in one key holds up no other")
		e.mustDeliver(t, "a1", "acct-a", 1)
		require.Equal(t, []string{"acct-b#1", "acct-b#2", "acct-a#1", "acct-a#2"}, e.applied(t))
	})
}

func TestInOrder_MessageWithoutKeyOrSequenceIsRefused(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		for _, tc := range []struct {
			name string
			md   *messagedata.MessageData
			want error
		}{
			{"neither", &messagedata.MessageData{ID: "u1"}, ordering.ErrUnordered},
			{"key only", &messagedata.MessageData{ID: "u2", Key: "acct-1"}, ordering.ErrUnordered},
			{"sequence only", &messagedata.MessageData{ID: "u3", Sequence: 1}, ordering.ErrUnordered},
			{"sequence too large", &messagedata.MessageData{ID: "u4", Key: "acct-1", Sequence: 1 << 63}, ordering.ErrInvalidKey},
			{"key too long", &messagedata.MessageData{ID: "u5", Key: string(make([]byte, 256)), Sequence: 1}, ordering.ErrInvalidKey},
			{"key not UTF-8", &messagedata.MessageData{ID: "u6", Key: "\xff", Sequence: 1}, ordering.ErrInvalidKey},
		} {
			err := e.chain.Process(context.Background(), tc.md)
			require.True(t, processor.IsPermanent(err), "%s: %v", tc.name, err)
			require.ErrorIs(t, err, tc.want, tc.name)
		}
		require.Empty(t, e.applied(t))
	})
}

func TestInOrder_AllowUnkeyedProcessesUnkeyedMessagesOnce(t *testing.T) {
	forEachDB(t, ordering.Config{AllowUnkeyed: true}, func(t *testing.T, e *env) {
		require.NoError(t, e.chain.Process(context.Background(), &messagedata.MessageData{ID: "u1"}))
		require.ErrorIs(t, e.chain.Process(context.Background(), &messagedata.MessageData{ID: "u1"}), processor.ErrDuplicate)
		require.Equal(t, []string{"#0"}, e.applied(t))
		err := e.chain.Process(context.Background(), &messagedata.MessageData{ID: "u2", Key: "acct-1"})
		require.ErrorIs(t, err, ordering.ErrUnordered, "a key without a sequence is refused all the same")
	})
}

func TestInOrder_FailingIncomingMessageRollsBackAndItsRetryApplies(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		boom := errors.New("boom")
		e.setFail(func(md *messagedata.MessageData) error {
			if md.Sequence == 1 {
				return boom
			}
			return nil
		})
		require.ErrorIs(t, e.deliver("m1", "acct-1", 1), boom)
		require.Empty(t, e.applied(t))
		require.Equal(t, int64(1), e.stats(t).Parked, "the rollback left the parked message in place")

		e.setFail(nil)
		e.mustDeliver(t, "m1", "acct-1", 1)
		require.Equal(t, []string{"acct-1#1", "acct-1#2"}, e.applied(t))
	})
}

func TestInOrder_FailingParkedMessageStallsItsKeyUntilTheSweeperRetriesIt(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		for _, fails := range []struct {
			name string
			fn   func()
		}{
			{"error", func() {}},
			{"panic", func() { panic("parked message panics") }},
		} {
			key := "acct-" + fails.name
			id := func(seq int) string { return fmt.Sprintf("%s-%d", key, seq) }
			e.mustDeliver(t, id(3), key, 3)
			e.mustDeliver(t, id(2), key, 2)
			e.setFail(func(md *messagedata.MessageData) error {
				if md.Key == key && md.Sequence == 2 {
					fails.fn()
					return errors.New("ledger locked")
				}
				return nil
			})
			e.mustDeliver(t, id(1), key, 1)
			require.Equal(t, []string{key + "#1"}, e.applied(t),
				"%s: the message that filled the gap commits; the failing parked one is rolled back alone", fails.name)
			st := e.stats(t)
			require.Equal(t, ordering.Stats{Parked: 2, BlockedKeys: 1, StalledKeys: 1, OldestBlocked: st.OldestBlocked}, st)

			err := e.deliver(id(2)+"-resent", key, 2)
			require.ErrorIs(t, err, processor.ErrDuplicate, "the parked one is that sequence")
			e.mustDeliver(t, id(4), key, 4)

			require.Equal(t, ordering.SweepResult{Stalled: 1}, e.sweep(t), "still failing")
			e.setFail(nil)
			res := e.sweep(t)
			require.Equal(t, ordering.SweepResult{Applied: 3}, res)
			require.Equal(t, []string{key + "#1", key + "#2", key + "#3", key + "#4"}, e.applied(t))
			require.Equal(t, 3, e.seen[id(2)].Attempt, "the third attempt of the parked message")
			require.Equal(t, ordering.Stats{}, e.stats(t))
			_, err = e.db.Exec(`DELETE FROM ` + appliedT)
			require.NoError(t, err)
		}
	})
}

// Competing consumers deliver the messages of one key in any order, at the same time: the
// key's lock makes their transactions take turns, and every message is applied once, in order.
func TestInOrder_ConcurrentConsumersOfOneKeyApplyItInOrder(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		const n, consumers = 60, 4
		work := make(chan uint64, 2*n)
		for _, seq := range rand.Perm(n) {
			work <- uint64(seq + 1)
		}
		for _, seq := range rand.Perm(n)[:n/3] { // a third of them twice
			work <- uint64(seq + 1)
		}
		close(work)
		var wg sync.WaitGroup
		errs := make(chan error, consumers)
		for range consumers {
			wg.Go(func() {
				for seq := range work {
					for attempt := 0; ; attempt++ {
						err := e.deliver(fmt.Sprintf("m%d", seq), "acct-1", seq)
						if err == nil || processor.IsDuplicate(err) {
							break
						}
						if !sqldb.IsRetryable(err) || attempt == 20 {
							errs <- err
							return
						}
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		res, err := ordercheck.Tally(context.Background(), e.db, appliedT, runID, map[string]uint64{"acct-1": n})
		require.NoError(t, err)
		require.True(t, res.OK(), "%+v", res)
		require.Equal(t, ordering.Stats{}, e.stats(t))
	})
}

func TestInOrder_ChainWithoutTransactionFails(t *testing.T) {
	t.Parallel()
	e := setup(t, testDB(t), ordering.Config{})
	p := e.io.Middleware()(processor.Func(func(context.Context, *messagedata.MessageData) error { return nil }))
	require.ErrorIs(t, p.Process(context.Background(), msg("m1", "acct-1", 1)), middleware.ErrNoTransaction)
}

func TestNew_RefusesInvalidConfig(t *testing.T) {
	t.Parallel()
	store, err := ordering.NewStore(testDB(t), ordering.StoreConfig{})
	require.NoError(t, err)
	for _, tc := range []struct {
		cfg  ordering.Config
		want string
	}{
		{ordering.Config{}, "Handler"},
		{ordering.Config{Handler: "h", GapTimeout: -time.Second}, "GapTimeout"},
		{ordering.Config{Handler: "h", GapPolicy: ordering.DeadLetter}, "DeadLetterPublisher"},
		{ordering.Config{Handler: "h", GapPolicy: 7}, "GapPolicy"},
	} {
		_, err := ordering.New(store, tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	_, err = ordering.NewStore(testDB(t), ordering.StoreConfig{Table: "bad name"})
	require.ErrorContains(t, err, "Table")
}

func TestGapPolicy_StringAndParse(t *testing.T) {
	t.Parallel()
	for _, p := range []ordering.GapPolicy{ordering.Wait, ordering.Skip, ordering.DeadLetter} {
		got, err := ordering.ParseGapPolicy(p.String())
		require.NoError(t, err)
		require.Equal(t, p, got)
	}
	got, err := ordering.ParseGapPolicy("DeadLetter")
	require.NoError(t, err)
	require.Equal(t, ordering.DeadLetter, got)
	_, err = ordering.ParseGapPolicy("drop")
	require.Error(t, err)
}
