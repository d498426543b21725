package broker

import (
	"os"
	"regexp"
	"testing"
)

// The package documentation's table says of each scheme whether Peek, Move and Delete work,
// as schemes says (and Open checks against the scheme's Backend.View).
func TestDoc_ListsWhichSchemesCanBeInspectedAsSchemesSays(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range schemes {
		want := "no"
		if s.inspect {
			want = "yes"
		}
		if !regexp.MustCompile(`(?m)^//\t` + s.name + ` +` + want + ` `).Match(doc) {
			t.Errorf("doc.go's table of schemes has no row %q with %q under Peek, Move, Delete", s.name, want)
		}
	}
}
