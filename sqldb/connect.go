package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"io"
	"net/url"
	"strings"
	"time"

	"github.com/onceflow/onceflow/internal/connect"
)

// DefaultConnectTimeout bounds each connect to a PostgreSQL or MySQL server, from the TCP dial
// to the end of the handshake and authentication, when the URL has no connect_timeout
// parameter; Open's first connect and check are bounded by it too.
const DefaultConnectTimeout = connect.DefaultTimeout

// cutParam returns rawURL without the query parameter name, the last value it had, and
// whether it had one. The rest of the URL is kept as written, so that the driver reads the
// same text as it would have without the parameter.
func cutParam(rawURL, name string) (rest, value string, found bool, err error) {
	base, query, ok := strings.Cut(rawURL, "?")
	if !ok {
		return rawURL, "", false, nil
	}
	query, fragment, hasFragment := strings.Cut(query, "#")
	var kept []string
	for _, kv := range strings.Split(query, "&") {
		k, v, _ := strings.Cut(kv, "=")
		if uk, err := url.QueryUnescape(k); err != nil || uk != name {
			kept = append(kept, kv)
			continue
		}
		if value, err = url.QueryUnescape(v); err != nil {
			return "", "", false, fmt.Errorf("malformed query: %s: invalid URL escape", name)
		}
		found = true
	}
	if !found {
		return rawURL, "", false, nil
	}
	rest = base
	if len(kept) > 0 {
		rest += "?" + strings.Join(kept, "&")
	}
	if hasFragment {
		rest += "#" + fragment
	}
	return rest, value, true, nil
}

// connectorOf returns the connector that database/sql would use for driverName and dsn.
func connectorOf(driverName, dsn string) (driver.Connector, error) {
	db, err := sql.Open(driverName, dsn) // opens no connection
	if err != nil {
		return nil, err
	}
	d := db.Driver()
	_ = db.Close()
	if dc, ok := d.(driver.DriverContext); ok {
		return dc.OpenConnector(dsn)
	}
	return dsnConnector{driver: d, dsn: dsn}, nil
}

// dsnConnector is the connector of a driver that has no connectors of its own.
type dsnConnector struct {
	driver driver.Driver
	dsn    string
}

func (c dsnConnector) Connect(context.Context) (driver.Conn, error) { return c.driver.Open(c.dsn) }
func (c dsnConnector) Driver() driver.Driver                        { return c.driver }

// boundedConnector bounds each connect of the connector it wraps: the drivers (pgx,
// go-sql-driver) watch the context through the TCP dial, the TLS and protocol handshakes and
// the authentication, so a server that accepts a connection and never answers costs at most
// timeout, for Open's first connection as for every later one of the pool.
type boundedConnector struct {
	driver.Connector
	timeout time.Duration
}

func (c boundedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	return c.Connector.Connect(ctx)
}

// Close closes the wrapped connector if it has anything to close; database/sql calls it when
// the pool closes.
func (c boundedConnector) Close() error { return closeConnector(c.Connector) }

// closeConnector closes c if it has anything to close.
func closeConnector(c driver.Connector) error {
	if cl, ok := c.(io.Closer); ok {
		return cl.Close()
	}
	return nil
}

// wrappingConnector wraps each connection of the connector it wraps (Driver.WrapConn).
type wrappingConnector struct {
	driver.Connector
	wrap func(driver.Conn) driver.Conn
}

func (c wrappingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	dc, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return c.wrap(dc), nil
}

// Close closes the wrapped connector if it has anything to close.
func (c wrappingConnector) Close() error { return closeConnector(c.Connector) }
