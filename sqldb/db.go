package sqldb

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"strings"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite" // registers the "sqlite" driver

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

// Open opens the database that rawURL names and checks that it answers. The URL forms:
//
//	postgres://user:password@host:5432/dbname?sslmode=disable   (also postgresql://)
//	mysql://user:password@host:3306/dbname?param=value          (MySQL and MariaDB)
//	sqlite://path/to/file.db, sqlite:///absolute/path/file.db   (embedded, created if missing)
//
// PostgreSQL URLs are passed to pgx unchanged. MySQL URLs become a go-sql-driver DSN with
// interpolateParams=true unless the URL sets it. SQLite databases are opened in WAL mode with
// synchronous=FULL, a busy timeout of 30 s and BEGIN IMMEDIATE transactions, so that
// concurrent writers queue instead of failing; query parameters of the URL (such as
// _pragma=synchronous(NORMAL)) are passed to the driver after these defaults.
//
// Errors never contain the password of the URL.
func Open(ctx context.Context, rawURL string) (*DB, error) {
	driverName, dsn, path, redacted, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	sdb, err := sql.Open(driverName, dsn)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", redacted, err)
	}
	db := &DB{DB: sqlx.NewDb(sdb, driverName), Path: path, redacted: redacted}
	db.Dialect, _ = DialectOf(driverName)
	if err := db.PingContext(ctx); err != nil {
		_ = sdb.Close()
		return nil, fmt.Errorf("connect to %s: %w", redacted, err)
	}
	return db, nil
}

// New wraps a pool opened elsewhere. The dialect comes from the pool's driver name (pgx,
// mysql or sqlite).
func New(db *sqlx.DB) (*DB, error) {
	if db == nil {
		return nil, fmt.Errorf("sqldb.New: db is nil")
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

// Redact returns rawURL with its password, if any, replaced by "xxxxx". A string that does not
// parse as a URL is reduced to its scheme, so that a malformed URL with a password in it is not
// echoed back either.
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		if i := strings.Index(rawURL, ":"); i > 0 {
			return rawURL[:i] + "://(malformed URL)"
		}
		return "(malformed URL)"
	}
	return u.Redacted()
}

func parseURL(rawURL string) (driverName, dsn, path, redacted string, err error) {
	scheme, rest, ok := strings.Cut(rawURL, ":")
	if !ok || scheme == "" {
		return "", "", "", "", fmt.Errorf("database URL %q has no scheme (want postgres://, mysql:// or sqlite://)", Redact(rawURL))
	}
	switch strings.ToLower(scheme) {
	case "sqlite", "sqlite3":
		path, query, _ := strings.Cut(strings.TrimPrefix(rest, "//"), "?")
		if path == "" {
			return "", "", "", "", fmt.Errorf("database URL %q names no file", rawURL)
		}
		params := url.Values{}
		params.Add("_txlock", "immediate")
		params.Add("_pragma", "journal_mode(WAL)")
		params.Add("_pragma", "synchronous(FULL)")
		params.Add("_pragma", "busy_timeout(30000)")
		params.Add("_pragma", "foreign_keys(1)")
		extra, err := url.ParseQuery(query)
		if err != nil {
			return "", "", "", "", fmt.Errorf("database URL %q: malformed query: %w", rawURL, err)
		}
		for k, vs := range extra {
			if k == "_txlock" {
				params.Del(k)
			}
			for _, v := range vs {
				params.Add(k, v)
			}
		}
		return "sqlite", "file:" + path + "?" + params.Encode(), path, "sqlite://" + path, nil
	case "postgres", "postgresql":
		u, err := url.Parse(rawURL)
		if err != nil {
			return "", "", "", "", fmt.Errorf("malformed database URL %q: %w", Redact(rawURL), urlErrorWithoutInput(err))
		}
		return "pgx", rawURL, "", u.Redacted(), nil
	case "mysql", "mariadb":
		u, err := url.Parse(rawURL)
		if err != nil {
			return "", "", "", "", fmt.Errorf("malformed database URL %q: %w", Redact(rawURL), urlErrorWithoutInput(err))
		}
		cfg := mysql.NewConfig()
		cfg.Net = "tcp"
		cfg.Addr = u.Host
		if u.Port() == "" {
			cfg.Addr = u.Host + ":3306"
		}
		if u.User != nil {
			cfg.User = u.User.Username()
			cfg.Passwd, _ = u.User.Password()
		}
		cfg.DBName = strings.TrimPrefix(u.Path, "/")
		cfg.InterpolateParams = true
		q := u.Query()
		if v := q.Get("interpolateParams"); v != "" {
			cfg.InterpolateParams = v == "true"
			q.Del("interpolateParams")
		}
		if len(q) > 0 {
			cfg.Params = map[string]string{}
			for k := range q {
				cfg.Params[k] = q.Get(k)
			}
		}
		return "mysql", cfg.FormatDSN(), "", u.Redacted(), nil
	}
	return "", "", "", "", fmt.Errorf("database URL %q: unknown scheme %q (want postgres://, mysql:// or sqlite://)", Redact(rawURL), scheme)
}

// urlErrorWithoutInput drops the input string from a *url.Error, which may hold a password.
func urlErrorWithoutInput(err error) error {
	if ue, ok := err.(*url.Error); ok {
		return ue.Err
	}
	return err
}
