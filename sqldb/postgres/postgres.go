// Package postgres registers the PostgreSQL driver of package sqldb: pgx's database/sql driver
// (github.com/jackc/pgx/v5/stdlib) and the classification of its errors by SQLSTATE. Import it
// for its side effect, in the program that opens postgres:// URLs:
//
//	import _ "github.com/onceflow/onceflow/sqldb/postgres"
//
// sqldb.Open passes a postgres:// or postgresql:// URL to pgx as it is, less the
// connect_timeout parameter, which sqldb reads itself: the other query parameters are pgx's
// (params: sslmode, target_session_attrs, ...) or PostgreSQL run-time settings
// (application_name, search_path, ...), which pgx sends to the server at connect. The server
// refuses a setting it does not have, and sqldb.Open reports that parameter as unknown.
//
// The connections of sqldb.Open's pools send a transaction's BEGIN together with its first
// statement run by Exec, one round trip where pgx's driver takes two; a first query or
// prepare sends BEGIN alone before it, and a transaction that runs no statement is never
// begun on the server. Isolation levels and read-only transactions are kept.
package postgres

import (
	"errors"
	"net/url"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver

	"github.com/onceflow/onceflow/sqldb"
)

// params are the query parameters that pgx reads itself (pgconn.ParseConfig's and
// pgx.ParseConfig's, v5.13), less connect_timeout, which sqldb reads; every other parameter
// is a run-time setting that pgx sends to the server.
var params = []string{
	"host", "port", "database", "user", "password", "passfile",
	"sslmode", "sslkey", "sslcert", "sslcertmode", "sslrootcert", "sslnegotiation", "sslpassword", "sslsni",
	"krbspn", "krbsrvname", "target_session_attrs", "service", "servicefile",
	"min_protocol_version", "max_protocol_version", "channel_binding", "require_auth",
	"statement_cache_capacity", "description_cache_capacity", "default_query_exec_mode",
}

// unknownSetting reports the server's refusal at connect of a run-time setting it does not
// have (SQLSTATE 42704, "unrecognized configuration parameter").
func unknownSetting(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedObject
}

func init() {
	sqldb.Register(sqldb.Driver{
		Dialect:           sqldb.Postgres,
		DriverName:        "pgx",
		DSN:               dsn,
		Classify:          classify,
		IsConnectionError: isConnectionError,
		UniqueConstraint:  constraint,
		WrapConn:          wrapConn,
		Listen:            listen,
		Params:            params,
		OtherParams:       "PostgreSQL run-time settings (application_name, search_path, ...), which the server checks at connect",
		UnknownSetting:    unknownSetting,
	})
}

// dsn returns the URL itself: pgx reads postgres:// URLs.
func dsn(rawURL string, _ *url.URL) (string, string, error) { return rawURL, "", nil }
