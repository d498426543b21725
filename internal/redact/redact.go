// Package redact hides the passwords and tokens of connection strings: it is the one place
// that knows where a secret sits in each form an operator may write, so that package sqldb
// (database URLs) and package broker (broker URLs) hide the same secrets the same way.
//
// The forms:
//
//   - a URL, scheme://user:password@host/path?query: the password of the user information,
//     the query parameters password, sslpassword and token, and on nats:// the user name
//     alone (nats://token@host is a token);
//   - a libpq keyword/value string, host=db user=app password=secret dbname=orders, with
//     single-quoted values ('a b', 'it\'s') and backslash escapes: the values of password,
//     sslpassword and token, and a URL or keyword string given as dbname;
//   - a go-sql-driver DSN without a scheme, user:password@tcp(host:3306)/db: the password, which
//     the driver reads as everything between the first ':' and the last '@' before the last
//     '/' (it may contain ':', '@' and '/').
//
// A URL whose password may have spilled out of the user information, and a string that does
// not parse, are reduced to what is certainly not secret.
package redact

import (
	"net/url"
	"strings"
)

// Mask replaces a secret.
const Mask = "xxxxx"

// Form is the shape of a connection string.
type Form int

// The forms FormOf tells apart.
const (
	// URL is scheme:..., and anything that is not one of the other forms (a file path, a
	// host:port).
	URL Form = iota
	// Keywords is a libpq keyword/value string: key=value pairs separated by spaces.
	Keywords
	// DSN is a go-sql-driver DSN without a scheme: [user[:password]@][net[(addr)]]/dbname.
	DSN
)

// String names the form as an error message would.
func (f Form) String() string {
	switch f {
	case Keywords:
		return "libpq keyword/value string"
	case DSN:
		return "go-sql-driver DSN"
	default:
		return "URL"
	}
}

// secretKeys are the query parameters and keywords whose values are secrets, in lower case.
var secretKeys = map[string]bool{"password": true, "sslpassword": true, "token": true}

func isSecretKey(k string) bool { return secretKeys[strings.ToLower(k)] }

// FormOf returns the form of s: Keywords when it starts with key=, URL when it starts with
// scheme:// or sqlite:, DSN when it has an '@' otherwise (user:password@... without a scheme),
// URL for everything else.
func FormOf(s string) Form {
	t := strings.TrimLeft(s, " \t\n\r\f\v")
	name := 0
	for name < len(t) && isKeywordByte(t[name]) {
		name++
	}
	if name > 0 && strings.HasPrefix(strings.TrimLeft(t[name:], " \t\n\r\f\v"), "=") {
		return Keywords
	}
	if scheme, rest, ok := strings.Cut(s, ":"); ok && ValidScheme(scheme) {
		// sqlite:path is the one URL without "//" that onceflow reads, and a file name may
		// have an '@'.
		if strings.HasPrefix(rest, "//") || strings.EqualFold(scheme, "sqlite") || strings.EqualFold(scheme, "sqlite3") {
			return URL
		}
	}
	if strings.Contains(s, "@") {
		return DSN
	}
	return URL
}

func isKeywordByte(c byte) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// ValidScheme reports whether s is a URL scheme: a letter, then letters, digits, '+', '-' or
// '.'.
func ValidScheme(s string) bool {
	if s == "" {
		return false
	}
	for i, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
		case i > 0 && (c >= '0' && c <= '9' || c == '+' || c == '-' || c == '.'):
		default:
			return false
		}
	}
	return true
}

// String returns s with every password and token replaced by Mask, whatever its form.
func String(s string) string {
	switch FormOf(s) {
	case Keywords:
		return keywords(s)
	case DSN:
		return dsn(s)
	default:
		return urlString(s)
	}
}

// Secrets returns the passwords and tokens of s in every form a driver or a server may echo
// them: as written, decoded, and query- or path-escaped. Error removes them from an error.
func Secrets(s string) []string {
	var out []string
	add := func(v string) {
		if v == "" {
			return
		}
		out = append(out, v, url.QueryEscape(v), url.PathEscape(v))
	}
	switch FormOf(s) {
	case Keywords:
		pairs, rest := parseKeywords(s)
		for _, p := range pairs {
			switch {
			case isSecretKey(p.key):
				add(p.value)
				add(s[p.start:p.end])
			case p.key == "dbname" && expands(p.value):
				for _, v := range Secrets(p.value) {
					add(v)
				}
			}
		}
		// What follows a syntax error may be a password the string meant to give.
		add(strings.TrimSpace(s[rest:]))
	case DSN:
		if from, to, ok := dsnPassword(s); ok {
			add(s[from:to])
		}
	default:
		for _, p := range urlPasswords(s) {
			add(p)
		}
	}
	return out
}

// scrubbed is an error whose text has had secrets removed.
type scrubbed struct {
	msg string
	err error
}

func (e *scrubbed) Error() string { return e.msg }
func (e *scrubbed) Unwrap() error { return e.err }

// Error returns err with every one of secrets in its text replaced by Mask; errors.Is and
// errors.As see through it to err. Drivers sometimes echo the URL or the credentials they
// were given. A nil err, or one that contains no secret, is returned as it is.
func Error(err error, secrets []string) error {
	if err == nil || len(secrets) == 0 {
		return err
	}
	msg := err.Error()
	changed := false
	for _, s := range secrets {
		if s != "" && strings.Contains(msg, s) {
			msg = strings.ReplaceAll(msg, s, Mask)
			changed = true
		}
	}
	if !changed {
		return err
	}
	return &scrubbed{msg: msg, err: err}
}

// StrayAt reports whether the URL rawURL has an '@' after its authority (its host part). That
// happens when a '/', '?' or '#' in a password is not percent-encoded: the authority then ends
// inside the password, and the rest of the password lands in the path, query or fragment,
// where neither url.URL.Redacted nor the drivers' messages hide it. String reduces such a URL
// to its scheme; Open refuses it.
func StrayAt(rawURL string) bool {
	_, rest, ok := strings.Cut(rawURL, ":")
	if !ok {
		return false
	}
	if r, ok := strings.CutPrefix(rest, "//"); ok {
		end := strings.IndexAny(r, "/?#")
		return end >= 0 && strings.Contains(r[end:], "@")
	}
	return strings.Contains(rest, "@")
}

// urlString redacts a URL.
func urlString(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil || StrayAt(rawURL) {
		return malformed(rawURL)
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		// url.Values drops the pairs it cannot decode, which may be a password: mask the
		// query as written.
		u.RawQuery = maskRawQuery(u.RawQuery)
		q = nil
	}
	masked := false
	for k := range q {
		if isSecretKey(k) {
			q[k] = []string{Mask}
			masked = true
		}
	}
	if masked {
		u.RawQuery = q.Encode()
	}
	if u.User != nil && strings.EqualFold(u.Scheme, "nats") {
		if _, hasPassword := u.User.Password(); !hasPassword {
			u.User = url.User(Mask) // nats://token@host
		}
	}
	return u.Redacted()
}

// maskRawQuery masks the values of the secret parameters of a query that does not decode,
// keeping the rest as written. It splits at '&' and at ';', which url.ParseQuery refuses.
func maskRawQuery(raw string) string {
	var b strings.Builder
	for raw != "" {
		end := strings.IndexAny(raw, "&;")
		part, sep := raw, ""
		if end >= 0 {
			part, sep, raw = raw[:end], raw[end:end+1], raw[end+1:]
		} else {
			raw = ""
		}
		if k, _, ok := strings.Cut(part, "="); ok {
			key, err := url.QueryUnescape(k)
			if err != nil {
				key = k
			}
			if isSecretKey(key) {
				part = k + "=" + Mask
			}
		}
		b.WriteString(part)
		b.WriteString(sep)
	}
	return b.String()
}

// malformed reduces rawURL to its scheme, when it has a plausible one.
func malformed(rawURL string) string {
	scheme, _, ok := strings.Cut(rawURL, ":")
	if !ok || !ValidScheme(scheme) {
		return "(malformed URL)"
	}
	return scheme + "://(malformed URL)"
}

// urlPasswords returns the passwords and tokens of a URL, decoded and as written. It reads
// what it can of a URL that does not parse.
func urlPasswords(rawURL string) []string {
	var out []string
	scheme, _, _ := strings.Cut(rawURL, ":")
	if u, err := url.Parse(rawURL); err == nil && u.User != nil {
		if p, ok := u.User.Password(); ok {
			out = append(out, p)
		} else if strings.EqualFold(scheme, "nats") {
			out = append(out, u.User.Username())
		}
	}
	// The password as written, percent-encoding and all; when the authority has a stray '@',
	// also everything up to the last '@'.
	if _, rest, ok := strings.Cut(rawURL, "//"); ok {
		authority := rest
		if end := strings.IndexAny(rest, "/?#"); end >= 0 {
			authority = rest[:end]
		}
		for _, a := range []string{authority, rest} {
			at := strings.LastIndexByte(a, '@')
			if at < 0 {
				continue
			}
			if _, p, ok := strings.Cut(a[:at], ":"); ok {
				out = append(out, p)
			} else if strings.EqualFold(scheme, "nats") {
				out = append(out, a[:at])
			}
		}
	}
	if _, query, ok := strings.Cut(rawURL, "?"); ok {
		q, _ := url.ParseQuery(query) // what parses, even if the rest does not
		for k, vs := range q {
			if isSecretKey(k) {
				out = append(out, vs...)
			}
		}
		for _, kv := range strings.FieldsFunc(query, func(r rune) bool { return r == '&' || r == ';' }) {
			if k, v, ok := strings.Cut(kv, "="); ok && isSecretKey(k) {
				out = append(out, v)
			}
		}
	}
	return out
}
