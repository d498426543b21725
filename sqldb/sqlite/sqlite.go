// Package sqlite registers the SQLite driver of package sqldb, the embedded default:
// modernc.org/sqlite (pure Go, no cgo) and the classification of its errors by result code.
// Import it for its side effect, in the program that opens sqlite:// URLs:
//
//	import _ "github.com/onceflow/onceflow/sqldb/sqlite"
//
// sqldb.Open opens sqlite://path/to/file.db (relative) and sqlite:///absolute/path/file.db
// (also sqlite3://), creating the file if missing, in WAL mode with synchronous=FULL, a busy
// timeout of 30 s, foreign keys enforced, temporary data in memory (temp_store=MEMORY), the log
// copied back into the file every 4,000 pages (wal_autocheckpoint=4000) and BEGIN IMMEDIATE
// transactions, so that concurrent writers queue instead of failing. The transactions of one
// process over a file take turns in arrival order before BEGIN, each waiting up to the busy
// timeout (see sqldb.Driver.WriteTurn), rather than polling the lock in SQLite's busy handler;
// those that sqldb.DB.BeginTx and BeginTxx begin run on one connection of the pool, whose
// cached pages stay warm from one transaction to the next.
// The query parameters of the URL are passed to the driver: its own (params: _pragma, _txlock,
// ...) and SQLite's URI parameters (mode, cache, ...); sqldb.Open refuses any other. A _pragma
// parameter replaces the default of the same pragma (_pragma=busy_timeout(10) sets a 10 ms busy
// timeout), as _txlock replaces the IMMEDIATE default. A file has no connect to bound:
// connect_timeout is ignored.
package sqlite

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver

	"github.com/onceflow/onceflow/sqldb"
)

func init() {
	sqldb.Register(sqldb.Driver{
		Dialect:          sqldb.SQLite,
		DriverName:       "sqlite",
		DSN:              dsn,
		Classify:         classify,
		UniqueConstraint: constraint,
		WriteTurn:        writeTurn,
		Params:           params,
	})
}

// params are the DSN parameters that modernc.org/sqlite documents (v1.62), then the URI
// parameters that SQLite reads from the "file:" name the DSN is.
var params = []string{
	"_pragma", "_busy_timeout", "_timeout", "_auto_vacuum", "_vacuum", "_foreign_keys", "_fk",
	"_journal_mode", "_journal", "_synchronous", "_sync", "_query_only", "_time_format",
	"_time_integer_format", "_timezone", "_txlock", "_inttotime", "_texttotime", "_dqs",
	"_defensive", "_error_rc", "vfs",
	"mode", "cache", "immutable", "nolock", "psow", "modeof",
}

// writeTurn reports whether the transactions of a database opened with dsn take the write
// lock at BEGIN (_txlock immediate, the default, or exclusive), and how long one waits for the
// lock: the busy timeout, 0 when none is set.
func writeTurn(dsn string) (time.Duration, bool) {
	q, err := url.ParseQuery(dsn[strings.IndexByte(dsn, '?')+1:])
	if err != nil {
		return 0, false
	}
	if lock := strings.ToLower(q.Get("_txlock")); lock != "immediate" && lock != "exclusive" {
		return 0, false
	}
	ms := 0
	for _, p := range q["_pragma"] {
		if pragmaName(p) == "busy_timeout" {
			_, value, _ := strings.Cut(strings.ToLower(p), "busy_timeout")
			ms, _ = strconv.Atoi(strings.Trim(value, " =()"))
		}
	}
	for _, k := range []string{"_busy_timeout", "_timeout"} {
		if v := q.Get(k); v != "" {
			ms, _ = strconv.Atoi(v)
		}
	}
	return time.Duration(ms) * time.Millisecond, true
}

// dsn turns a sqlite: URL into a modernc.org/sqlite DSN, and returns the path of the file.
func dsn(rawURL string, _ *url.URL) (string, string, error) {
	_, rest, _ := strings.Cut(rawURL, ":")
	return sqliteDSN(rest)
}

// sqliteDefaults are the pragmas every SQLite connection gets unless the URL sets them. The
// driver runs busy_timeout first, so that the others wait for locks instead of failing.
// temp_store(MEMORY) keeps statement journals in memory: a multi-row upsert (a group's ids)
// otherwise writes one to a temporary file.
//
// wal_autocheckpoint(4000) copies the write-ahead log back into the database file once it
// holds 4,000 pages (about 16 MB) instead of SQLite's 1,000. The copy runs inside the commit
// that crosses the mark, while that transaction holds the file's one write lock, and a page
// that many commits change (an index's inner pages, a table's last page) is copied once per
// checkpoint: fewer checkpoints copy fewer pages in all, and the commit that copies takes
// longer. A larger mark made the first commits of a new file slower while its log first grew.
// BenchmarkGroupCommit_SQLiteAutocheckpoint (package dedup) measures it; bench/NOTES.md
// has the figures.
var sqliteDefaults = []string{"busy_timeout(30000)", "journal_mode(WAL)", "synchronous(FULL)", "foreign_keys(1)", "temp_store(MEMORY)", "wal_autocheckpoint(4000)"}

// sqliteShorthands maps the driver's shorthand parameters to the pragma each one sets.
var sqliteShorthands = map[string]string{
	"_busy_timeout": "busy_timeout", "_timeout": "busy_timeout",
	"_journal_mode": "journal_mode", "_journal": "journal_mode",
	"_synchronous": "synchronous", "_sync": "synchronous",
	"_foreign_keys": "foreign_keys", "_fk": "foreign_keys",
}

// sqliteDSN turns the part of a sqlite: URL after the scheme into a modernc.org/sqlite DSN,
// and returns the path of the file.
func sqliteDSN(rest string) (dsn, path string, err error) {
	rawPath, query, _ := strings.Cut(strings.TrimPrefix(rest, "//"), "?")
	path, err = url.PathUnescape(rawPath)
	if err != nil {
		return "", "", fmt.Errorf("malformed path: %w", err)
	}
	if path == "" {
		return "", "", errors.New("names no file")
	}
	extra, err := url.ParseQuery(query)
	if err != nil {
		return "", "", fmt.Errorf("malformed query: %w", err)
	}
	// The driver sorts the _pragma values before it runs them, so a value in the URL does not
	// override a default of the same pragma by coming later: the default must go.
	set := map[string]bool{}
	for _, p := range extra["_pragma"] {
		set[pragmaName(p)] = true
	}
	for k := range extra {
		if name, ok := sqliteShorthands[k]; ok {
			set[name] = true
		}
	}
	params := url.Values{}
	if extra.Get("_txlock") == "" {
		params.Set("_txlock", "immediate")
	}
	for _, p := range sqliteDefaults {
		if !set[pragmaName(p)] {
			params.Add("_pragma", p)
		}
	}
	for k, vs := range extra {
		for _, v := range vs {
			params.Add(k, v)
		}
	}
	// The driver opens "file:" names as SQLite URIs, which decode %XX escapes in the path and
	// end it at '?' or '#': escape the path so that SQLite opens exactly the file named.
	return "file:" + (&url.URL{Path: path}).EscapedPath() + "?" + params.Encode(), path, nil
}

// pragmaName returns the lower-case name of the pragma that a _pragma value such as
// "busy_timeout(10)" or "synchronous = NORMAL" sets.
func pragmaName(v string) string {
	if i := strings.IndexAny(v, "(="); i >= 0 {
		v = v[:i]
	}
	return strings.ToLower(strings.TrimSpace(v))
}
