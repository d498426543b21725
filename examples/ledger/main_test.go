package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestLedger_ShuffledPostingsAreAppliedInBookingOrderOnce(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			checkLedger(t, d.URL(t))
		})
	}
}

func checkLedger(t *testing.T, dbURL string) {
	dir := t.TempDir()
	s, err := run(context.Background(), dir, dbURL, 4, 30, 11, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)

	require.Equal(t, 120, s.Postings)
	require.Equal(t, 144, s.Deliveries, "a fifth delivered twice")
	require.Positive(t, s.MaxParked, "shuffled: some postings waited for an earlier one")
	require.Len(t, s.Accounts, 4)
	declined := 0
	for _, a := range s.Accounts {
		require.True(t, a.InOrder, "%s: entries in sequence order, each once, running balance consistent", a.Name)
		require.Equal(t, a.Expected, a.Balance, a.Name)
		require.Equal(t, 30, a.Entries, a.Name)
		declined += a.Declined
	}
	require.Positive(t, declined, "some withdrawals were declined: the order decided which")
	require.Positive(t, s.Unordered, "delivery order would have given other balances")
	require.True(t, s.OK())

	var out bytes.Buffer
	report(&out, dir, s)
	require.Contains(t, out.String(), "every account: postings applied exactly once, in booking order")
}

// Applied in delivery order instead, the same postings end differently: the example would
// show nothing if they did not.
func TestLedger_DeliveryOrderWouldGiveOtherBalances(t *testing.T) {
	booked := book(4, 30, newRand(11))
	differs := false
	for _, ps := range booked {
		want, _ := replay(ps)
		shuffled := append([]Posting(nil), ps...)
		r := newRand(3)
		r.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		got, _ := replay(shuffled)
		differs = differs || got != want
	}
	require.True(t, differs)
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed)) }
