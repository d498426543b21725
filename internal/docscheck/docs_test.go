package docscheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// page is a Markdown page of the docs: its path from the root and its text.
type page struct {
	path, text string
}

// pages returns the README and every page under docs/.
func pages(t *testing.T) []page {
	t.Helper()
	out := []page{{"README.md", read(t, "README.md")}}
	names, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	for _, name := range names {
		rel, err := filepath.Rel(root, name)
		require.NoError(t, err)
		out = append(out, page{filepath.ToSlash(rel), read(t, rel)})
	}
	require.Greater(t, len(out), 5, "the docs were not found")
	return out
}

// block is a fenced code block of a page.
type block struct {
	lang  string
	line  int // of the opening fence, from 1
	lines []string
}

// blocks returns the fenced code blocks of md.
func blocks(md string) []block {
	var out []block
	var cur *block
	for i, line := range strings.Split(md, "\n") {
		switch {
		case cur == nil && strings.HasPrefix(line, "```"):
			cur = &block{lang: strings.TrimPrefix(line, "```"), line: i + 1}
		case cur != nil && line == "```":
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.lines = append(cur.lines, line)
		}
	}
	return out
}

// goSources returns the lines of every Go file of the repository that `go vet` compiles: not
// under testdata, not excluded by a build constraint.
func goSources(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && path != root) {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if strings.Contains(string(b), "//go:build ignore") {
			return nil
		}
		rel, _ := filepath.Rel(root, path)
		out[filepath.ToSlash(rel)] = strings.Split(string(b), "\n")
		return nil
	})
	require.NoError(t, err)
	return out
}

// excerptOf reports whether snippet is a run of consecutive lines of file, each written with
// one common indentation added (a snippet may show the body of a function at its own level).
func excerptOf(snippet, file []string) bool {
	for start := 0; start+len(snippet) <= len(file); start++ {
		if matchesAt(snippet, file[start:start+len(snippet)]) {
			return true
		}
	}
	return false
}

func matchesAt(snippet, lines []string) bool {
	indent, known := "", false
	for i, s := range snippet {
		l := lines[i]
		if strings.TrimSpace(s) == "" {
			if strings.TrimSpace(l) != "" {
				return false
			}
			continue
		}
		if !known {
			if !strings.HasSuffix(l, s) {
				return false
			}
			indent, known = strings.TrimSuffix(l, s), true
			if strings.Trim(indent, "\t") != "" {
				return false
			}
		}
		if l != indent+s {
			return false
		}
	}
	return known
}

// importPath is a quoted import path of a Go line.
var importPath = regexp.MustCompile(`^\s*(?:import\s+)?(?:[_.A-Za-z]\w*\s+)?"([^"]+)"\s*(?://.*)?$`)

// imports returns the paths of a Go block that holds nothing but imports, and whether it does.
func imports(lines []string) ([]string, bool) {
	var paths []string
	for _, l := range lines {
		trimmed := strings.TrimSpace(l)
		switch {
		case trimmed == "" || trimmed == "import (" || trimmed == ")" || strings.HasPrefix(trimmed, "//"):
		case importPath.MatchString(l):
			paths = append(paths, importPath.FindStringSubmatch(l)[1])
		default:
			return nil, false
		}
	}
	return paths, len(paths) > 0
}

// Every Go block of the README and the docs is an excerpt of a Go file that `make test` compiles
// (an example, a runnable Example, a test), so that the code a reader copies compiles with the
// API of today: a renamed field breaks the build of the file it was taken from, and the page
// that shows it must be changed with the file. A block of imports alone names packages of
// onceflow that exist.
func TestDocs_GoBlocksAreExcerptsOfCompiledCode(t *testing.T) {
	sources := goSources(t)
	files := make([]string, 0, len(sources))
	for f := range sources {
		files = append(files, f)
	}
	slices.Sort(files)
	checked := 0
	for _, p := range pages(t) {
		for _, b := range blocks(p.text) {
			if b.lang != "go" {
				continue
			}
			checked++
			if paths, ok := imports(b.lines); ok {
				for _, path := range paths {
					rel, ours := strings.CutPrefix(path, "github.com/onceflow/onceflow/")
					if !ours {
						continue
					}
					dir := filepath.Join(root, rel)
					if names, _ := filepath.Glob(filepath.Join(dir, "*.go")); len(names) == 0 {
						t.Errorf("%s:%d: imports %s, which is no package of onceflow", p.path, b.line, path)
					}
				}
				continue
			}
			found := slices.ContainsFunc(files, func(f string) bool { return excerptOf(b.lines, sources[f]) })
			if !found {
				t.Errorf("%s:%d: the Go block is no excerpt of a compiled Go file: copy it from one (an example, a runnable Example), or write it there first", p.path, b.line)
			}
		}
	}
	require.Positive(t, checked)
}

// link is a relative link of a page.
var link = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// anchors returns the anchors of md's headings, as GitHub makes them.
func anchors(md string) map[string]bool {
	out := map[string]bool{}
	inCode := false
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
		}
		if inCode || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimLeft(line, "#")
		if !strings.HasPrefix(h, " ") {
			continue
		}
		out[slug(strings.TrimSpace(h))] = true
	}
	return out
}

// slug is GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
// as '-'.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r > 127 && r != '—' && r != '×':
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Every relative link of the README and the docs names a file of the repository, and every
// #anchor a heading of its page: a page that moves a section leaves no dead link behind.
func TestDocs_RelativeLinksResolve(t *testing.T) {
	for _, p := range pages(t) {
		for _, m := range link.FindAllStringSubmatch(p.text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			text := p.text
			if file != "" {
				path := filepath.Join(filepath.Dir(p.path), file)
				b, err := os.ReadFile(filepath.Join(root, path))
				if err != nil {
					if _, serr := os.Stat(filepath.Join(root, path)); serr == nil {
						continue // a directory
					}
					t.Errorf("%s: link %s: no file %s", p.path, target, path)
					continue
				}
				text = string(b)
				if !strings.HasSuffix(file, ".md") {
					continue
				}
			}
			if anchor != "" && !anchors(text)[anchor] {
				t.Errorf("%s: link %s: no heading with the anchor #%s", p.path, target, anchor)
			}
		}
	}
}
