// Package mysql registers the MySQL and MariaDB driver of package sqldb: go-sql-driver/mysql and
// the classification of its errors by server error number. Import it for its side effect, in the
// program that opens mysql:// or mariadb:// URLs:
//
//	import _ "github.com/onceflow/onceflow/sqldb/mysql"
//
// sqldb.Open turns a mysql:// URL into a go-sql-driver DSN: the port defaults to 3306, the host
// to 127.0.0.1, the query parameters are go-sql-driver's (parseTime=true, ...) or session
// variables (sql_mode=%27ANSI%27, ...), and interpolateParams defaults to true unless the URL
// sets it. The connect_timeout parameter is sqldb's: it bounds the dial and the handshake,
// where go-sql-driver's timeout bounds the dial alone.
package mysql

import (
	"net"
	"net/url"
	"strings"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/onceflow/onceflow/sqldb"
)

func init() {
	sqldb.Register(sqldb.Driver{
		Dialect:           sqldb.MySQL,
		DriverName:        "mysql",
		DSN:               dsn,
		Classify:          classify,
		IsConnectionError: isConnectionError,
		UniqueConstraint:  constraint,
	})
}

// dsn turns a mysql:// URL into a go-sql-driver DSN.
func dsn(_ string, u *url.URL) (string, string, error) {
	cfg := gomysql.NewConfig()
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
	parsed, err := gomysql.ParseDSN(dsn)
	if err != nil {
		return "", "", err
	}
	return parsed.FormatDSN(), "", nil
}
