package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/redact"
	"github.com/onceflow/onceflow/internal/urlparam"
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
	w        *writer // the writing connection of a pool over an SQLite file with turns
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
// Each dialect's driver is a package of its own, which the program imports for its
// registration, as it would a database/sql driver; Open names the import a URL needs when it
// is missing:
//
//	import _ "github.com/onceflow/onceflow/sqldb/postgres" // pgx
//	import _ "github.com/onceflow/onceflow/sqldb/mysql"    // go-sql-driver/mysql
//	import _ "github.com/onceflow/onceflow/sqldb/sqlite"   // modernc.org/sqlite
//
// Special characters in the user name, the password and an SQLite path are percent-encoded,
// as in any URL (%40 for '@', %2F for '/', %3F for '?', %23 for '#', %25 for '%'). The
// packages of the drivers say how they read the rest of the URL.
//
// Every connect to a PostgreSQL or MySQL server, from the TCP dial to the end of the handshake
// and authentication, Open's own and every later one of the pool, is bounded by the
// connect_timeout query parameter, a Go duration (300ms, 10s) or whole seconds as libpq writes
// it (10), which defaults to DefaultConnectTimeout; connect_timeout=0 waits without limit.
// Open reads the parameter and does not pass it on to the driver; an SQLite URL, which names
// a local file, ignores it. When ctx ends first, it ends the wait.
//
// The pool keeps up to DefaultMaxIdleConns idle connections, each for at most
// DefaultConnMaxIdleTime; SetMaxIdleConns and SetConnMaxIdleTime change that.
//
// The connections of an SQLite file keep the last 128 statement texts each ran compiled, and
// run them again without parsing them: the driver parses every statement run outside a
// prepared one, and most statements a program runs come back. The transactions that
// DB.BeginTx and DB.BeginTxx begin over an SQLite file take the file's turn, then all run on
// one connection of the pool, whose cached pages stay warm from one to the next (see
// DB.BeginTxx); Close gives it back.
//
// Errors and String name the host and never contain the password of the URL.
func Open(ctx context.Context, rawURL string) (*DB, error) {
	t, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	return open(ctx, rawURL, t)
}

// ErrNoDatabase reports an SQLite file that OpenExisting did not find. It is an
// fs.ErrNotExist too (errors.Is).
var ErrNoDatabase error = notExist("no such database")

// notExist is an error that errors.Is counts as fs.ErrNotExist.
type notExist string

func (e notExist) Error() string      { return string(e) }
func (notExist) Is(target error) bool { return target == fs.ErrNotExist }

// OpenExisting is Open for commands that read or maintain a database and must not create one:
// an SQLite URL whose file does not exist fails with ErrNoDatabase and the path, where Open
// would create an empty database. Server URLs are opened as Open opens them.
func OpenExisting(ctx context.Context, rawURL string) (*DB, error) {
	t, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	if t.path != "" {
		if _, err := os.Stat(t.path); errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: %s", ErrNoDatabase, t.path)
		}
	}
	return open(ctx, rawURL, t)
}

func open(ctx context.Context, rawURL string, t *target) (*DB, error) {
	// The drivers' errors may echo the credentials they were given.
	secrets := redact.Secrets(rawURL)
	connector, err := connectorOf(t.driver.DriverName, t.dsn)
	if err != nil {
		return nil, redact.Error(fmt.Errorf("open %s: %w", t.redacted, err), secrets)
	}
	if t.connectTimeout > 0 {
		connector = boundedConnector{Connector: connector, timeout: t.connectTimeout}
	}
	if t.driver.WrapConn != nil {
		connector = wrappingConnector{Connector: connector, wrap: t.driver.WrapConn}
	}
	var w *writer
	if t.path != "" && !strings.Contains(t.path, ":memory:") && !strings.Contains(t.dsn, "mode=memory") && t.driver.WriteTurn != nil {
		if wait, ok := t.driver.WriteTurn(t.dsn); ok {
			w = &writer{turn: writeTurn(t.path), wait: wait}
			connector = turnConnector{Connector: connector, turn: w.turn, wait: wait}
		}
	}
	sdb := sql.OpenDB(connector)
	sdb.SetMaxIdleConns(DefaultMaxIdleConns)
	sdb.SetConnMaxIdleTime(DefaultConnMaxIdleTime)
	db := &DB{DB: sqlx.NewDb(sdb, t.driver.DriverName), Dialect: t.driver.Dialect, Path: t.path, redacted: t.redacted, w: w}
	pingCtx := ctx
	if t.connectTimeout > 0 {
		var cancel context.CancelFunc
		pingCtx, cancel = context.WithTimeout(ctx, t.connectTimeout)
		defer cancel()
	}
	if err := db.PingContext(pingCtx); err != nil {
		_ = sdb.Close()
		var unknown *urlparam.UnknownError
		if err = t.unknownParam(err); errors.As(err, &unknown) {
			return nil, redact.Error(fmt.Errorf("database URL %q: %w", t.redacted, err), secrets)
		}
		err = connect.Explain(ctx, t.connectTimeout, err)
		return nil, redact.Error(fmt.Errorf("connect to %s: %w", t.redacted, err), secrets)
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

// target is a database URL, parsed.
type target struct {
	driver *Driver
	// dsn is the driver's data source name.
	dsn string
	// path is the file of an SQLite database.
	path string
	// redacted names the database without its password.
	redacted string
	// connectTimeout bounds each connect; 0 for no bound.
	connectTimeout time.Duration
	// query are the URL's query parameters, params the table of those its scheme takes.
	query  url.Values
	params urlparam.Table
}

// queryOf returns the query parameters of rawURL.
func queryOf(rawURL string) (url.Values, error) {
	_, query, _ := strings.Cut(rawURL, "?")
	query, _, _ = strings.Cut(query, "#")
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil, fmt.Errorf("malformed query: %w", err)
	}
	return q, nil
}

// unknownParam returns err, the failure of a connect, as an *urlparam.UnknownError when the
// server refused a query parameter of the URL that the driver passed on to it as a setting.
func (t *target) unknownParam(err error) error {
	if t.driver.UnknownSetting == nil || !t.driver.UnknownSetting(err) {
		return err
	}
	msg := err.Error()
	for name := range t.query {
		if !t.params.Has(name) && (strings.Contains(msg, `"`+name+`"`) || strings.Contains(msg, `'`+name+`'`)) {
			return &urlparam.UnknownError{Param: name, Table: t.params, Cause: err}
		}
	}
	return err
}

func parseURL(rawURL string) (*target, error) {
	if strings.TrimSpace(rawURL) == "" {
		return nil, fmt.Errorf("database URL is empty (%s)", wantSchemes)
	}
	switch redact.FormOf(rawURL) {
	case redact.Keywords:
		return nil, fmt.Errorf("database URL %q is a %s, not a URL: write postgres://user:password@host:port/dbname?param=value (%s)", Redact(rawURL), redact.Keywords, wantSchemes)
	case redact.DSN:
		return nil, fmt.Errorf("database URL %q is a %s, not a URL: write mysql://user:password@host:port/dbname?param=value (%s)", Redact(rawURL), redact.DSN, wantSchemes)
	}
	scheme, _, ok := strings.Cut(rawURL, ":")
	if !ok || !redact.ValidScheme(scheme) {
		return nil, fmt.Errorf("database URL %q has no scheme (%s)", Redact(rawURL), wantSchemes)
	}
	info, ok := dialectOfScheme(strings.ToLower(scheme))
	if !ok {
		return nil, fmt.Errorf("database URL %q: unknown scheme %q (%s)", Redact(rawURL), scheme, wantSchemes)
	}
	d, err := driverOf(info)
	if err != nil {
		return nil, fmt.Errorf("database URL %q: %w", Redact(rawURL), err)
	}
	t := &target{driver: d, redacted: Redact(rawURL), params: d.params(info)}
	if t.query, err = queryOf(rawURL); err == nil {
		err = t.params.Check(t.query)
	}
	if err != nil {
		return nil, fmt.Errorf("database URL %q: %w", Redact(rawURL), err)
	}
	var u *url.URL
	if !info.file {
		if _, err := parseServerURL(rawURL); err != nil {
			return nil, err
		}
		t.connectTimeout = DefaultConnectTimeout
	}
	// Drivers recognise only the lower-case schemes.
	rest, v, found, err := cutParam(lowerScheme(rawURL), connect.Param)
	if err == nil && found && !info.file {
		t.connectTimeout, err = connect.ParseTimeout(v)
	}
	if err != nil {
		return nil, fmt.Errorf("database URL %q: %w", Redact(rawURL), err)
	}
	if !info.file {
		if u, err = parseServerURL(rest); err != nil {
			return nil, err
		}
	}
	if t.dsn, t.path, err = d.DSN(rest, u); err != nil {
		return nil, fmt.Errorf("database URL %q: %w", Redact(rawURL), err)
	}
	if info.file {
		t.redacted = info.schemes[0] + "://" + t.path
	}
	return t, nil
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

// urlErrorWithoutInput drops the input string from a *url.Error, which may hold a password.
func urlErrorWithoutInput(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// TableExists reports whether the database has the table name, one identifier as Quote
// quotes it, in the connection's schema: PostgreSQL's search path, MySQL's current database.
// Commands use it to tell a database that was never migrated from one that fails.
func (db *DB) TableExists(ctx context.Context, name string) (bool, error) {
	var n int
	var err error
	switch db.Dialect {
	case Postgres:
		err = db.QueryRowContext(ctx, `SELECT COUNT(*) FROM (SELECT to_regclass($1) AS t) r WHERE t IS NOT NULL`, Postgres.Quote(name)).Scan(&n)
	case MySQL:
		err = db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?`, name).Scan(&n)
	default:
		err = db.QueryRowContext(ctx, `SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, name).Scan(&n)
	}
	if err != nil {
		return false, fmt.Errorf("look for table %s in %s: %w", name, db, err)
	}
	return n > 0, nil
}
