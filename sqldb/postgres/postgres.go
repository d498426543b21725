// Package postgres registers the PostgreSQL driver of package sqldb: pgx's database/sql driver
// (github.com/jackc/pgx/v5/stdlib) and the classification of its errors by SQLSTATE. Import it
// for its side effect, in the program that opens postgres:// URLs:
//
//	import _ "github.com/onceflow/onceflow/sqldb/postgres"
//
// sqldb.Open passes a postgres:// or postgresql:// URL to pgx as it is, less the
// connect_timeout parameter, which sqldb reads itself: the other query parameters are libpq's
// and pgx's (sslmode, application_name, ...).
package postgres

import (
	"net/url"

	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver

	"github.com/onceflow/onceflow/sqldb"
)

func init() {
	sqldb.Register(sqldb.Driver{
		Dialect:           sqldb.Postgres,
		DriverName:        "pgx",
		DSN:               dsn,
		Classify:          classify,
		IsConnectionError: isConnectionError,
		UniqueConstraint:  constraint,
		Listen:            listen,
	})
}

// dsn returns the URL itself: pgx reads postgres:// URLs.
func dsn(rawURL string, _ *url.URL) (string, string, error) { return rawURL, "", nil }
