// Package textcol says whether a string can be stored in a text column of every dialect
// onceflow supports, for the packages that check a value before it reaches the database
// (dedup, ordering): PostgreSQL rejects invalid UTF-8 and NUL bytes and aborts the
// transaction, and MySQL outside strict mode truncates a value longer than its column.
package textcol

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Fault is why a value cannot be stored.
type Fault int

// The faults, in the order Check looks for them.
const (
	// OK: the value can be stored.
	OK Fault = iota
	// TooLong: the value has more characters than its column holds.
	TooLong
	// NotUTF8: the value is not valid UTF-8.
	NotUTF8
	// NUL: the value contains a NUL byte.
	NUL
)

// Check returns why v cannot be stored in a column of maxLen characters, OK when it can, and
// the number of characters of a value that is TooLong.
func Check(v string, maxLen int) (Fault, int) {
	if len(v) > maxLen { // bytes; only then can there be more than maxLen characters
		if n := utf8.RuneCountInString(v); n > maxLen {
			return TooLong, n
		}
	}
	if !utf8.ValidString(v) {
		return NotUTF8, 0
	}
	if strings.IndexByte(v, 0) >= 0 {
		return NUL, 0
	}
	return OK, 0
}

// Quote quotes v for an error message, cut to its first 40 bytes.
func Quote(v string) string {
	if len(v) > 40 {
		return fmt.Sprintf("%q...", v[:40])
	}
	return fmt.Sprintf("%q", v)
}
