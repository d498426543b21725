package main

import (
	"fmt"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// The text output of the dlq commands shows what messages carry (ids, reasons, handlers,
// topics, times, payloads), which any producer controls. printable is the one way that text
// reaches the terminal: an id with ESC [ 2 K must not erase the operator's line, a tab or a
// newline must not break the table, and a byte 0xff (text/tabwriter's escape character) must
// not swallow the columns after it. --json prints the values themselves, escaped as JSON.

// printable returns s with everything a terminal would not show as itself written as a Go
// escape: invalid UTF-8 bytes as \xff, control characters as \x1b, \n, \t, other non-printing
// runes (format characters such as U+202E, separators other than the space) as \u202e, and the
// backslash as \\, so that the escaped form is unambiguous.
func printable(s string) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || r == '\\' || !unicode.IsPrint(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\\':
			b.WriteString(`\\`)
		case unicode.IsPrint(r):
			b.WriteString(s[i : i+size])
		default:
			q := strconv.QuoteRune(r) // '\x1b', '\n', '\u202e'
			b.WriteString(q[1 : len(q)-1])
		}
		i += size
	}
	return b.String()
}

// quoted returns s printable between double quotes, with the quotes inside escaped.
func quoted(s string) string {
	return `"` + strings.ReplaceAll(printable(s), `"`, `\"`) + `"`
}

// cell makes s fit a table cell: printable, at most width characters before escaping (no bound
// for 0), "-" if empty.
func cell(s string, width int) string {
	if s == "" {
		return "-"
	}
	if width > 0 {
		s = truncate(s, width)
	}
	return printable(s)
}

// truncate cuts s to at most n characters (runes, and bytes that are not UTF-8, each counting
// as one), marking the cut. It keeps the bytes that are not UTF-8 as they are, for printable
// to show.
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	end := 0
	for range n - 1 {
		_, size := utf8.DecodeRuneInString(s[end:])
		end += size
	}
	return s[:end] + "…"
}

// quoteAll quotes each of ss.
func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = quoted(s)
	}
	return out
}

// plural returns n and noun, with an s unless n is 1 (es after s, x, ch and sh): "1 dead
// letter", "2 dead letters", "3 batches".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	for _, end := range []string{"s", "x", "ch", "sh"} {
		if strings.HasSuffix(noun, end) {
			return strconv.Itoa(n) + " " + noun + "es"
		}
	}
	return strconv.Itoa(n) + " " + noun + "s"
}

// count is n for a table cell, "-" when n is 0 (not counted).
func count(n int) string {
	if n == 0 {
		return "-"
	}
	return strconv.Itoa(n)
}
