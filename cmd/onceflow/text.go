package main

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// cell makes s fit a table cell: one line, at most width runes (no bound for 0), "-" if empty.
func cell(s string, width int) string {
	if s == "" {
		return "-"
	}
	s = strings.Join(strings.Fields(s), " ")
	if width > 0 {
		s = truncate(s, width)
	}
	return s
}

// truncate cuts s to at most n runes, marking the cut.
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}

func quoteAll(ss []string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = strconv.Quote(s)
	}
	return out
}
