package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/internal/urlparam"
)

// Driver is what a driver package registers for one dialect: how to turn a URL into the DSN of
// a database/sql driver, and how to read that driver's errors. Packages sqldb/postgres,
// sqldb/mysql and sqldb/sqlite register the dialects onceflow supports in their init, as a
// database/sql driver registers itself: a program imports the ones it opens, for example
//
//	import _ "github.com/onceflow/onceflow/sqldb/postgres"
//
// and links no other database driver.
type Driver struct {
	// Dialect is the dialect of the databases the driver opens. Its URL schemes are the
	// dialect's: postgres and postgresql, mysql and mariadb, sqlite and sqlite3.
	Dialect Dialect

	// DriverName is the name the database/sql driver is registered under (pgx, mysql, sqlite).
	// It must be one that DialectOf maps to Dialect.
	DriverName string

	// DSN returns the driver's data source name for rawURL, a URL of one of the dialect's
	// schemes with its scheme in lower case, less the parameters that Open reads itself
	// (connect_timeout). For a server dialect, u is rawURL parsed; for SQLite, whose URL names
	// a file and may not parse as a URL, u is nil and path is the file. An error describes
	// what is wrong with the URL without repeating it: Open names the URL, without its
	// password.
	DSN func(rawURL string, u *url.URL) (dsn, path string, err error)

	// Classify places an error that the server or the driver reported, and reports whether
	// the error is one of the driver's: ok false passes err on to the next driver and to the
	// driver-independent checks of Classify.
	Classify func(err error) (c Class, ok bool)

	// IsConnectionError, if not nil, reports the driver's own errors for a connection that is
	// broken, closed or timed out, which Classify counts as Connection once no driver has
	// placed err by its code and err is not a context's.
	IsConnectionError func(err error) bool

	// UniqueConstraint, if not nil, returns the constraint that a unique violation of the
	// driver broke (see the package function UniqueConstraint).
	UniqueConstraint func(err error) (string, bool)

	// WriteTurn, if not nil, reports whether each transaction of a database opened with dsn
	// holds the only write lock of its file from BEGIN on (SQLite with BEGIN IMMEDIATE), and
	// how long a transaction waits for that lock (its busy timeout). Open then hands the
	// transactions of this process over the file their turns in arrival order, before BEGIN,
	// instead of leaving them to the driver's busy waiting; one that waits longer than that
	// begins without its turn, and fails or succeeds as the driver decides.
	WriteTurn func(dsn string) (wait time.Duration, ok bool)

	// Params are the query parameters that the driver documents, which DSN passes on to it.
	// Open refuses any other parameter of the URL but its own (connect_timeout), naming it and
	// listing the known ones, unless OtherParams is set.
	Params []string

	// OtherParams, when not empty, says what the driver makes of a query parameter that is
	// neither Open's nor in Params, which Open then passes on: "PostgreSQL run-time settings,
	// which the server checks at connect". The server refuses an unknown one when Open
	// connects; UnknownSetting recognises that refusal.
	OtherParams string

	// UnknownSetting, if not nil, reports whether err, the server's answer to a connect,
	// refuses a setting that the connect passed on to it as one the server does not have. Open
	// then reports the query parameter that err names, in quotes, as unknown.
	UnknownSetting func(err error) bool

	// WrapConn, if not nil, wraps each connection that Open's pools make with the driver, to
	// change how it runs statements without changing what they do (PostgreSQL sends a
	// transaction's BEGIN with its first statement). database/sql checks the optional
	// interfaces of driver.Conn on what it returns.
	WrapConn func(driver.Conn) driver.Conn

	// Listen, if not nil, makes conn listen on a notification channel, calls ready once it
	// does and notified for each notification, until ctx ends or the connection fails (see the
	// package function Listen). A failure of the connection must wrap driver.ErrBadConn, so
	// that database/sql drops it.
	Listen func(ctx context.Context, conn *sql.Conn, channel string, ready, notified func()) error
}

// dialectInfo is what sqldb knows of a dialect whether or not its driver is linked in.
type dialectInfo struct {
	dialect Dialect
	// schemes are the URL schemes of the dialect, the first one canonical.
	schemes []string
	// pkg is the package that registers the dialect's driver.
	pkg string
	// client names the driver's library, for errors.
	client string
	// file says that the URL names a local file: Open does not parse it as a server URL, and
	// there is no connect to bound.
	file bool
}

// dialects lists the dialects onceflow supports.
var dialects = []dialectInfo{
	{dialect: Postgres, schemes: []string{"postgres", "postgresql"}, pkg: "github.com/onceflow/onceflow/sqldb/postgres", client: "pgx"},
	{dialect: MySQL, schemes: []string{"mysql", "mariadb"}, pkg: "github.com/onceflow/onceflow/sqldb/mysql", client: "go-sql-driver/mysql"},
	{dialect: SQLite, schemes: []string{"sqlite", "sqlite3"}, pkg: "github.com/onceflow/onceflow/sqldb/sqlite", client: "modernc.org/sqlite", file: true},
}

const wantSchemes = "want postgres://, mysql:// or sqlite://"

// dialectOfScheme returns what sqldb knows of the dialect of a lower-case URL scheme.
func dialectOfScheme(scheme string) (dialectInfo, bool) {
	for _, d := range dialects {
		if slices.Contains(d.schemes, scheme) {
			return d, true
		}
	}
	return dialectInfo{}, false
}

var registry struct {
	sync.RWMutex
	drivers []*Driver // in the order of registration
}

// Register makes a driver available to Open and to the error classification. It panics if
// the dialect already has a driver, or if d lacks a field that is required (Dialect,
// DriverName, DSN, Classify), as database/sql's Register does: it is called from init.
func Register(d Driver) {
	if _, ok := dialectOfScheme(string(d.Dialect)); !ok {
		panic(fmt.Sprintf("sqldb: Register of unsupported dialect %q", d.Dialect))
	}
	if got, err := DialectOf(d.DriverName); err != nil || got != d.Dialect {
		panic(fmt.Sprintf("sqldb: Register of dialect %s with database/sql driver name %q", d.Dialect, d.DriverName))
	}
	if d.DSN == nil || d.Classify == nil {
		panic(fmt.Sprintf("sqldb: Register of dialect %s without DSN or Classify", d.Dialect))
	}
	registry.Lock()
	defer registry.Unlock()
	for _, r := range registry.drivers {
		if r.Dialect == d.Dialect {
			panic(fmt.Sprintf("sqldb: Register called twice for dialect %s", d.Dialect))
		}
	}
	registry.drivers = append(registry.drivers, &d)
}

// drivers returns the registered drivers.
func drivers() []*Driver {
	registry.RLock()
	defer registry.RUnlock()
	return registry.drivers
}

// params returns the table of the query parameters of a URL of d's dialect: Open's own, then
// the driver's.
func (d *Driver) params(info dialectInfo) urlparam.Table {
	t := urlparam.Table{Scheme: info.schemes[0], Others: d.OtherParams}
	t.Groups = append(t.Groups, urlparam.Group{Reader: "sqldb", Names: []string{connect.Param}})
	if len(d.Params) > 0 {
		t.Groups = append(t.Groups, urlparam.Group{Reader: info.client, Names: d.Params})
	}
	return t
}

// driverOf returns the registered driver of dialect d, or an error naming the package that
// registers it.
func driverOf(d dialectInfo) (*Driver, error) {
	for _, r := range drivers() {
		if r.Dialect == d.dialect {
			return r, nil
		}
	}
	return nil, fmt.Errorf("no %s driver is registered: import _ %q", d.dialect, d.pkg)
}

// lowerScheme returns rawURL with its scheme in lower case.
func lowerScheme(rawURL string) string {
	scheme, rest, _ := strings.Cut(rawURL, ":")
	return strings.ToLower(scheme) + ":" + rest
}
