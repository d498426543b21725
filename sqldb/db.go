package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite" // registers the "sqlite" driver

	"github.com/onceflow/onceflow/internal/redact"
	"github.com/onceflow/onceflow/processor"
)

func init() {
	// sqlx does not know modernc's driver name; it takes ? placeholders.
	sqlx.BindDriver("sqlite", sqlx.QUESTION)
}

// DB is an application database: a connection pool and its dialect.
type DB struct {
	*sqlx.DB
	// Dialect is the SQL dialect of the database.
	Dialect Dialect
	// Path is the file of an SQLite database, empty for the other dialects.
	Path string

	redacted string
}

// Pool defaults of Open. database/sql keeps only 2 idle connections unless told otherwise: a
// handler with Concurrency 16 then closes most connections it returns and opens a new one
// (a new server process, on PostgreSQL) for a later transaction, at a cost that can exceed
// the transaction's own. Open keeps as many idle as a handler's deliveries use at once, up to
// DefaultMaxIdleConns, and closes a connection idle for DefaultConnMaxIdleTime.
const (
	DefaultMaxIdleConns    = 64
	DefaultConnMaxIdleTime = 5 * time.Minute
)

// Open opens the database that rawURL names and checks that it answers. The URL forms:
//
//	postgres://user:password@host:5432/dbname?sslmode=disable   (also postgresql://)
//	mysql://user:password@host:3306/dbname?param=value          (MySQL and MariaDB; also mariadb://)
//	sqlite://path/to/file.db, sqlite:///absolute/path/file.db   (embedded, created if missing)
//
// Special characters in the user name, the password and an SQLite path are percent-encoded,
// as in any URL (%40 for '@', %2F for '/', %3F for '?', %23 for '#', %25 for '%').
//
// PostgreSQL URLs are passed to pgx as they are. MySQL URLs become a go-sql-driver DSN; the
// port defaults to 3306, the query parameters are go-sql-driver's (parseTime=true, ...) or
// session variables (sql_mode=%27ANSI%27, ...), and interpolateParams defaults to true unless
// the URL sets it. SQLite databases are opened in WAL mode with synchronous=FULL, a busy
// timeout of 30 s, foreign keys enforced and BEGIN IMMEDIATE transactions, so that concurrent
// writers queue instead of failing; the query parameters of the URL are passed to the driver,
// and a _pragma parameter replaces the default of the same pragma
// (_pragma=busy_timeout(10) sets a 10 ms busy timeout), as _txlock replaces the IMMEDIATE
// default.
//
// The pool keeps up to DefaultMaxIdleConns idle connections, each for at most
// DefaultConnMaxIdleTime; SetMaxIdleConns and SetConnMaxIdleTime change that.
//
// Errors and String never contain the password of the URL.
func Open(ctx context.Context, rawURL string) (*DB, error) {
	driverName, dsn, path, redacted, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	// The drivers' errors may echo the credentials they were given.
	secrets := redact.Secrets(rawURL)
	sdb, err := sql.Open(driverName, dsn)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("open %s: %w", redacted, err), secrets)
	}
	sdb.SetMaxIdleConns(DefaultMaxIdleConns)
	sdb.SetConnMaxIdleTime(DefaultConnMaxIdleTime)
	db := &DB{DB: sqlx.NewDb(sdb, driverName), Path: path, redacted: redacted}
	db.Dialect, _ = DialectOf(driverName)
	if err := db.PingContext(ctx); err != nil {
		_ = sdb.Close()
		return nil, redact.Error(fmt.Errorf("connect to %s: %w", redacted, err), secrets)
	}
	return db, nil
}

// New wraps a pool opened elsewhere. The dialect comes from the pool's driver name (pgx,
// mysql or sqlite); for SQLite, Path is the file of the main database, or empty for an
// in-memory database.
func New(db *sqlx.DB) (*DB, error) {
	if db == nil {
		return nil, errors.New("sqldb.New: db is nil")
	}
	d, err := DialectOf(db.DriverName())
	if err != nil {
		return nil, err
	}
	out := &DB{DB: db, Dialect: d, redacted: string(d) + " database"}
	if d == SQLite {
		var seq int
		var name, file string
		if err := db.QueryRowx("PRAGMA database_list").Scan(&seq, &name, &file); err == nil {
			out.Path = file
			if file != "" {
				out.redacted = "sqlite://" + file
			}
		}
	}
	return out, nil
}

// BeginTx begins a transaction. It satisfies the Beginner that the Transaction middleware
// takes; the transaction it returns is an *sqlx.Tx.
func (db *DB) BeginTx(ctx context.Context, opts *sql.TxOptions) (processor.Tx, error) {
	tx, err := db.BeginTxx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return tx, nil
}

// String returns the database URL without its password.
func (db *DB) String() string { return db.redacted }

// Redact returns rawURL with its passwords and tokens replaced by "xxxxx", whatever its form:
// a URL (the password of the user information, the query parameters password, sslpassword and
// token, the token of nats://token@host), a libpq keyword/value string (host=db
// password='a b' ...) or a go-sql-driver DSN without a scheme (user:password@tcp(db:3306)/orders).
// A URL that does not parse, or whose password may have spilled out of the user information
// because a '/', '?' or '#' in it is not percent-encoded, is reduced to its scheme, so that a
// password in it is not echoed back either. Package broker redacts its URLs the same way.
func Redact(rawURL string) string { return redact.String(rawURL) }

// hasUserinfo reports whether the authority of rawURL has user information, which may hold a
// password.
func hasUserinfo(rawURL string) bool {
	_, rest, _ := strings.Cut(rawURL, "//")
	if end := strings.IndexAny(rest, "/?#"); end >= 0 {
		rest = rest[:end]
	}
	return strings.Contains(rest, "@")
}

const wantSchemes = "want postgres://, mysql:// or sqlite://"

func parseURL(rawURL string) (driverName, dsn, path, redacted string, err error) {
	if strings.TrimSpace(rawURL) == "" {
		return "", "", "", "", fmt.Errorf("database URL is empty (%s)", wantSchemes)
	}
	switch redact.FormOf(rawURL) {
	case redact.Keywords:
		return "", "", "", "", fmt.Errorf("database URL %q is a %s, not a URL: write postgres://user:password@host:port/dbname?param=value (%s)", Redact(rawURL), redact.Keywords, wantSchemes)
	case redact.DSN:
		return "", "", "", "", fmt.Errorf("database URL %q is a %s, not a URL: write mysql://user:password@host:port/dbname?param=value (%s)", Redact(rawURL), redact.DSN, wantSchemes)
	}
	scheme, rest, ok := strings.Cut(rawURL, ":")
	if !ok || !redact.ValidScheme(scheme) {
		return "", "", "", "", fmt.Errorf("database URL %q has no scheme (%s)", Redact(rawURL), wantSchemes)
	}
	switch strings.ToLower(scheme) {
	case "sqlite", "sqlite3":
		dsn, path, err := sqliteDSN(rest)
		if err != nil {
			return "", "", "", "", fmt.Errorf("database URL %q: %w", Redact(rawURL), err)
		}
		return "sqlite", dsn, path, "sqlite://" + path, nil
	case "postgres", "postgresql":
		if _, err := parseServerURL(rawURL); err != nil {
			return "", "", "", "", err
		}
		// pgx recognises only the lower-case schemes.
		return "pgx", strings.ToLower(scheme) + ":" + rest, "", Redact(rawURL), nil
	case "mysql", "mariadb":
		u, err := parseServerURL(rawURL)
		if err != nil {
			return "", "", "", "", err
		}
		dsn, err := mysqlDSN(u)
		if err != nil {
			return "", "", "", "", fmt.Errorf("database URL %q: %w", Redact(rawURL), err)
		}
		return "mysql", dsn, "", Redact(rawURL), nil
	}
	return "", "", "", "", fmt.Errorf("database URL %q: unknown scheme %q (%s)", Redact(rawURL), scheme, wantSchemes)
}

// parseServerURL parses the URL of a database server, refusing the forms in which a password
// would not stay in the user information.
func parseServerURL(rawURL string) (*url.URL, error) {
	if redact.StrayAt(rawURL) {
		return nil, fmt.Errorf("malformed database URL %q: '@' after the host; percent-encode '@', '/', '?' and '#' in the user name and password (%%40, %%2F, %%3F, %%23)", Redact(rawURL))
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		if hasUserinfo(rawURL) {
			// url.Parse quotes the offending part of its input, which may be the password.
			return nil, fmt.Errorf("malformed database URL %q: check that special characters in the user name and password are percent-encoded", Redact(rawURL))
		}
		return nil, fmt.Errorf("malformed database URL %q: %w", Redact(rawURL), urlErrorWithoutInput(err))
	}
	if u.Opaque != "" {
		return nil, fmt.Errorf("malformed database URL %q: want %s://[user[:password]@]host[:port]/database", Redact(rawURL), u.Scheme)
	}
	return u, nil
}

// mysqlDSN turns a mysql:// URL into a go-sql-driver DSN.
func mysqlDSN(u *url.URL) (string, error) {
	cfg := mysql.NewConfig()
	cfg.Net = "tcp"
	host, port := u.Hostname(), u.Port()
	if host == "" {
		host = "127.0.0.1"
	}
	if port == "" {
		port = "3306"
	}
	cfg.Addr = net.JoinHostPort(host, port)
	if u.User != nil {
		cfg.User = u.User.Username()
		cfg.Passwd, _ = u.User.Password()
	}
	cfg.DBName = strings.TrimPrefix(u.Path, "/")
	cfg.InterpolateParams = true
	dsn := cfg.FormatDSN()
	if q := u.Query(); len(q) > 0 {
		// Let go-sql-driver read the parameters, after the defaults above, so that its own
		// parameters (interpolateParams=false, parseTime=true, ...) are applied and checked,
		// and the others become session variables.
		params := url.Values{}
		for k, vs := range q {
			params.Set(k, vs[len(vs)-1])
		}
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + params.Encode()
	}
	parsed, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", err
	}
	return parsed.FormatDSN(), nil
}

// sqliteDefaults are the pragmas every SQLite connection gets unless the URL sets them. The
// driver runs busy_timeout first, so that the others wait for locks instead of failing.
var sqliteDefaults = []string{"busy_timeout(30000)", "journal_mode(WAL)", "synchronous(FULL)", "foreign_keys(1)"}

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

// urlErrorWithoutInput drops the input string from a *url.Error, which may hold a password.
func urlErrorWithoutInput(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
