package broker

import (
	"cmp"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/redact"
	"github.com/onceflow/onceflow/internal/urlparam"
)

// Query parameters that every scheme understands. They override the Options given to Open and
// are removed from the URL before it reaches the driver; every other parameter is the driver's.
const (
	paramGroup        = "group"
	paramPrefetch     = "prefetch"
	paramNackDelay    = "nack_delay"
	paramAckTimeout   = "ack_timeout"
	paramPollInterval = "poll_interval"
	// paramConnectTimeout is sqldb's connect_timeout, with the same syntax.
	paramConnectTimeout = connect.Param
)

// commonParams are the query parameters of every scheme, which Open reads.
var commonParams = urlparam.Group{
	Reader: "onceflow",
	Names:  []string{paramGroup, paramPrefetch, paramNackDelay, paramAckTimeout, paramPollInterval, paramConnectTimeout},
}

// modulePath prefixes the packages of schemeInfo.pkg.
const modulePath = "github.com/onceflow/onceflow/"

// schemeInfo is what package broker knows of a scheme whether or not its package is linked in.
type schemeInfo struct {
	// name is the canonical scheme, which Broker.Scheme reports.
	name string
	// aliases are the other URL schemes that open the same broker.
	aliases []string
	// system is the OpenTelemetry messaging.system of the broker.
	system string
	// pkg is the package that registers the scheme.
	pkg string
	// inspect says that Peek, Move and Delete work (the scheme has a Backend.View), as the
	// package documentation's table lists it.
	inspect bool
}

// schemes lists the schemes of Open, in the order its errors list them.
var schemes = []schemeInfo{
	{name: "amqp", aliases: []string{"amqps"}, system: "rabbitmq", pkg: "github.com/onceflow/onceflow/broker/amqp", inspect: true},
	{name: "postgres", aliases: []string{"postgresql"}, system: "postgresql", pkg: "github.com/onceflow/onceflow/broker/sqlqueue", inspect: true},
	{name: "mysql", aliases: []string{"mariadb"}, system: "mysql", pkg: "github.com/onceflow/onceflow/broker/sqlqueue", inspect: true},
	{name: "sqlite", aliases: []string{"sqlite3"}, system: "sqlite", pkg: "github.com/onceflow/onceflow/broker/sqlitequeue", inspect: true},
	{name: "nats", system: "nats", pkg: "github.com/onceflow/onceflow/broker/nats", inspect: true},
	{name: "redis", aliases: []string{"rediss"}, system: "redis", pkg: "github.com/onceflow/onceflow/broker/redis", inspect: true},
	{name: "kafka", system: "kafka", pkg: "github.com/onceflow/onceflow/broker/kafka", inspect: true},
	{name: "mem", system: "mem", pkg: "github.com/onceflow/onceflow/broker/mem"},
}

// allPackage registers every scheme.
const allPackage = "github.com/onceflow/onceflow/broker/all"

// schemeInfoOf returns the scheme whose canonical name is name.
func schemeInfoOf(name string) (schemeInfo, bool) {
	for _, s := range schemes {
		if s.name == name {
			return s, true
		}
	}
	return schemeInfo{}, false
}

// canonicalScheme returns the canonical scheme of a lower-case URL scheme, "" for a scheme
// Open does not know.
func canonicalScheme(scheme string) string {
	for _, s := range schemes {
		if s.name == scheme || slices.Contains(s.aliases, scheme) {
			return s.name
		}
	}
	return ""
}

// acceptedSchemes lists the URL schemes of Open, for errors.
var acceptedSchemes = func() string {
	var all []string
	for _, s := range schemes {
		for _, name := range append([]string{s.name}, s.aliases...) {
			all = append(all, name+"://")
		}
	}
	return "want " + strings.Join(all[:len(all)-1], ", ") + " or " + all[len(all)-1]
}()

// target is a parsed broker URL: the Target an OpenFunc gets, and what Open keeps to itself.
type target struct {
	Target
	// secrets are the strings that must never appear in an error: passwords and tokens, as
	// written in the URL and decoded.
	secrets []string
	// params are onceflow's query parameters.
	params url.Values
}

// parseTarget splits rawURL into the driver's URL and onceflow's query parameters. Its errors
// never contain a password of rawURL.
func parseTarget(rawURL string) (*target, error) {
	if strings.TrimSpace(rawURL) == "" {
		return nil, fmt.Errorf("broker: URL is empty (%s)", acceptedSchemes)
	}
	redacted := redact.String(rawURL)
	if form := redact.FormOf(rawURL); form != redact.URL {
		return nil, fmt.Errorf("broker: %q is a %s, not a URL (%s)", redacted, form, acceptedSchemes)
	}
	scheme, rest, ok := strings.Cut(rawURL, ":")
	canonical := canonicalScheme(strings.ToLower(scheme))
	if !ok || canonical == "" {
		return nil, fmt.Errorf("broker: URL %q: unknown scheme %q (%s)", redacted, schemeForError(scheme), acceptedSchemes)
	}
	if !strings.HasPrefix(rest, "//") {
		return nil, fmt.Errorf("broker: URL %q is malformed: want %s://... (%s)", redacted, strings.ToLower(scheme), acceptedSchemes)
	}
	if redact.StrayAt(rawURL) {
		return nil, fmt.Errorf("broker: URL %q is malformed: '@' after the host; percent-encode '@', '/', '?' and '#' in the user name and password (%%40, %%2F, %%3F, %%23)", redacted)
	}
	base, query, _ := strings.Cut(rawURL, "?")
	if strings.Contains(query, "#") || strings.Contains(base, "#") {
		return nil, fmt.Errorf("broker: URL %q: a fragment (#...) is not allowed; percent-encode '#' as %%23", redacted)
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil, fmt.Errorf("broker: URL %q: malformed query: %w", redacted, err)
	}
	params := url.Values{}
	for _, k := range commonParams.Names {
		if vs, ok := q[k]; ok {
			params[k] = vs
			delete(q, k)
		}
	}
	dsn := base
	if len(q) > 0 {
		dsn += "?" + q.Encode()
	}
	u, err := url.Parse(dsn)
	switch {
	case err != nil && canonical == "sqlite":
		// A file path, not a network address (sqlite://:memory:, sqlite://C:/queue.db):
		// sqlitequeue reads it.
		u = &url.URL{Scheme: strings.ToLower(scheme)}
	case err != nil:
		// url.Parse quotes the part it rejects, which may be the password: do not wrap it.
		return nil, fmt.Errorf("broker: URL %q is malformed: check that special characters in the user name and password are percent-encoded", redacted)
	}
	return &target{
		Target:  Target{Scheme: canonical, URL: dsn, Parsed: u, Redacted: redacted},
		secrets: redact.Secrets(rawURL),
		params:  params,
	}, nil
}

// schemeForError returns s if it looks like a scheme name, so that an error does not echo the
// start of a URL that has no scheme (which may be user:password).
func schemeForError(s string) string {
	if len(s) > 16 || !redact.ValidScheme(s) {
		return "(none)"
	}
	return s
}

// applyParams returns opts with the URL's query parameters applied over it.
func applyParams(opts Options, params url.Values, redacted string) (Options, error) {
	bad := func(k, v, want string) error {
		return fmt.Errorf("broker: URL %q: query parameter %s=%q: want %s", redacted, k, v, want)
	}
	for k, vs := range params {
		v := vs[len(vs)-1]
		switch k {
		case paramGroup:
			if v == "" {
				return opts, bad(k, v, "a non-empty consumer group name")
			}
			opts.ConsumerGroup = v
		case paramPrefetch:
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return opts, bad(k, v, "a non-negative integer (0 selects the default)")
			}
			opts.Prefetch = n
		case paramNackDelay:
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return opts, bad(k, v, "a non-negative Go duration such as 250ms or 2s")
			}
			opts.NackDelay = cmp.Or(d, NoNackDelay)
		case paramAckTimeout, paramPollInterval:
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return opts, bad(k, v, "a positive Go duration such as 50ms or 30s")
			}
			if k == paramAckTimeout {
				opts.AckTimeout = d
			} else {
				opts.PollInterval = d
			}
		case paramConnectTimeout:
			// Brokers' clients cannot wait without limit: 0, which sqldb reads so, is refused.
			d, err := connect.ParseTimeout(v)
			if err != nil || d == 0 {
				return opts, bad(k, v, "a positive Go duration such as 10s or 300ms, or whole seconds")
			}
			opts.ConnectTimeout = d
		}
	}
	return opts, nil
}
