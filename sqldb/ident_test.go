package sqldb_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/sqldb"
)

func TestValidIdentifier(t *testing.T) {
	t.Parallel()
	for _, name := range []string{
		"message_log", "_private", "MessageLog", "t1", "order", "select", "x",
		"a" + strings.Repeat("b", 62), // 63 characters, PostgreSQL's limit
	} {
		require.True(t, sqldb.ValidIdentifier(name), "%q", name)
		require.NoError(t, sqldb.CheckIdentifier("Config.Table", name))
	}
}

func TestCheckIdentifier_RejectsInjectionAndOddNames(t *testing.T) {
	t.Parallel()
	for _, name := range []string{
		"",
		"message_log; DROP TABLE users",
		"message_log--",
		"message_log/*",
		`message_log"`,
		`"message_log"`,
		"message_log`",
		"`message_log`",
		"message_log'",
		"[message_log]",
		"public.message_log",
		"message log",
		"message_log\n",
		"message_log\x00",
		"1message_log",
		"$1",
		"?",
		"message-log",
		"mëssage_log",
		"a" + strings.Repeat("b", 63), // 64 characters
	} {
		require.False(t, sqldb.ValidIdentifier(name), "%q", name)
		err := sqldb.CheckIdentifier("Dedup.Table", name)
		require.EqualError(t, err, "Dedup.Table: "+strconv.Quote(name)+" is not a plain SQL identifier (letters, digits and underscores, starting with a letter or underscore, at most 63 characters)")
	}
}

func TestDialect_Quote(t *testing.T) {
	t.Parallel()
	require.Equal(t, `"message_log"`, sqldb.Postgres.Quote("message_log"))
	require.Equal(t, "`message_log`", sqldb.MySQL.Quote("message_log"))
	require.Equal(t, `"message_log"`, sqldb.SQLite.Quote("message_log"))

	// A name that slipped past CheckIdentifier still stays one identifier.
	require.Equal(t, `"t""; DROP TABLE users; --"`, sqldb.Postgres.Quote(`t"; DROP TABLE users; --`))
	require.Equal(t, `"t""; DROP TABLE users; --"`, sqldb.SQLite.Quote(`t"; DROP TABLE users; --`))
	require.Equal(t, "`t``; DROP TABLE users; --`", sqldb.MySQL.Quote("t`; DROP TABLE users; --"))
}

// TestDialect_QuoteKeepsAnInjectionInsideTheName quotes names that carry an injection attempt
// and runs them: each creates one table with that odd name and drops nothing.
func TestDialect_QuoteKeepsAnInjectionInsideTheName(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			mustExec(t, db, "CREATE TABLE victim (id INT PRIMARY KEY)")
			for _, name := range []string{`t"; DROP TABLE victim; --`, "t`; DROP TABLE victim; --"} {
				mustExec(t, db, "CREATE TABLE "+db.Dialect.Quote(name)+" (id INT PRIMARY KEY)")
				mustExec(t, db, "INSERT INTO "+db.Dialect.Quote(name)+" (id) VALUES (1)")
				require.Equal(t, 1, count(t, db, "SELECT COUNT(*) FROM "+db.Dialect.Quote(name)))
			}
			require.Equal(t, 0, count(t, db, "SELECT COUNT(*) FROM victim"))
		})
	}
}

// TestDialect_QuoteMakesReservedWordsUsable runs quoted identifiers on every database: a table
// and a column named by SQL keywords, and a mixed-case name that must keep its case.
func TestDialect_QuoteMakesReservedWordsUsable(t *testing.T) {
	t.Parallel()
	for _, d := range testsvc.Databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			db := d.Open(t)
			q := db.Dialect.Quote
			mustExec(t, db, "CREATE TABLE "+q("order")+" ("+q("select")+" INT PRIMARY KEY, "+q("MessageID")+" VARCHAR(10))")
			mustExec(t, db, "INSERT INTO "+q("order")+" ("+q("select")+", "+q("MessageID")+") VALUES (?, ?)", 1, "m1")
			var id string
			require.NoError(t, db.QueryRowxContext(context.Background(),
				db.Rebind("SELECT "+q("MessageID")+" FROM "+q("order")+" WHERE "+q("select")+" = ?"), 1).Scan(&id))
			require.Equal(t, "m1", id)
		})
	}
}
