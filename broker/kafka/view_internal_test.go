package kafka

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Taking a record out for a group acks it as a member would: it joins the acked spans past the
// committed offset, and the committed offset moves past every acked record it reaches.
func TestAck_JoinsTheSpansAndMovesTheCommittedOffset(t *testing.T) {
	t.Parallel()
	g := groupOffset{committed: 10, md: groupMetadata{taken: 14, acked: []span{{12, 12}}, counts: map[int64]int{10: 3, 13: 2}}}

	g, changed, err := ack(g, 0, 13)
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, int64(10), g.committed)
	require.Equal(t, []span{{12, 13}}, g.md.acked)
	require.Equal(t, map[int64]int{10: 3}, g.md.counts, "the count of an acked record goes")

	g, _, err = ack(g, 0, 11)
	require.NoError(t, err)
	require.Equal(t, []span{{11, 13}}, g.md.acked)

	g, _, err = ack(g, 0, 10)
	require.NoError(t, err)
	require.Equal(t, int64(14), g.committed, "past 10 and the span behind it")
	require.Empty(t, g.md.acked)
	require.Empty(t, g.md.counts)
	require.Equal(t, int64(14), g.md.taken)
	require.Equal(t, "onceflow taken 14", g.md.encode())

	_, changed, err = ack(g, 0, 12)
	require.NoError(t, err)
	require.False(t, changed, "a record below the committed offset is acked already")
}

// A group that has committed nothing starts at the log's start, and so does one whose
// committed records the log no longer has.
func TestAck_WithoutACommitStartsAtTheLogStart(t *testing.T) {
	t.Parallel()
	for _, committed := range []int64{-1, 3} {
		g, changed, err := ack(groupOffset{committed: committed}, 5, 5)
		require.NoError(t, err)
		require.True(t, changed)
		require.Equal(t, int64(6), g.committed)
		require.Equal(t, "onceflow taken 6", g.md.encode())

		g, _, err = ack(groupOffset{committed: committed}, 5, 7)
		require.NoError(t, err)
		require.Equal(t, int64(5), g.committed)
		require.Equal(t, "onceflow taken 5 acked 7-7", g.md.encode())
	}
}

// A record taken out of a group whose offsets another client committed leaves the record at
// the committed offset counted as handed out once, as a member would count it; under
// onceflow's own metadata the taken offset says what was handed out.
func TestAck_KeepsTheHandOutOfTheRecordAtAForeignCommittedOffset(t *testing.T) {
	t.Parallel()
	g, _, err := ack(groupOffset{committed: 10}, 0, 12)
	require.NoError(t, err)
	require.Equal(t, "onceflow taken 11 acked 12-12", g.md.encode())

	g, _, err = ack(groupOffset{committed: 10, described: true, md: groupMetadata{taken: 10}}, 0, 12)
	require.NoError(t, err)
	require.Equal(t, "onceflow taken 10 acked 12-12", g.md.encode())
}

// A commit carries at most maxSpans spans: a record that would need one more is refused, and
// the commit is left as it was.
func TestAck_RefusesMoreSpansThanACommitCarries(t *testing.T) {
	t.Parallel()
	var g groupOffset
	for i := range maxSpans {
		var err error
		g, _, err = ack(g, 0, int64(2*i+1))
		require.NoError(t, err)
	}
	require.Len(t, g.md.acked, maxSpans)
	_, _, err := ack(g, 0, int64(2*maxSpans+1))
	require.ErrorContains(t, err, "carries at most 64")
	next, _, err := ack(g, 0, 2)
	require.NoError(t, err, "a record that joins two spans needs none more")
	require.Len(t, next.md.acked, maxSpans-1)
}
