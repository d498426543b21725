// Package mysql registers the MySQL and MariaDB driver of package sqldb: go-sql-driver/mysql and
// the classification of its errors by server error number. Import it for its side effect, in the
// program that opens mysql:// or mariadb:// URLs:
//
//	import _ "github.com/onceflow/onceflow/sqldb/mysql"
//
// sqldb.Open turns a mysql:// URL into a go-sql-driver DSN: the port defaults to 3306, the host
// to 127.0.0.1, the query parameters are go-sql-driver's (params: parseTime=true, ...) or
// system variables set for each connection (sql_mode=%27ANSI%27, ...), and interpolateParams
// defaults to true unless the URL sets it. The server refuses a variable it does not have,
// and sqldb.Open reports that parameter as unknown. The connect_timeout parameter is sqldb's:
// it bounds the dial and the handshake, where go-sql-driver's timeout bounds the dial alone.
package mysql

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"slices"
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
		Params:            params,
		OtherParams:       "MySQL system variables (sql_mode, time_zone, ...), set for each connection, which the server checks at connect",
		UnknownSetting:    unknownSetting,
	})
}

// params are the DSN parameters that go-sql-driver/mysql documents (v1.10); every other
// parameter is a system variable that it sets on each connection. Its strict, which it no
// longer supports, is refused: the driver panics on it.
var params = []string{
	"allowAllFiles", "allowCleartextPasswords", "allowFallbackToPlaintext", "allowNativePasswords",
	"allowOldPasswords", "charset", "checkConnLiveness", "collation", "clientFoundRows",
	"columnsWithAlias", "compress", "interpolateParams", "loc", "timeTruncate", "maxAllowedPacket",
	"multiStatements", "parseTime", "readTimeout", "rejectReadOnly", "serverPubKey", "timeout",
	"tls", "writeTimeout", "connectionAttributes",
}

// removedStrict is go-sql-driver's strict parameter, which it removed.
const removedStrict = "strict"

// unknownSetting reports the server's refusal at connect of a system variable it does not
// have (error 1193, "Unknown system variable").
func unknownSetting(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && myErr.Number == 1193
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
	q := u.Query()
	if q.Has(removedStrict) {
		return "", "", fmt.Errorf("query parameter %s: go-sql-driver/mysql no longer has it; set sql_mode instead", removedStrict)
	}
	if len(q) > 0 {
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
		return "", "", withParam(err, cfg.FormatDSN(), q)
	}
	return parsed.FormatDSN(), "", nil
}

// withParam names in err, which go-sql-driver's ParseDSN returned for base with the parameters
// q, the first of its own parameters whose value it refuses alone.
func withParam(err error, base string, q url.Values) error {
	sep := "?"
	if strings.Contains(base, "?") {
		sep = "&"
	}
	for _, k := range slices.Sorted(maps.Keys(q)) {
		one := url.Values{k: {q.Get(k)}}
		if _, perr := gomysql.ParseDSN(base + sep + one.Encode()); perr != nil {
			return fmt.Errorf("query parameter %s=%q: %w", k, q.Get(k), perr)
		}
	}
	return err
}
