package sqldb_test

import (
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
	_ "github.com/onceflow/onceflow/sqldb/sqlite"
)

// These tests read the DSN that Open hands to the driver; the tests of Open open the same URLs
// against the real databases.

func TestParseURL_PostgresIsPassedToPgx(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in, dsn, redacted string
	}{
		{"postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
			"postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
			"postgres://postgres@127.0.0.1:5432/test?sslmode=disable"},
		{"postgresql://app:s3cr%40t@db.internal/orders?application_name=onceflow",
			"postgresql://app:s3cr%40t@db.internal/orders?application_name=onceflow",
			"postgresql://app:xxxxx@db.internal/orders?application_name=onceflow"},
		{"POSTGRES://app@db.internal/orders", "postgres://app@db.internal/orders", "postgres://app@db.internal/orders"},
		{"postgres://app@db.internal/orders?password=s3cret&sslmode=disable",
			"postgres://app@db.internal/orders?password=s3cret&sslmode=disable",
			"postgres://app@db.internal/orders?password=xxxxx&sslmode=disable"},
		{"postgres:///orders?host=/var/run/postgresql", "postgres:///orders?host=/var/run/postgresql", "postgres:///orders?host=/var/run/postgresql"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			t.Parallel()
			driverName, dsn, path, redacted, _, err := sqldb.ParseURL(tc.in)
			require.NoError(t, err)
			require.Equal(t, "pgx", driverName)
			require.Equal(t, tc.dsn, dsn)
			require.Empty(t, path)
			require.Equal(t, tc.redacted, redacted)
		})
	}
}

func TestParseURL_MySQLBecomesDriverDSN(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in, redacted string
		check              func(t *testing.T, cfg *mysql.Config)
	}{
		{"with port", "mysql://root@127.0.0.1:3306/test", "mysql://root@127.0.0.1:3306/test", func(t *testing.T, cfg *mysql.Config) {
			require.Equal(t, "tcp", cfg.Net)
			require.Equal(t, "127.0.0.1:3306", cfg.Addr)
			require.Equal(t, "root", cfg.User)
			require.Empty(t, cfg.Passwd)
			require.Equal(t, "test", cfg.DBName)
			require.True(t, cfg.InterpolateParams)
			require.Empty(t, cfg.Params)
		}},
		{"without port", "mysql://app@db.internal/orders", "mysql://app@db.internal/orders", func(t *testing.T, cfg *mysql.Config) {
			require.Equal(t, "db.internal:3306", cfg.Addr)
			require.Equal(t, "orders", cfg.DBName)
		}},
		{"IPv6 without port", "mariadb://app@[::1]/orders", "mariadb://app@[::1]/orders", func(t *testing.T, cfg *mysql.Config) {
			require.Equal(t, "[::1]:3306", cfg.Addr)
		}},
		{"without host", "mysql:///orders", "mysql:///orders", func(t *testing.T, cfg *mysql.Config) {
			require.Equal(t, "127.0.0.1:3306", cfg.Addr)
			require.Empty(t, cfg.User)
		}},
		{"without database", "mysql://app@db.internal:3307", "mysql://app@db.internal:3307", func(t *testing.T, cfg *mysql.Config) {
			require.Equal(t, "db.internal:3307", cfg.Addr)
			require.Empty(t, cfg.DBName)
		}},
		{"password with special characters", "mysql://app:p%40ss%3Aw%2Frd%3F%23%25%26%20%C3%BC@db.internal/orders",
			"mysql://app:xxxxx@db.internal/orders", func(t *testing.T, cfg *mysql.Config) {
				require.Equal(t, "app", cfg.User)
				require.Equal(t, "p@ss:w/rd?#%& ü", cfg.Passwd)
				require.Equal(t, "db.internal:3306", cfg.Addr)
				require.Equal(t, "orders", cfg.DBName)
			}},
		{"driver and session parameters", "mysql://app@db.internal/orders?parseTime=true&timeout=5s&sql_mode=%27ANSI_QUOTES%27&loc=Europe%2FBerlin",
			"mysql://app@db.internal/orders?parseTime=true&timeout=5s&sql_mode=%27ANSI_QUOTES%27&loc=Europe%2FBerlin", func(t *testing.T, cfg *mysql.Config) {
				require.True(t, cfg.ParseTime)
				require.Equal(t, 5*time.Second, cfg.Timeout)
				require.Equal(t, "Europe/Berlin", cfg.Loc.String())
				require.Equal(t, map[string]string{"sql_mode": "'ANSI_QUOTES'"}, cfg.Params)
				require.True(t, cfg.InterpolateParams)
			}},
		{"interpolateParams=false", "mysql://app@db.internal/orders?interpolateParams=false", "mysql://app@db.internal/orders?interpolateParams=false", func(t *testing.T, cfg *mysql.Config) {
			require.False(t, cfg.InterpolateParams)
			require.Empty(t, cfg.Params)
		}},
		{"interpolateParams=0", "mysql://app@db.internal/orders?interpolateParams=0", "mysql://app@db.internal/orders?interpolateParams=0", func(t *testing.T, cfg *mysql.Config) {
			require.False(t, cfg.InterpolateParams)
		}},
		{"interpolateParams=true", "mysql://app@db.internal/orders?interpolateParams=true", "mysql://app@db.internal/orders?interpolateParams=true", func(t *testing.T, cfg *mysql.Config) {
			require.True(t, cfg.InterpolateParams)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			driverName, dsn, path, redacted, _, err := sqldb.ParseURL(tc.in)
			require.NoError(t, err)
			require.Equal(t, "mysql", driverName)
			require.Empty(t, path)
			require.Equal(t, tc.redacted, redacted)
			cfg, err := mysql.ParseDSN(dsn)
			require.NoError(t, err)
			tc.check(t, cfg)
		})
	}
}

func TestParseURL_SQLiteDefaultsAndOverrides(t *testing.T) {
	t.Parallel()
	defaults := []string{"busy_timeout(30000)", "journal_mode(WAL)", "synchronous(FULL)", "foreign_keys(1)", "temp_store(MEMORY)", "wal_autocheckpoint(4000)"}
	for _, tc := range []struct {
		name, in, path, file string
		params               url.Values
	}{
		{"relative", "sqlite://data/app.db", "data/app.db", "data/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": defaults}},
		{"relative without slashes", "sqlite:app.db", "app.db", "app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": defaults}},
		{"absolute", "sqlite:///var/lib/onceflow/app.db", "/var/lib/onceflow/app.db", "/var/lib/onceflow/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": defaults}},
		{"sqlite3 scheme", "sqlite3:///var/lib/onceflow/app.db", "/var/lib/onceflow/app.db", "/var/lib/onceflow/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": defaults}},
		{"escaped path", "sqlite:///tmp/my%20app%231%3F%25.db", "/tmp/my app#1?%.db", "/tmp/my%20app%231%3F%25.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": defaults}},
		{"extra pragma", "sqlite:///tmp/app.db?_pragma=cache_size(-4000)", "/tmp/app.db", "/tmp/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": append(append([]string{}, defaults...), "cache_size(-4000)")}},
		{"pragmas replace defaults", "sqlite:///tmp/app.db?_pragma=busy_timeout(10)&_pragma=Synchronous+%3D+NORMAL", "/tmp/app.db", "/tmp/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": {"journal_mode(WAL)", "foreign_keys(1)", "temp_store(MEMORY)", "wal_autocheckpoint(4000)", "busy_timeout(10)", "Synchronous = NORMAL"}}},
		{"shorthand replaces default", "sqlite:///tmp/app.db?_busy_timeout=10&_fk=0", "/tmp/app.db", "/tmp/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": {"journal_mode(WAL)", "synchronous(FULL)", "temp_store(MEMORY)", "wal_autocheckpoint(4000)"}, "_busy_timeout": {"10"}, "_fk": {"0"}}},
		{"txlock", "sqlite:///tmp/app.db?_txlock=deferred", "/tmp/app.db", "/tmp/app.db",
			url.Values{"_txlock": {"deferred"}, "_pragma": defaults}},
		{"driver parameter", "sqlite:///tmp/app.db?_time_format=sqlite", "/tmp/app.db", "/tmp/app.db",
			url.Values{"_txlock": {"immediate"}, "_pragma": defaults, "_time_format": {"sqlite"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			driverName, dsn, path, redacted, _, err := sqldb.ParseURL(tc.in)
			require.NoError(t, err)
			require.Equal(t, "sqlite", driverName)
			require.Equal(t, tc.path, path)
			require.Equal(t, "sqlite://"+tc.path, redacted)
			file, query, ok := strings.Cut(dsn, "?")
			require.True(t, ok, dsn)
			require.Equal(t, "file:"+tc.file, file)
			params, err := url.ParseQuery(query)
			require.NoError(t, err)
			require.Equal(t, tc.params, params)
		})
	}
}

func TestParseURL_ErrorsNameTheProblem(t *testing.T) {
	t.Parallel()
	const want = "(want postgres://, mysql:// or sqlite://)"
	for _, tc := range []struct {
		in, err string
	}{
		{"", "database URL is empty " + want},
		{"  ", "database URL is empty " + want},
		{"/var/lib/onceflow/app.db", `database URL "/var/lib/onceflow/app.db" has no scheme ` + want},
		{"127.0.0.1:5432", `database URL "(malformed URL)" has no scheme ` + want},
		{"redis://127.0.0.1:6379/0", `database URL "redis://127.0.0.1:6379/0": unknown scheme "redis" ` + want},
		{"oracle://scott:tiger@db/orcl", `database URL "oracle://scott:xxxxx@db/orcl": unknown scheme "oracle" ` + want},
		{"sqlite://", `database URL "sqlite:": names no file`},
		{"sqlite:///tmp/app%zz.db", `database URL "sqlite://(malformed URL)": malformed path: invalid URL escape "%zz"`},
		{"sqlite:///tmp/app.db?_pragma=%zz", `database URL "sqlite:///tmp/app.db?_pragma=%zz": malformed query: invalid URL escape "%zz"`},
		{"postgres://db.internal:port/orders", `malformed database URL "postgres://(malformed URL)": invalid port ":port" after host`},
		{"postgres://app:pa ss@db.internal/orders", `malformed database URL "postgres://(malformed URL)": check that special characters in the user name and password are percent-encoded`},
		{"postgres://app:pass/word@db.internal/orders", `malformed database URL "postgres://(malformed URL)": '@' after the host; percent-encode '@', '/', '?' and '#' in the user name and password (%40, %2F, %3F, %23)`},
		{"mysql:db.internal/orders", `malformed database URL "mysql:db.internal/orders": want mysql://[user[:password]@]host[:port]/database`},
		{"mysql://app@db.internal/orders?interpolateParams=maybe", `database URL "mysql://app@db.internal/orders?interpolateParams=maybe": query parameter interpolateParams="maybe": invalid bool value: maybe`},
		{"mysql://app@db.internal/orders?strict=true", `database URL "mysql://app@db.internal/orders?strict=true": query parameter strict: go-sql-driver/mysql no longer has it; set sql_mode instead`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			t.Parallel()
			_, _, _, _, _, err := sqldb.ParseURL(tc.in)
			require.EqualError(t, err, tc.err)
		})
	}
}

// A query parameter that neither sqldb nor the driver reads is refused, named, with the known
// ones listed; on PostgreSQL and MySQL the parameters the driver does not document are server
// settings, which the server checks (TestOpen_UnknownSettingIsNamed).
func TestParseURL_UnknownParameterIsNamed(t *testing.T) {
	t.Parallel()
	_, _, _, _, _, err := sqldb.ParseURL("sqlite:///tmp/app.db?_pragma=busy_timeout(10)&busy_timeout=10")
	require.EqualError(t, err, `database URL "sqlite:///tmp/app.db?_pragma=busy_timeout(10)&busy_timeout=10": unknown query parameter "busy_timeout" (sqlite:// takes sqldb's connect_timeout; modernc.org/sqlite's _pragma, _busy_timeout, _timeout, _auto_vacuum, _vacuum, _foreign_keys, _fk, _journal_mode, _journal, _synchronous, _sync, _query_only, _time_format, _time_integer_format, _timezone, _txlock, _inttotime, _texttotime, _dqs, _defensive, _error_rc, vfs, mode, cache, immutable, nolock, psow, modeof)`)

	for _, ok := range []string{
		"sqlite:///tmp/app.db?_txlock=deferred&mode=rwc&connect_timeout=1s",
		"postgres://app@db.internal/orders?sslmode=disable&application_name=x&search_path=s",
		"mysql://app@db.internal/orders?parseTime=true&sql_mode=ANSI",
	} {
		_, _, _, _, _, err := sqldb.ParseURL(ok)
		require.NoError(t, err, ok)
	}
}
