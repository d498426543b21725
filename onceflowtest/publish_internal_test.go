package onceflowtest

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every message is published once, out of order but within its window, and each second copy
// after its first.
func TestPublishOrder_EveryMessageOnceAndEachCopyAfterItsFirst(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 100
	dups := []int{0, 17, 99}
	order := publishOrder(n, dups, rng)
	require.Len(t, order, n+len(dups))
	first := map[int]int{}
	for pos, i := range order {
		if _, seen := first[i]; seen {
			require.Contains(t, dups, i, "only the duplicates come twice")
			require.Greater(t, pos, first[i], "message %d: its copy after it", i)
			continue
		}
		first[i] = pos
	}
	require.Len(t, first, n)
	require.False(t, slices.IsSorted(order), "shuffled")
	for i, pos := range first {
		// The copies inserted before its window move it later, never across windows backwards.
		require.GreaterOrEqual(t, pos, i/reorderWindow*reorderWindow, "message %d", i)
	}
}

func TestRunPattern_SelectsTheTestAndNoOther(t *testing.T) {
	require.Equal(t, `^TestLedger$`, runPattern("TestLedger"))
	require.Equal(t, `^TestLedger$/^on_rabbit\(mq\)$`, runPattern("TestLedger/on_rabbit(mq)"))
}

func TestParseLine_ReadsWhatAConsumerWrites(t *testing.T) {
	var out lineBuffer
	c := &control{w: &out}
	c.send(lineReceived, "id with spaces")
	c.send(lineCrash+" "+string(BeforeCommit), "order-7")
	c.send(lineReady, "")
	want := [][3]string{{lineReceived, "", "id with spaces"}, {lineCrash, string(BeforeCommit), "order-7"}, {lineReady, "", ""}}
	for i, line := range out.lines() {
		ev, kind, id, ok := parseLine(line)
		require.True(t, ok, line)
		require.Equal(t, want[i], [3]string{ev, kind, id})
	}
}

// lineBuffer keeps what is written to it.
type lineBuffer struct{ b []byte }

func (l *lineBuffer) Write(p []byte) (int, error) { l.b = append(l.b, p...); return len(p), nil }

func (l *lineBuffer) lines() []string {
	var out []string
	start := 0
	for i, c := range l.b {
		if c == '\n' {
			out = append(out, string(l.b[start:i]))
			start = i + 1
		}
	}
	return out
}
