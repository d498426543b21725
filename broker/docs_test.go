package broker_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
)

// codeSpans returns the `code` spans of a Markdown text, in order.
func codeSpans(s string) []string {
	var out []string
	for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(s, -1) {
		out = append(out, m[1])
	}
	return out
}

// tableAfter returns the cells of the rows of the first Markdown table after the line that
// starts with marker in md, the header and the separator left out.
func tableAfter(t *testing.T, md, marker string) [][]string {
	t.Helper()
	i := strings.Index(md, "\n"+marker)
	require.GreaterOrEqual(t, i, 0, "docs/brokers.md has no line starting with %q", marker)
	var rows [][]string
	inTable := false
	for line := range strings.SplitSeq(md[i+1:], "\n") {
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for j := range cells {
			cells[j] = strings.TrimSpace(cells[j])
		}
		rows = append(rows, cells)
	}
	require.Greater(t, len(rows), 2, "no table after %q", marker)
	return rows[2:]
}

// docs/brokers.md lists the query parameters of every scheme, and of each scheme, as the
// scheme packages register them: the tables Open checks URLs against.
func TestDocs_QueryParametersAreTheRegisteredOnes(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../docs/brokers.md")
	require.NoError(t, err)
	md := string(b)

	var common []string
	for _, row := range tableAfter(t, md, "| query parameter | `Options` field |") {
		common = append(common, codeSpans(row[0])...)
	}
	require.Equal(t, broker.CommonParams, common, "docs/brokers.md, Options and query parameters")

	seen := map[string]bool{}
	for _, row := range tableAfter(t, md, "| scheme | the scheme's own | its client's |") {
		require.Len(t, row, 3, "%v", row)
		for _, scheme := range codeSpans(row[0]) {
			p, ok := broker.RegisteredParams(scheme)
			require.True(t, ok, "docs/brokers.md lists the scheme %s", scheme)
			require.False(t, seen[scheme], "docs/brokers.md lists the scheme %s twice", scheme)
			seen[scheme] = true
			require.Equal(t, p.Own, codeSpans(row[1]), "the parameters of the %s scheme", scheme)
			require.Equal(t, p.Database, strings.Contains(row[2], "`sqldb.Open`"), "whether %s takes a database URL", scheme)
			if p.Database {
				continue
			}
			client := codeSpans(row[2])
			require.Equal(t, p.Client, client, "the client parameters of the %s scheme", scheme)
			if len(client) > 0 {
				require.True(t, strings.HasPrefix(row[2], p.ClientName+": "), "%s's client is %s", scheme, p.ClientName)
			}
		}
	}
	for _, scheme := range broker.CanonicalSchemes() {
		require.True(t, seen[scheme], "docs/brokers.md does not list the parameters of %s", scheme)
	}
}
