package broker

import (
	"os"
	"strings"
	"testing"
	"text/tabwriter"
)

// capabilities renders the table of what each scheme does from schemes, as doc.go shows it.
func capabilities() string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	_, _ = w.Write([]byte("scheme\tPeek, Move, Delete\tnack delay\tdelivery count\ta key's order\n"))
	for _, s := range schemes {
		inspect := "no"
		if s.inspect {
			inspect = "yes"
		}
		_, _ = w.Write([]byte(s.name + "\t" + inspect + "\t" + s.nackDelay + "\t" + s.count + "\t" + s.order + "\n"))
	}
	_ = w.Flush()
	var out strings.Builder
	for line := range strings.SplitSeq(strings.TrimSuffix(b.String(), "\n"), "\n") {
		out.WriteString("//\t" + strings.TrimRight(line, " ") + "\n")
	}
	return out.String()
}

// The package documentation lists what each scheme does as the table schemes says.
func TestDoc_ListsWhatEachSchemeDoesAsSchemesSays(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	if want := capabilities(); !strings.Contains(string(doc), "//\n"+want+"//\n") {
		t.Fatalf("doc.go does not list what each scheme does as schemes says; want the block\n%s", want)
	}
}
