package kafka

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMetadata_RoundTrips(t *testing.T) {
	for _, md := range []groupMetadata{
		{taken: 0},
		{taken: 12},
		{taken: 40, acked: []span{{3, 3}, {5, 9}, {20, 39}}},
		{taken: 40, counts: map[int64]int{2: 3, 4: 2}},
		{taken: 40, acked: []span{{5, 9}}, counts: map[int64]int{2: 3}},
	} {
		got, ok := parseMetadata(md.encode())
		require.True(t, ok)
		require.Equal(t, md, got)
	}
	require.Equal(t, "onceflow taken 40 acked 3-3,5-9 counts 2:4,10:2", groupMetadata{taken: 40, acked: []span{{3, 3}, {5, 9}}, counts: map[int64]int{10: 2, 2: 4}}.encode())

	many := groupMetadata{taken: 1000}
	for i := range int64(100) {
		many.acked = append(many.acked, span{i * 3, i*3 + 1})
	}
	got, ok := parseMetadata(many.encode())
	require.True(t, ok)
	require.Len(t, got.acked, maxSpans)
	require.Less(t, len(many.encode()), 4096)

	for _, s := range []string{"", "member-1", "onceflow taken x"} {
		_, ok := parseMetadata(s)
		require.False(t, ok, s)
	}
	got, ok = parseMetadata("onceflow taken 7 acked 9-3")
	require.True(t, ok)
	require.Equal(t, groupMetadata{taken: 7}, got)
	require.True(t, contains([]span{{3, 5}}, 4))
	require.False(t, contains([]span{{3, 5}}, 6))
}
