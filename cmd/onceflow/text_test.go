package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPrintable_EscapesWhatATerminalWouldInterpret(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"order-17":             "order-17",
		"grüße, 注文 ✓":          "grüße, 注文 ✓",
		"a b":                  "a b",
		"\x1b[2Kgone":          `\x1b[2Kgone`,
		"\x1b]0;title\x07":     `\x1b]0;title\a`,
		"bad\xff\xfe-2":        `bad\xff\xfe-2`,
		"tab\tnew\nline\rcr":   `tab\tnew\nline\rcr`,
		"del\x7f":              `del\x7f`,
		"c1\u009b31m":          `c1\u009b31m`,
		"rtl\u202eoverride":    `rtl\u202eoverride`,
		"nbsp\u00a0zwsp\u200b": `nbsp\u00a0zwsp\u200b`,
		`back\slash`:           `back\\slash`,
		`\x1b`:                 `\\x1b`, // the four characters, not the escape
		"\uFFFD valid":         "\uFFFD valid",
		"\xe2\x82":             `\xe2\x82`, // a truncated rune
		"":                     "",
	} {
		require.Equal(t, want, printable(in), "printable(%q)", in)
	}
}

func TestCell_TruncatesBeforeEscapingAndKeepsInvalidBytes(t *testing.T) {
	t.Parallel()
	require.Equal(t, "-", cell("", 10))
	require.Equal(t, `ab\xffc…`, cell("ab\xffcdef", 5))
	require.Equal(t, `\x1b[2K`, cell("\x1b[2K", 10))
	require.Equal(t, `"say \"hi\"\n"`, quoted("say \"hi\"\n"))
}

func TestPlural(t *testing.T) {
	for n, want := range map[int]string{0: "0 dead letters", 1: "1 dead letter", 2: "2 dead letters"} {
		require.Equal(t, want, plural(n, "dead letter"))
	}
	require.Equal(t, "1 batch", plural(1, "batch"))
	require.Equal(t, "3 batches", plural(3, "batch"))
}
