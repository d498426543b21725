package docscheck

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// root is the repository's root, from this package's directory.
const root = "../.."

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, path))
	require.NoError(t, err)
	return string(b)
}

// section returns the part of the Markdown text md under the heading, up to the next heading
// of the same level.
func section(t *testing.T, md, heading string) string {
	t.Helper()
	_, rest, ok := strings.Cut(md, "\n"+heading+"\n")
	require.True(t, ok, "no heading %q", heading)
	if i := strings.Index(rest, "\n## "); i >= 0 {
		rest = rest[:i]
	}
	return rest
}

// The README's "In one screen" quotes examples/onescreen/main.go whole, which that example's
// test runs: the program a newcomer copies compiles and works.
func TestREADME_InOneScreenIsTheOnescreenExample(t *testing.T) {
	screen := section(t, read(t, "README.md"), "## In one screen")
	if !strings.Contains(screen, "```go\n"+read(t, "examples/onescreen/main.go")+"```\n") {
		t.Fatal("README.md's In one screen differs from examples/onescreen/main.go: copy the file into it")
	}
}

// The README's commands name files and targets that exist.
func TestREADME_CommandsNameWhatExists(t *testing.T) {
	readme := read(t, "README.md")
	for _, path := range []string{"cmd/onceflow", "examples/quickstart", "examples/onescreen", "examples/payments", "docker-compose.yml", "scripts/services.sh", "LICENSE"} {
		require.True(t, strings.Contains(readme, path), "README.md does not name %s", path)
		_, err := os.Stat(filepath.Join(root, path))
		require.NoError(t, err, "README.md names %s", path)
	}
	makefile := read(t, "Makefile")
	for _, target := range []string{"test", "up", "down", "services", "help"} {
		require.True(t, strings.Contains(readme, "make "+target), "README.md does not name make %s", target)
		require.Contains(t, makefile, "\n"+target+":", "README.md names make %s", target)
	}
}

// docs/testing.md quotes the quickstart's handler and its test whole, which make test runs: the
// test a user copies proves the handler it shows.
func TestTesting_QuotesTheQuickstartHandlerAndItsTest(t *testing.T) {
	doc := read(t, "docs/testing.md")
	for _, path := range []string{"examples/quickstart/ledger.go", "examples/quickstart/prove_test.go"} {
		if !strings.Contains(doc, "```go\n"+read(t, path)+"```\n") {
			t.Fatalf("docs/testing.md differs from %s: copy the file into it", path)
		}
	}
}
