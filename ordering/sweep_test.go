package ordering_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
)

func TestSweep_WaitReportsATimedOutGapOnceAndKeepsWaiting(t *testing.T) {
	forEachDB(t, ordering.Config{GapPolicy: ordering.Wait}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.clock.Advance(gapTimeout - time.Second)
		require.Equal(t, ordering.SweepResult{}, e.sweep(t), "not timed out yet")
		require.Zero(t, e.gapTimeouts(t, "wait", "gap"))

		e.clock.Advance(2 * time.Second)
		require.Equal(t, ordering.SweepResult{TimedOut: 1}, e.sweep(t))
		require.Equal(t, int64(1), e.gapTimeouts(t, "wait", "gap"))
		require.Equal(t, ordering.SweepResult{}, e.sweep(t), "reported once per wait")
		require.Equal(t, int64(1), e.gapTimeouts(t, "wait", "gap"))
		require.Empty(t, e.applied(t))
		require.Empty(t, e.dlq.all())

		e.mustDeliver(t, "m1", "acct-1", 1)
		require.Equal(t, []string{"acct-1#1", "acct-1#2"}, e.applied(t), "the late message fills the gap")
		require.Equal(t, ordering.Stats{}, e.stats(t))
	})
}

func TestSweep_SkipGivesUpOnTheGapAndAppliesWhatFollows(t *testing.T) {
	forEachDB(t, ordering.Config{GapPolicy: ordering.Skip}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m1", "acct-1", 1)
		e.mustDeliver(t, "m4", "acct-1", 4) // 2 and 3 are missing
		e.mustDeliver(t, "m5", "acct-1", 5)
		e.mustDeliver(t, "b2", "acct-b", 2) // a gap that has not timed out yet
		e.clock.Advance(gapTimeout + time.Second)
		e.mustDeliver(t, "c2", "acct-c", 2)

		require.Equal(t, ordering.SweepResult{TimedOut: 2, SkippedSequences: 3, Applied: 3}, e.sweep(t), "acct-1 skips 2..3, acct-b skips 1")
		require.Equal(t, []string{"acct-1#1", "acct-1#4", "acct-1#5", "acct-b#2"}, e.applied(t))
		require.Equal(t, int64(2), e.gapTimeouts(t, "skip", "gap"))
		st := e.stats(t)
		require.Equal(t, int64(1), st.Parked, "acct-c has not waited long enough")

		err := e.deliver("m2", "acct-1", 2)
		require.True(t, processor.IsPermanent(err), "a skipped sequence that arrives late is dead-lettered: %v", err)
		require.ErrorIs(t, err, ordering.ErrSkipped)
		require.Contains(t, err.Error(), "sequences 2..3 were given up on")
		require.ErrorIs(t, e.deliver("m5-resent", "acct-1", 5), processor.ErrDuplicate, "an applied one is still a duplicate")
		e.mustDeliver(t, "m6", "acct-1", 6)
		require.Equal(t, []string{"acct-1#1", "acct-1#4", "acct-1#5", "acct-b#2", "acct-1#6"}, e.applied(t))
	})
}

func TestSweep_DeadLetterMovesTheParkedMessagesAndTheyCanBeReplayed(t *testing.T) {
	forEachDB(t, ordering.Config{GapPolicy: ordering.DeadLetter}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m3", "acct-1", 3)
		e.mustDeliver(t, "m4", "acct-1", 4)
		e.clock.Advance(gapTimeout + time.Second)

		require.Equal(t, ordering.SweepResult{TimedOut: 1, DeadLettered: 2}, e.sweep(t))
		require.Equal(t, int64(1), e.gapTimeouts(t, "dead-letter", "gap"))
		reasons := e.reasons()
		require.Len(t, reasons, 2)
		require.Contains(t, reasons["m3"], `gap at seq 1 of key "acct-1" not filled after 5m1s`)
		require.Contains(t, reasons["m4"], `gap at seq 1 of key "acct-1" not filled after 5m1s`)
		dl := e.dlq.all()[0]
		require.Equal(t, "acct-1", dl.Metadata.Get(messagedata.HeaderKey))
		require.Equal(t, "3", dl.Metadata.Get(messagedata.HeaderSequence))
		require.Equal(t, handlerName, dl.Metadata.Get(messagedata.HeaderDeadLetterHandler))
		require.Equal(t, "postings", dl.Metadata.Get(messagedata.HeaderDeadLetterTopic))
		require.Equal(t, string(msg("m3", "acct-1", 3).Payload), string(dl.Payload))
		require.Equal(t, ordering.Stats{}, e.stats(t), "the key waits no more")
		require.Empty(t, e.applied(t))

		// The missing messages come; then the dead letters are replayed with their ids: their
		// dedup records went with them, so they are applied, in order.
		e.mustDeliver(t, "m1", "acct-1", 1)
		e.mustDeliver(t, "m4", "acct-1", 4)
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.mustDeliver(t, "m3", "acct-1", 3)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3", "acct-1#4"}, e.applied(t))
	})
}

func TestSweep_ParkedMessageThatFailsPermanentlyIsDeadLetteredLeavingAGap(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.mustDeliver(t, "m3", "acct-1", 3)
		e.setFail(func(md *messagedata.MessageData) error {
			if md.Sequence == 2 {
				return processor.Permanent(errors.New("account closed"))
			}
			return nil
		})
		e.mustDeliver(t, "m1", "acct-1", 1)
		require.Equal(t, int64(1), e.stats(t).StalledKeys)

		require.Equal(t, ordering.SweepResult{Stalled: 1, DeadLettered: 1}, e.sweep(t))
		require.Contains(t, e.reasons()["m2"], `parked sequence 2 of key "acct-1" failed permanently: permanent: account closed`)
		st := e.stats(t)
		require.Equal(t, ordering.Stats{Parked: 1, BlockedKeys: 1, OldestBlocked: st.OldestBlocked}, st, "sequence 3 waits for the gap at 2")

		// Fixed and replayed from the dead-letter topic, it is applied, and 3 after it.
		e.setFail(nil)
		e.mustDeliver(t, "m2", "acct-1", 2)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3"}, e.applied(t))
	})
}

func TestSweep_SkipDeadLettersAFailingParkedMessageAndAppliesWhatFollows(t *testing.T) {
	forEachDB(t, ordering.Config{GapPolicy: ordering.Skip}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.mustDeliver(t, "m3", "acct-1", 3)
		e.setFail(func(md *messagedata.MessageData) error {
			if md.Sequence == 2 {
				return errors.New("downstream unavailable")
			}
			return nil
		})
		e.mustDeliver(t, "m1", "acct-1", 1)
		require.Equal(t, ordering.SweepResult{Stalled: 1}, e.sweep(t), "retried before the timeout")

		e.clock.Advance(gapTimeout + time.Second)
		require.Equal(t, ordering.SweepResult{Stalled: 1, TimedOut: 1, DeadLettered: 1, SkippedSequences: 1, Applied: 1}, e.sweep(t))
		require.Equal(t, int64(1), e.gapTimeouts(t, "skip", "failure"))
		reason := e.reasons()["m2"]
		require.Contains(t, reason, `sequence 2 of key "acct-1" failed for 5m1s (3 attempts): downstream unavailable`)
		require.Contains(t, reason, "skipped")
		require.Equal(t, []string{"acct-1#1", "acct-1#3"}, e.applied(t))
		require.Equal(t, ordering.Stats{}, e.stats(t))

		e.setFail(nil)
		require.ErrorIs(t, e.deliver("m2", "acct-1", 2), ordering.ErrSkipped, "its replay is refused: it would be out of order")
	})
}

func TestSweep_DeadLetterMovesAFailingParkedMessageAndThoseAfterIt(t *testing.T) {
	forEachDB(t, ordering.Config{GapPolicy: ordering.DeadLetter}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.mustDeliver(t, "m3", "acct-1", 3)
		e.setFail(func(md *messagedata.MessageData) error {
			if md.Sequence == 2 {
				return errors.New("downstream unavailable")
			}
			return nil
		})
		e.mustDeliver(t, "m1", "acct-1", 1)
		e.clock.Advance(gapTimeout + time.Second)
		require.Equal(t, ordering.SweepResult{Stalled: 1, TimedOut: 1, DeadLettered: 2}, e.sweep(t))
		require.Len(t, e.reasons(), 2)
		require.Equal(t, ordering.Stats{}, e.stats(t))

		e.setFail(nil)
		e.mustDeliver(t, "m3", "acct-1", 3) // replayed out of order: parked
		e.mustDeliver(t, "m2", "acct-1", 2)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3"}, e.applied(t))
	})
}

func TestSweep_NeedsTheMiddlewareApplied(t *testing.T) {
	t.Parallel()
	store, err := ordering.NewStore(testDB(t), ordering.StoreConfig{})
	require.NoError(t, err)
	io, err := ordering.New(store, ordering.Config{Handler: "h"})
	require.NoError(t, err)
	_, err = io.Sweep(context.Background())
	require.ErrorContains(t, err, "wraps no processor")
}

func TestRun_SweepsUntilTheContextEnds(t *testing.T) {
	forEachDB(t, ordering.Config{SweepInterval: 20 * time.Millisecond}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.setFail(func(md *messagedata.MessageData) error {
			if md.Sequence == 2 {
				return errors.New("not yet")
			}
			return nil
		})
		e.mustDeliver(t, "m1", "acct-1", 1)
		e.setFail(nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- e.io.Run(ctx) }()
		testsvc.Eventually(t, 10*time.Second, func() bool { return len(e.applied(t)) == 2 }, "the sweeper did not retry the stalled key")
		cancel()
		require.NoError(t, <-done)
	})
}

func TestInOrder_MaxDrainLeavesTheRestOfABacklogToTheSweeper(t *testing.T) {
	forEachDB(t, ordering.Config{MaxDrain: 2}, func(t *testing.T, e *env) {
		for seq := uint64(6); seq >= 2; seq-- {
			e.mustDeliver(t, fmt.Sprintf("m%d", seq), "acct-1", seq)
		}
		e.mustDeliver(t, "m1", "acct-1", 1)
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3"}, e.applied(t), "the message and MaxDrain parked ones")
		st := e.stats(t)
		require.Equal(t, ordering.Stats{Parked: 3, BlockedKeys: 1, StalledKeys: 1, OldestBlocked: st.OldestBlocked}, st)
		require.ErrorIs(t, e.deliver("m4-resent", "acct-1", 4), processor.ErrDuplicate)

		require.Equal(t, ordering.SweepResult{Applied: 3}, e.sweep(t), "the sweeper releases the rest, MaxDrain per transaction")
		require.Equal(t, []string{"acct-1#1", "acct-1#2", "acct-1#3", "acct-1#4", "acct-1#5", "acct-1#6"}, e.applied(t))
		require.Equal(t, ordering.Stats{}, e.stats(t))
	})
}

func TestSweep_WaitReportsAFailingParkedMessageOnceAndKeepsRetrying(t *testing.T) {
	forEachDB(t, ordering.Config{}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "m2", "acct-1", 2)
		e.setFail(func(md *messagedata.MessageData) error {
			if md.Sequence == 2 {
				return errors.New("downstream unavailable")
			}
			return nil
		})
		e.mustDeliver(t, "m1", "acct-1", 1)
		e.clock.Advance(gapTimeout + time.Second)
		require.Equal(t, ordering.SweepResult{Stalled: 1, TimedOut: 1}, e.sweep(t))
		require.Equal(t, ordering.SweepResult{Stalled: 1}, e.sweep(t), "retried, reported once")
		require.Equal(t, int64(1), e.gapTimeouts(t, "wait", "failure"))
		require.Empty(t, e.dlq.all())
		e.setFail(nil)
		require.Equal(t, ordering.SweepResult{Applied: 1}, e.sweep(t))
		require.Equal(t, []string{"acct-1#1", "acct-1#2"}, e.applied(t))
	})
}

func TestSweep_AKeyThatFailsIsLoggedAndCountedAndTheOtherKeysGoOn(t *testing.T) {
	forEachDB(t, ordering.Config{GapPolicy: ordering.DeadLetter}, func(t *testing.T, e *env) {
		e.mustDeliver(t, "a2", "acct-a", 2)
		e.mustDeliver(t, "b2", "acct-b", 2)
		e.mustDeliver(t, "c2", "acct-c", 2)
		e.dlq.mu.Lock()
		e.dlq.refuse = func(m *message.Message) error {
			if m.Metadata.Get(messagedata.HeaderKey) == "acct-a" {
				return errors.New("dead-letter broker refuses it")
			}
			return nil
		}
		e.dlq.mu.Unlock()
		e.clock.Advance(gapTimeout + time.Second)

		res := e.sweep(t)
		require.Len(t, res.Failed, 1)
		require.Equal(t, "acct-a", res.Failed[0].Key)
		require.ErrorContains(t, res.Failed[0].Err, "dead-letter broker refuses it")
		require.Equal(t, 2, res.DeadLettered, "the keys after the failing one were swept")
		require.ElementsMatch(t, []string{"b2", "c2"}, ids(e.dlq.all()))
		require.Equal(t, int64(1), e.sweepErrors(t))

		e.dlq.mu.Lock()
		e.dlq.refuse = nil
		e.dlq.mu.Unlock()
		res = e.sweep(t)
		require.Empty(t, res.Failed)
		require.Equal(t, 1, res.DeadLettered, "the failed key is tried again")
	})
}

func ids(msgs []*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}
