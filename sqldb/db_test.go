package sqldb_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

// withScheme returns rawURL with its scheme replaced.
func withScheme(t testing.TB, rawURL, scheme string) string {
	t.Helper()
	_, rest, ok := strings.Cut(rawURL, ":")
	require.True(t, ok, rawURL)
	return scheme + ":" + rest
}

func open(t testing.TB, rawURL string) *sqldb.DB {
	t.Helper()
	db, err := sqldb.Open(context.Background(), rawURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func TestOpen_Postgres(t *testing.T) {
	t.Parallel()
	base := testsvc.PostgresSchemaURL(t)
	for _, scheme := range []string{"postgres", "postgresql", "POSTGRES"} {
		t.Run(scheme, func(t *testing.T) {
			t.Parallel()
			rawURL := withScheme(t, base, scheme)
			db := open(t, rawURL)
			require.Equal(t, sqldb.Postgres, db.Dialect)
			require.Empty(t, db.Path)
			require.Equal(t, withScheme(t, base, strings.ToLower(scheme)), db.String())
			var one int
			require.NoError(t, db.QueryRowx("SELECT 1").Scan(&one))
			require.Equal(t, 1, one)
		})
	}
}

func TestOpen_MySQL(t *testing.T) {
	t.Parallel()
	base := testsvc.MySQLDatabaseURL(t)
	u, err := url.Parse(base)
	require.NoError(t, err)

	t.Run("with port", func(t *testing.T) {
		t.Parallel()
		db := open(t, base)
		require.Equal(t, sqldb.MySQL, db.Dialect)
		require.Empty(t, db.Path)
		require.Equal(t, base, db.String())
		var name string
		require.NoError(t, db.QueryRowx("SELECT DATABASE()").Scan(&name))
		require.Equal(t, strings.TrimPrefix(u.Path, "/"), name)
	})
	t.Run("without port", func(t *testing.T) {
		t.Parallel()
		if u.Port() != "3306" {
			t.Skipf("the test server listens on port %s, not the default", u.Port())
		}
		noPort := *u
		noPort.Host = u.Hostname()
		db := open(t, noPort.String())
		var one int
		require.NoError(t, db.QueryRowx("SELECT 1").Scan(&one))
	})
	t.Run("mariadb scheme", func(t *testing.T) {
		t.Parallel()
		db := open(t, withScheme(t, base, "mariadb"))
		require.Equal(t, sqldb.MySQL, db.Dialect)
	})
	t.Run("driver and session parameters", func(t *testing.T) {
		t.Parallel()
		db := open(t, base+"?parseTime=true&sql_mode=%27STRICT_ALL_TABLES,ANSI_QUOTES%27")
		var now time.Time // parseTime=true scans DATETIME into time.Time
		require.NoError(t, db.QueryRowx("SELECT NOW()").Scan(&now))
		require.WithinDuration(t, time.Now(), now, time.Hour)
		var mode string
		require.NoError(t, db.QueryRowx("SELECT @@SESSION.sql_mode").Scan(&mode))
		require.Equal(t, "ANSI_QUOTES,STRICT_ALL_TABLES", mode) // the server orders the modes
	})

	// With interpolateParams the driver sends one text query; without it, it prepares the
	// statement on the server first.
	prepares := func(t *testing.T, rawURL string) int {
		ctx := context.Background()
		db := open(t, rawURL)
		conn, err := db.Connx(ctx)
		require.NoError(t, err)
		defer func() { _ = conn.Close() }()
		status := func() int {
			var name string
			var n int
			require.NoError(t, conn.QueryRowxContext(ctx, "SHOW SESSION STATUS LIKE 'Com_stmt_prepare'").Scan(&name, &n))
			return n
		}
		before := status()
		var got int
		require.NoError(t, conn.QueryRowxContext(ctx, "SELECT ? + 1", 41).Scan(&got))
		require.Equal(t, 42, got)
		return status() - before
	}
	t.Run("interpolateParams defaults to true", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, 0, prepares(t, base))
	})
	t.Run("interpolateParams=false", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, 1, prepares(t, base+"?interpolateParams=false"))
	})
}

// password is a password with every character that has a meaning in a URL, and the word
// Secret between them, so that no part of it can show up in a message unnoticed.
const password = "Secret1@Secret2:Secret3/Secret4?Secret5#Secret6%Secret7&Secret8 Secret9ü"

func requireNoSecret(t testing.TB, s string) {
	t.Helper()
	require.NotContains(t, strings.ToLower(s), "secret", "a part of the password shows in %q", s)
}

func TestOpen_MySQLPasswordWithSpecialCharacters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	base := testsvc.MySQLDatabaseURL(t)
	admin := open(t, base)
	u, err := url.Parse(base)
	require.NoError(t, err)
	dbName := strings.TrimPrefix(u.Path, "/")
	user := testsvc.UniqueName("u")
	_, err = admin.ExecContext(ctx, "CREATE USER ?@'%' IDENTIFIED BY ?", user, password)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.ExecContext(context.Background(), "DROP USER ?@'%'", user) })
	_, err = admin.ExecContext(ctx, "GRANT ALL ON "+dbName+".* TO ?@'%'", user)
	require.NoError(t, err)

	u.User = url.UserPassword(user, password)
	db := open(t, u.String())
	var current string
	require.NoError(t, db.QueryRowx("SELECT CURRENT_USER()").Scan(&current))
	require.Equal(t, user+"@%", current)
	require.Equal(t, "mysql://"+user+":xxxxx@"+u.Host+u.Path, db.String())
	requireNoSecret(t, db.String())

	u.User = url.UserPassword(user, password+"wrong")
	_, err = sqldb.Open(ctx, u.String())
	require.Error(t, err)
	require.Contains(t, err.Error(), "Access denied")
	requireNoSecret(t, err.Error())
}

func TestOpen_PasswordNeverInErrorsOrString(t *testing.T) {
	t.Parallel()
	enc := url.UserPassword("app", password).String() // app:Secret1%40Secret2%3A...
	closed := closedPort(t)

	t.Run("String of an open database", func(t *testing.T) {
		t.Parallel()
		u, err := url.Parse(testsvc.PostgresURL(t))
		require.NoError(t, err)
		u.User = url.UserPassword(u.User.Username(), password) // trust authentication ignores it
		db := open(t, u.String())
		requireNoSecret(t, db.String())
		require.Equal(t, "postgres://"+u.User.Username()+":xxxxx@"+u.Host+u.Path+"?"+u.RawQuery, db.String())
	})
	t.Run("wrong password", func(t *testing.T) {
		t.Parallel()
		u, err := url.Parse(testsvc.MySQLURL(t))
		require.NoError(t, err)
		u.User = url.UserPassword("root", password)
		_, err = sqldb.Open(context.Background(), u.String())
		require.Error(t, err)
		requireNoSecret(t, err.Error())
	})
	for _, rawURL := range []string{
		// Well-formed URLs that fail.
		"postgres://" + enc + "@" + closed + "/orders?sslmode=disable&connect_timeout=5",
		"postgresql://" + enc + "@" + closed + "/orders?sslmode=bogus",
		"postgres://app@" + closed + "/orders?sslmode=disable&password=" + url.QueryEscape(password),
		"mysql://" + enc + "@" + closed + "/orders",
		"mysql://" + enc + "@" + closed + "/orders?interpolateParams=maybe",
		"mysql://" + enc + "@" + closed + "/orders?collation=nonsense",
		"oracle://" + enc + "@" + closed + "/orders",
		// Passwords whose special characters are not percent-encoded.
		"postgres://app:" + password + "@" + closed + "/orders",
		"mysql://app:" + password + "@" + closed + "/orders",
		"postgres://app:Secret/1@" + closed + "/orders",
		"mysql://app:Secret?1@" + closed + "/orders",
		"postgres://app:12#Secret@" + closed + "/orders",
		"mysql://app:12/Secret@" + closed + "/orders",
		"postgres://app:Se%zzcret@" + closed + "/orders",
		"mysql://app:Secret 1@" + closed + "/orders",
		"mysql://app:Secret1@" + closed + "x/orders",
		// No scheme at all.
		"app:Secret@db.internal/orders",
		"//app:Secret@db.internal/orders",
		// libpq keyword/value strings.
		"host=127.0.0.1 port=1 user=app password=Secret1 dbname=orders",
		"host=127.0.0.1 user=app password='" + password + "' dbname=orders",
		`host=127.0.0.1 password='Secret1\'s' dbname=orders`,
		`password=Secret\ 1 host=127.0.0.1`,
		"host=127.0.0.1 password='Secret1",
		"dbname='postgres://app:Secret1@127.0.0.1:1/orders'",
		// go-sql-driver DSNs.
		"app:" + password + "@tcp(" + closed + ")/orders",
		"app:Secret1@tcp(" + closed + ")/orders?parseTime=true",
		"app:Secret1@unix(/var/run/mysqld/mysqld.sock)/orders",
		"app:Secret1@/orders",
	} {
		t.Run(rawURL, func(t *testing.T) {
			t.Parallel()
			db, err := sqldb.Open(context.Background(), rawURL)
			if err == nil {
				_ = db.Close()
			}
			require.Error(t, err)
			requireNoSecret(t, err.Error())
			requireNoSecret(t, sqldb.Redact(rawURL))
		})
	}
}

func TestOpen_ErrorsNameTheProblem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, err string }{
		{"", "database URL is empty (want postgres://, mysql:// or sqlite://)"},
		{"redis://127.0.0.1:6379/0", `database URL "redis://127.0.0.1:6379/0": unknown scheme "redis" (want postgres://, mysql:// or sqlite://)`},
		{"sqlite://", `database URL "sqlite:": names no file`},
		{"host=db user=app password=Secret1 dbname=orders", `database URL "host=db user=app password=xxxxx dbname=orders" is a libpq keyword/value string, not a URL: write postgres://user:password@host:port/dbname?param=value (want postgres://, mysql:// or sqlite://)`},
		{"app:Secret1@tcp(db:3306)/orders", `database URL "app:xxxxx@tcp(db:3306)/orders" is a go-sql-driver DSN, not a URL: write mysql://user:password@host:port/dbname?param=value (want postgres://, mysql:// or sqlite://)`},
		{"postgres://db.internal:port/orders", `malformed database URL "postgres://(malformed URL)": invalid port ":port" after host`},
	} {
		_, err := sqldb.Open(context.Background(), tc.in)
		require.EqualError(t, err, tc.err)
	}
}

// A query parameter that is neither sqldb's nor the driver's goes to the server as a setting;
// one the server does not have fails Open with an error that names the parameter, lists the
// known ones and keeps the server's refusal. A setting the server has is accepted.
func TestOpen_UnknownSettingIsNamed(t *testing.T) {
	t.Parallel()
	for _, s := range servers() {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			url := s.url(t)
			sep := "?"
			if strings.Contains(url, "?") {
				sep = "&"
			}
			_, err := sqldb.Open(context.Background(), url+sep+"grup=x")
			require.ErrorContains(t, err, `unknown query parameter "grup" (`+s.name+`:// takes sqldb's connect_timeout; `)
			require.ErrorContains(t, err, "which the server checks at connect): ")
			// The server's refusal is kept.
			var pgErr *pgconn.PgError
			var myErr *mysql.MySQLError
			require.True(t, errors.As(err, &pgErr) && pgErr.Code == "42704" || errors.As(err, &myErr) && myErr.Number == 1193, "%v", err)
			setting := map[string]string{"postgres": "application_name=onceflow_test", "mysql": "sql_mode=%27ANSI%27"}[s.name]
			db, err := sqldb.Open(context.Background(), url+sep+setting)
			require.NoError(t, err)
			require.NoError(t, db.Close())
		})
	}
}

// pragma reads an SQLite pragma on conn.
func pragma[T any](t testing.TB, conn *sqlx.Conn, name string) T {
	t.Helper()
	var v T
	require.NoError(t, conn.QueryRowxContext(context.Background(), "PRAGMA "+name).Scan(&v))
	return v
}

func TestOpen_SQLiteIsWALWithFullSyncAndImmediateTransactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.SQLite(t)
	require.Equal(t, sqldb.SQLite, db.Dialect)

	t.Run("every connection", func(t *testing.T) {
		for i := range 3 { // three connections at once, so that they are three
			conn, err := db.Connx(ctx)
			require.NoError(t, err)
			defer func() { _ = conn.Close() }()
			require.Equal(t, "wal", pragma[string](t, conn, "journal_mode"), "connection %d", i)
			require.Equal(t, 2, pragma[int](t, conn, "synchronous"), "connection %d", i) // FULL
			require.Equal(t, 30000, pragma[int](t, conn, "busy_timeout"), "connection %d", i)
			require.Equal(t, 1, pragma[int](t, conn, "foreign_keys"), "connection %d", i)
			require.Equal(t, 4000, pragma[int](t, conn, "wal_autocheckpoint"), "connection %d", i)
		}
	})

	t.Run("a second transaction waits for the first", func(t *testing.T) {
		mustExec(t, db, "CREATE TABLE outbox (id INTEGER PRIMARY KEY)")
		first, err := db.BeginTxx(ctx, nil)
		require.NoError(t, err)
		require.IsType(t, &sqlx.Tx{}, first)
		t.Cleanup(func() { _ = first.Rollback() })

		// BEGIN IMMEDIATE takes the write lock: a second BEGIN waits for it, even before the
		// first transaction has written anything.
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		_, err = db.BeginTxx(short, nil)
		require.ErrorIs(t, err, context.DeadlineExceeded)

		second := make(chan error, 1)
		go func() {
			tx, err := db.BeginTxx(ctx, nil)
			if err == nil {
				_, err = tx.ExecContext(ctx, "INSERT INTO outbox (id) VALUES (2)")
				err = commitUnless(tx, err)
			}
			second <- err
		}()
		_, err = first.ExecContext(ctx, "INSERT INTO outbox (id) VALUES (1)")
		require.NoError(t, err)
		require.NoError(t, first.Commit())
		require.NoError(t, <-second)
		require.Equal(t, 2, count(t, db, "SELECT COUNT(*) FROM outbox"))
	})
}

// commitUnless commits tx unless err says the work in it failed, in which case it rolls back.
func commitUnless(tx *sqlx.Tx, err error) error {
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

func TestOpen_SQLiteParametersOverrideDefaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		query   string
		pragmas map[string]any
	}{
		{"_pragma=busy_timeout(10)", map[string]any{"busy_timeout": 10, "journal_mode": "wal", "synchronous": 2}},
		{"_pragma=synchronous(NORMAL)", map[string]any{"synchronous": 1, "journal_mode": "wal", "busy_timeout": 30000}},
		{"_pragma=journal_mode(DELETE)", map[string]any{"journal_mode": "delete", "synchronous": 2}},
		{"_pragma=foreign_keys(0)&_pragma=cache_size(-4000)", map[string]any{"foreign_keys": 0, "cache_size": -4000, "journal_mode": "wal"}},
		{"_busy_timeout=25", map[string]any{"busy_timeout": 25}},
		{"_sync=OFF", map[string]any{"synchronous": 0}},
		{"_pragma=wal_autocheckpoint(1000)", map[string]any{"wal_autocheckpoint": 1000, "synchronous": 2}},
	} {
		t.Run(tc.query, func(t *testing.T) {
			t.Parallel()
			db := open(t, testsvc.SQLiteURL(t)+"?"+tc.query)
			conn, err := db.Connx(context.Background())
			require.NoError(t, err)
			defer func() { _ = conn.Close() }()
			for name, want := range tc.pragmas {
				switch want := want.(type) {
				case int:
					require.Equal(t, want, pragma[int](t, conn, name), name)
				case string:
					require.Equal(t, want, pragma[string](t, conn, name), name)
				}
			}
		})
	}

	t.Run("_txlock=deferred", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		db := open(t, testsvc.SQLiteURL(t)+"?_txlock=deferred")
		mustExec(t, db, "CREATE TABLE outbox (id INTEGER PRIMARY KEY)")
		first, err := db.BeginTxx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = first.Rollback() }()
		_, err = first.ExecContext(ctx, "INSERT INTO outbox (id) VALUES (1)")
		require.NoError(t, err)
		// A deferred BEGIN takes no lock, so it does not wait.
		short, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		second, err := db.BeginTxx(short, nil)
		require.NoError(t, err)
		require.NoError(t, second.Rollback())
	})
}

func TestOpen_SQLiteAbsolutePath(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "app.db")
	rawURL := "sqlite://" + path // sqlite:///tmp/...
	require.True(t, strings.HasPrefix(rawURL, "sqlite:///"))
	db := open(t, rawURL)
	require.Equal(t, path, db.Path)
	require.Equal(t, rawURL, db.String())
	requireMainFile(t, db, path)
}

func TestOpen_SQLiteEscapedPath(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "my app #1?%.db")
	db := open(t, "sqlite://"+(&url.URL{Path: path}).EscapedPath()+"?_pragma=cache_size(-4000)")
	require.Equal(t, path, db.Path)
	requireMainFile(t, db, path)
}

// TestOpen_SQLiteRelativePath changes the working directory, so it cannot run in parallel.
func TestOpen_SQLiteRelativePath(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	require.NoError(t, os.Mkdir("data", 0o755))
	for _, tc := range []struct{ url, path string }{
		{"sqlite://app.db", "app.db"},
		{"sqlite://data/app.db", "data/app.db"},
		{"sqlite:plain.db", "plain.db"},
		{"sqlite3://other.db", "other.db"},
	} {
		db := open(t, tc.url)
		require.Equal(t, tc.path, db.Path)
		require.Equal(t, "sqlite://"+tc.path, db.String())
		requireMainFile(t, db, filepath.Join(dir, tc.path))
	}
}

// requireMainFile asserts that db keeps its data in the file at path.
func requireMainFile(t testing.TB, db *sqldb.DB, path string) {
	t.Helper()
	mustExec(t, db, "CREATE TABLE IF NOT EXISTS probe (id INTEGER PRIMARY KEY)")
	_, err := os.Stat(path)
	require.NoError(t, err)
	var seq int
	var name, file string
	require.NoError(t, db.QueryRowx("PRAGMA database_list").Scan(&seq, &name, &file))
	want, err := filepath.EvalSymlinks(path)
	require.NoError(t, err)
	got, err := filepath.EvalSymlinks(file)
	require.NoError(t, err)
	require.Equal(t, want, got)
}

func TestNew_DetectsTheDialect(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			opened := d.Open(t)
			db, err := sqldb.New(opened.DB)
			require.NoError(t, err)
			require.Equal(t, sqldb.Dialect(d.Name), db.Dialect)
			require.Equal(t, opened.Path, db.Path)
			require.Same(t, opened.DB, db.DB)
			requireNoSecret(t, db.String())
		})
	}

	t.Run("sqlite opened elsewhere", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "elsewhere.db")
		x, err := sqlx.Open("sqlite", path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = x.Close() })
		db, err := sqldb.New(x)
		require.NoError(t, err)
		require.Equal(t, sqldb.SQLite, db.Dialect)
		require.Equal(t, path, db.Path)
		require.Equal(t, "sqlite://"+path, db.String())
	})
	t.Run("sqlite in memory", func(t *testing.T) {
		t.Parallel()
		x, err := sqlx.Open("sqlite", ":memory:")
		require.NoError(t, err)
		t.Cleanup(func() { _ = x.Close() })
		db, err := sqldb.New(x)
		require.NoError(t, err)
		require.Equal(t, sqldb.SQLite, db.Dialect)
		require.Empty(t, db.Path)
		require.Equal(t, "sqlite database", db.String())
	})
	t.Run("driver names", func(t *testing.T) {
		t.Parallel()
		raw, err := sql.Open("sqlite", ":memory:") // not used for the postgres and mysql names
		require.NoError(t, err)
		t.Cleanup(func() { _ = raw.Close() })
		for name, want := range map[string]sqldb.Dialect{"pgx": sqldb.Postgres, "pgx/v5": sqldb.Postgres, "postgres": sqldb.Postgres, "mysql": sqldb.MySQL, "sqlite3": sqldb.SQLite} {
			db, err := sqldb.New(sqlx.NewDb(raw, name))
			require.NoError(t, err, name)
			require.Equal(t, want, db.Dialect, name)
		}
	})
	t.Run("unknown driver", func(t *testing.T) {
		t.Parallel()
		raw, err := sql.Open("sqlite", ":memory:")
		require.NoError(t, err)
		t.Cleanup(func() { _ = raw.Close() })
		_, err = sqldb.New(sqlx.NewDb(raw, "oracle"))
		require.EqualError(t, err, `unsupported database driver "oracle" (want pgx, mysql or sqlite)`)
	})
	t.Run("nil", func(t *testing.T) {
		t.Parallel()
		_, err := sqldb.New(nil)
		require.EqualError(t, err, "sqldb.New: db is nil")
	})
}

func TestOpenExisting_MissingSQLiteFileIsNotCreated(t *testing.T) {
	path := filepath.Join(t.TempDir(), "typo.db")
	_, err := sqldb.OpenExisting(context.Background(), "sqlite://"+path)
	require.ErrorIs(t, err, sqldb.ErrNoDatabase)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.EqualError(t, err, "no such database: "+path)
	_, statErr := os.Stat(path)
	require.ErrorIs(t, statErr, os.ErrNotExist, "the file was created")

	created := open(t, "sqlite://"+path) // Open creates it
	require.NoError(t, created.Close())
	db, err := sqldb.OpenExisting(context.Background(), "sqlite://"+path)
	require.NoError(t, err)
	require.NoError(t, db.Close())
}

func TestTableExists(t *testing.T) {
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			db := d.Open(t)
			ctx := context.Background()
			for _, name := range []string{"onceflow_probe", "Mixed Case"} {
				ok, err := db.TableExists(ctx, name)
				require.NoError(t, err)
				require.False(t, ok, name)
				mustExec(t, db, "CREATE TABLE "+db.Dialect.Quote(name)+" (id INT)")
				ok, err = db.TableExists(ctx, name)
				require.NoError(t, err)
				require.True(t, ok, name)
			}
		})
	}
}
