package onceflow

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The canonical chains are one table in code (builtins, QoS.Chain); the docs and package
// comments that draw them must say the same, or a reader learns an order the router does not
// build.
func TestDocs_DrawTheChainsTheRouterBuilds(t *testing.T) {
	// A drawn chain: "Tracing -> Metrics -> ... -> Processor", in a doc comment or a code block.
	drawn := regexp.MustCompile(`(?m)^(?://)?\s*(Tracing(?: -> [A-Za-z]+)+ -> Processor)\s*$`)
	wordOf := map[string]StageName{
		"Tracing": StageTracing, "Metrics": StageMetrics, "DeadLetter": StageDeadLetter,
		"Recover": StageRecover, "Retry": StageRetry, "Timeout": StageTimeout,
		"Transaction": StageTransaction, "Deduplicate": StageDeduplicate, "InOrder": StageInOrder,
	}
	built := map[string]bool{}
	for _, q := range []QoS{BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder} {
		built[q.Chain().String()] = true
	}
	found := 0
	for _, file := range []string{"doc.go", "middleware/doc.go", "ordering/doc.go", "docs/concepts.md"} {
		text, err := os.ReadFile(file)
		require.NoError(t, err)
		for _, m := range drawn.FindAllStringSubmatch(string(text), -1) {
			found++
			words := strings.Split(m[1], " -> ")
			names := make([]string, 0, len(words)-1)
			for _, w := range words[:len(words)-1] {
				name, ok := wordOf[w]
				require.True(t, ok, "%s draws %q, which is no built-in stage: %s", file, w, m[1])
				names = append(names, string(name))
			}
			require.True(t, built[strings.Join(names, " -> ")], "%s draws a chain the router does not build: %s", file, m[1])
		}
	}
	require.GreaterOrEqual(t, found, 4, "the chains drawn in the docs were not found")

	// docs/concepts.md's table of the chains per quality of service.
	concepts, err := os.ReadFile("docs/concepts.md")
	require.NoError(t, err)
	for _, q := range []QoS{BestEffort, AtLeastOnce, ExactlyOnce, ExactlyOnceInOrder} {
		row := regexp.MustCompile("(?m)^\\| `" + q.String() + "` \\| (?:\\([^)]*\\) )?(`[a-z-]+`(?:, `[a-z-]+`)*) \\|$").FindStringSubmatch(string(concepts))
		require.NotNil(t, row, "docs/concepts.md has no chain row for %s", q)
		require.Equal(t, q.Chain().String(), strings.NewReplacer("`", "", ", ", " -> ").Replace(row[1]), "docs/concepts.md's row for %s", q)
	}
}
