package sqldb

import (
	"fmt"
	"regexp"
	"strings"
)

var identPattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// ValidIdentifier reports whether name may be used as a table or schema name: a letter or
// underscore followed by at most 62 letters, digits or underscores. Names from configuration
// must pass it before they become SQL text.
func ValidIdentifier(name string) bool { return identPattern.MatchString(name) }

// CheckIdentifier returns an error naming field when name is not a valid identifier.
func CheckIdentifier(field, name string) error {
	if !ValidIdentifier(name) {
		return fmt.Errorf("%s: %q is not a plain SQL identifier (letters, digits and underscores, starting with a letter or underscore, at most 63 characters)", field, name)
	}
	return nil
}

// Quote returns name quoted as an identifier for the dialect: in backticks for MySQL, in
// double quotes for PostgreSQL and SQLite. Names from configuration must pass CheckIdentifier
// first; as a second line of defence, Quote doubles any quote character in name, so that the
// result is always exactly one identifier and never ends the quoting early.
func (d Dialect) Quote(name string) string {
	q := `"`
	if d == MySQL {
		q = "`"
	}
	return q + strings.ReplaceAll(name, q, q+q) + q
}
