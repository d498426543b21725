package onceflow_test

import (
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
)

// documentedFields returns the fields that the rows of the table under heading in
// docs/configuration.md name in their first cell, in the order of the rows.
func documentedFields(t *testing.T, md, heading string) []string {
	t.Helper()
	_, rest, ok := strings.Cut(md, "\n"+heading+"\n")
	require.True(t, ok, "docs/configuration.md has no heading %q", heading)
	var fields []string
	for _, line := range strings.Split(rest, "\n") {
		if strings.HasPrefix(line, "#") {
			break
		}
		first, _, ok := strings.Cut(strings.TrimPrefix(line, "| "), " |")
		if !ok || !strings.HasPrefix(line, "| `") {
			continue
		}
		for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(first, -1) {
			fields = append(fields, m[1])
		}
	}
	return fields
}

// fieldPaths returns the exported fields of typ, by name; those of a configuration struct of
// onceflow's own (a stage's) are given by their path, as Retry.MaxAttempts.
func fieldPaths(typ reflect.Type) []string {
	var out []string
	for f := range typ.Fields() {
		if !f.IsExported() {
			continue
		}
		sub := []string(nil)
		if f.Type.Kind() == reflect.Struct && strings.HasPrefix(f.Type.PkgPath(), "github.com/onceflow/onceflow") {
			sub = fieldPaths(f.Type)
		}
		if len(sub) == 0 {
			out = append(out, f.Name)
		}
		for _, s := range sub {
			out = append(out, f.Name+"."+s)
		}
	}
	return out
}

// docs/configuration.md has a row for every field of Config and Handler, and for no field that
// does not exist: a field added or renamed in code is added or renamed there.
func TestDocs_ConfigurationListsEveryField(t *testing.T) {
	b, err := os.ReadFile("docs/configuration.md")
	require.NoError(t, err)
	md := string(b)
	for heading, typ := range map[string]reflect.Type{
		"## onceflow.Config (the router)": reflect.TypeFor[onceflow.Config](),
		"## onceflow.Handler":             reflect.TypeFor[onceflow.Handler](),
	} {
		documented := documentedFields(t, md, heading)
		fields := fieldPaths(typ)
		for _, f := range fields {
			require.True(t, slices.Contains(documented, f), "docs/configuration.md, %s: no row for %s", heading, f)
		}
		for _, d := range documented {
			require.True(t, slices.Contains(fields, d), "docs/configuration.md, %s: a row for %s, which %s does not have", heading, d, typ)
		}
	}
}
