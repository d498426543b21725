package redact

import (
	"strings"
)

// This file redacts the two forms that are not URLs: a go-sql-driver DSN
// (user:password@tcp(host)/db) and a libpq keyword/value string (host=... password=...).

// dsnPassword returns where the password of a go-sql-driver DSN is, as the driver's ParseDSN
// finds it: the database name follows the last '/', the user information precedes the last
// '@' before it, and the password follows the first ':' of the user information.
func dsnPassword(s string) (from, to int, ok bool) {
	end := strings.LastIndexByte(s, '/')
	if end < 0 {
		end = len(s)
	}
	at := strings.LastIndexByte(s[:end], '@')
	if at < 0 {
		return 0, 0, false
	}
	colon := strings.IndexByte(s[:at], ':')
	if colon < 0 {
		return 0, 0, false
	}
	return colon + 1, at, true
}

// dsn redacts a go-sql-driver DSN.
func dsn(s string) string {
	from, to, ok := dsnPassword(s)
	if !ok {
		return s
	}
	return s[:from] + Mask + s[to:]
}

// keyword is one key=value pair of a libpq keyword/value string.
type keyword struct {
	key string
	// value is the value decoded: without its quotes and backslash escapes.
	value string
	// start and end delimit the value as written, quotes included.
	start, end int
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}

// parseKeywords reads a libpq keyword/value string as libpq's conninfo_parse does: pairs
// key = value separated by white space, a value either single-quoted (with \' and \\) or
// running to the next white space (with backslash escapes). It returns the pairs it read and
// where it stopped: len(s), or the start of what does not parse (a key without '=', an
// unterminated quote).
func parseKeywords(s string) ([]keyword, int) {
	var out []keyword
	i := 0
	skip := func() {
		for i < len(s) && isSpace(s[i]) {
			i++
		}
	}
	for {
		skip()
		if i == len(s) {
			return out, i
		}
		pairStart := i
		for i < len(s) && !isSpace(s[i]) && s[i] != '=' {
			i++
		}
		key := s[pairStart:i]
		skip()
		if i == len(s) || s[i] != '=' || key == "" {
			return out, pairStart
		}
		i++
		skip()
		kw := keyword{key: key, start: i}
		var value strings.Builder
		if i < len(s) && s[i] == '\'' {
			i++
			closed := false
			for i < len(s) {
				c := s[i]
				if c == '\\' && i+1 < len(s) {
					value.WriteByte(s[i+1])
					i += 2
					continue
				}
				i++
				if c == '\'' {
					closed = true
					break
				}
				value.WriteByte(c)
			}
			if !closed {
				return out, pairStart
			}
		} else {
			for i < len(s) && !isSpace(s[i]) {
				if s[i] == '\\' && i+1 < len(s) {
					value.WriteByte(s[i+1])
					i += 2
					continue
				}
				value.WriteByte(s[i])
				i++
			}
		}
		kw.value, kw.end = value.String(), i
		out = append(out, kw)
	}
}

// keywords redacts a libpq keyword/value string. What follows a syntax error is dropped: it
// may hold a password.
func keywords(s string) string {
	pairs, rest := parseKeywords(s)
	var b strings.Builder
	last := 0
	for _, p := range pairs {
		var with string
		switch {
		case isSecretKey(p.key):
			with = Mask
		case p.key == "dbname" && expands(p.value) && String(p.value) != p.value:
			with = quoteKeyword(String(p.value))
		default:
			continue
		}
		b.WriteString(s[last:p.start])
		b.WriteString(with)
		last = p.end
	}
	b.WriteString(s[last:rest])
	if rest < len(s) {
		b.WriteString("(malformed)")
	}
	return b.String()
}

// expands reports whether libpq reads the dbname value v as a connection string of its own:
// one with an '=', or a postgres:// or postgresql:// URL.
func expands(v string) bool {
	return strings.Contains(v, "=") || strings.HasPrefix(v, "postgres://") || strings.HasPrefix(v, "postgresql://")
}

// quoteKeyword quotes v as a libpq keyword value.
func quoteKeyword(v string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}
