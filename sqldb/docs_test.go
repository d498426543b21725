package sqldb_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
)

// docs/configuration.md lists the query parameters of each dialect's driver as the driver
// packages register them: the tables sqldb.Open checks URLs against.
func TestDocs_DriverParametersAreTheRegisteredOnes(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../docs/configuration.md")
	require.NoError(t, err)
	md := string(b)
	i := strings.Index(md, "\n| database | the driver's parameters")
	require.GreaterOrEqual(t, i, 0, "docs/configuration.md has no table of the drivers' parameters")
	dialects := map[string]sqldb.Dialect{"PostgreSQL": sqldb.Postgres, "MySQL / MariaDB": sqldb.MySQL, "SQLite": sqldb.SQLite}
	seen := 0
	for _, line := range strings.Split(md[i+1:], "\n")[2:] {
		if !strings.HasPrefix(line, "|") {
			break
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		d, ok := dialects[strings.TrimSpace(cells[0])]
		require.True(t, ok, "unknown database %q", cells[0])
		params, others, ok := sqldb.RegisteredParams(d)
		require.True(t, ok, "no driver registered for %s", d)
		var documented []string
		for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(cells[1], -1) {
			documented = append(documented, m[1])
		}
		require.Equal(t, params, documented, "the parameters of %s", d)
		require.Equal(t, others == "", strings.TrimSpace(cells[2]) == "refused", "what %s makes of other parameters", d)
		seen++
	}
	require.Equal(t, len(dialects), seen)
}
