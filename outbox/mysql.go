package outbox

import (
	"context"
	"errors"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/sqldb"
)

// mysql is the MySQL and MariaDB dialect: tables laid out as watermill-sql's
// DefaultMySQLSchema and offsets adapter, <table> and <table>_offsets, the relays' leases in
// <table>_leases (broker/sqlqueue's layout), plus a one-row table <table>_lock.
//
// Offsets are AUTO_INCREMENT values, allocated when a row is inserted, not when it commits.
// Were two publishing transactions to run side by side, the one with the larger offset could
// commit first, a relay would claim it and move the group's cursor past it, and the other's
// row, committed later below the cursor, would never be sent. (A locking read waits for rows
// already inserted and not committed, but not for an offset allocated whose INSERT has not
// placed its row yet.) So Publish first locks the row of <table>_lock (SELECT ... FOR UPDATE),
// and the transactions that publish take turns from their Publish to their commit: offsets
// commit in the order they were allocated. Publish as the processor's last step to keep the
// turn short; the rate of publishing transactions is then bounded by the commit latency, which
// group commit (several messages per transaction) divides.
//
// The relays claim at READ COMMITTED in short transactions of their own and hold none while
// they send, so a Publish never waits for the destination broker.
type mysql struct {
	table, offsetsTable, lockTable string
}

func newMySQL(table string) *mysql {
	return &mysql{table: table, offsetsTable: table + offsetsSuffix, lockTable: table + lockSuffix}
}

// lockSuffix makes the name of the MySQL lock table from the outbox's name; it is shorter than
// offsetsSuffix, which bounds the outbox's name.
const lockSuffix = "_lock"

func (m *mysql) publishLock() string {
	return `SELECT id FROM ` + sqldb.MySQL.Quote(m.lockTable) + ` WHERE id = 1 FOR UPDATE`
}

// notify is empty: nothing tells another session that a MySQL transaction committed. The
// Outbox wakes the relays of its own process instead (see Relay).
func (m *mysql) notify() string { return "" }

func (m *mysql) tables() (string, string) { return m.table, m.offsetsTable }

// queueTables are the outbox's tables as broker/sqlqueue names a topic's.
func (m *mysql) queueTables() sqlqueue.Tables {
	return sqlqueue.Tables{Messages: m.table, Offsets: m.offsetsTable, Leases: m.table + leasesSuffix, DueIndex: m.table + "_due"}
}

func (m *mysql) insertSchema() wsql.SchemaAdapter {
	return wsql.DefaultMySQLSchema{
		GenerateMessagesTableName: func(string) string { return sqldb.MySQL.Quote(m.table) },
	}
}

func (m *mysql) newSource(cfg RelayConfig) (source, error) { return newSQLSource(cfg, m.queueTables()) }

func (m *mysql) migrate(ctx context.Context, db *sqldb.DB) error {
	t, o, l := sqldb.MySQL.Quote(m.table), sqldb.MySQL.Quote(m.offsetsTable), sqldb.MySQL.Quote(m.lockTable)
	// The columns are those of watermill-sql's DefaultMySQLSchema and
	// DefaultMySQLOffsetsAdapter, except: created_at is a UTC DATETIME(6) (TIMESTAMP ends in
	// 2038 and has whole seconds), payload and metadata are binary (MySQL 8 refuses to build a
	// JSON value from the binary strings the driver sends), and consumer groups compare
	// byte by byte. Concurrent CREATE TABLE IF NOT EXISTS statements are serialised by the
	// metadata lock on the name; each commits implicitly, so they do not share a transaction.
	for _, stmt := range []string{
		`CREATE TABLE IF NOT EXISTS ` + t + ` (
	` + "`offset`" + `     BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
	` + "`uuid`" + `       VARCHAR(36) NOT NULL,
	` + "`created_at`" + ` DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
	` + "`payload`" + `    LONGBLOB DEFAULT NULL,
	` + "`metadata`" + `   BLOB DEFAULT NULL
) ENGINE=InnoDB`,
		`CREATE TABLE IF NOT EXISTS ` + o + ` (
	consumer_group  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
	offset_acked    BIGINT,
	offset_consumed BIGINT NOT NULL,
	PRIMARY KEY (consumer_group)
) ENGINE=InnoDB`,
		`CREATE TABLE IF NOT EXISTS ` + l + ` (id TINYINT NOT NULL PRIMARY KEY) ENGINE=InnoDB`,
		`INSERT INTO ` + l + ` (id) VALUES (1) ON DUPLICATE KEY UPDATE id = id`,
	} {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	return createQueueTables(ctx, db, m.queueTables())
}

// stats counts the rows after the group's cursor and the rows it has leased.
func (m *mysql) stats(group string) (string, []any) {
	t, o, l := sqldb.MySQL.Quote(m.table), sqldb.MySQL.Quote(m.offsetsTable), sqldb.MySQL.Quote(m.table+leasesSuffix)
	return "SELECT COUNT(*),\n" +
			"\tCOALESCE(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(created_at)), 0),\n" +
			"\tCOALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)), 0)\n" +
			"FROM " + t + "\n" +
			"WHERE `offset` > COALESCE((SELECT offset_acked FROM " + o + " WHERE consumer_group = ?), 0)\n" +
			"\tOR `offset` IN (SELECT `offset` FROM " + l + " WHERE consumer_group = ?)",
		[]any{group, group}
}

// purgeQuery deletes rows strictly below the smallest cursor of the registered groups that no
// group has leased. It keeps the last row a cursor passed, so that MAX(offset) never falls
// below a cursor: servers that recompute AUTO_INCREMENT from MAX(offset) at start-up (MySQL
// before 8.0) would otherwise hand out offsets that the relays have already passed.
func (m *mysql) purgeQuery() string {
	t, o, l := sqldb.MySQL.Quote(m.table), sqldb.MySQL.Quote(m.offsetsTable), sqldb.MySQL.Quote(m.table+leasesSuffix)
	return "DELETE FROM " + t + " WHERE `offset` < (SELECT MIN(COALESCE(offset_acked, 0)) FROM " + o + ")" +
		" AND `offset` NOT IN (SELECT `offset` FROM " + l + ")" +
		" ORDER BY `offset` LIMIT ?"
}

// myPurgeLock names the server-wide lock of the outbox's purge ($1 the outbox) in the current
// database, in at most 64 characters.
const myPurgeLock = `CONCAT('onceflow_outbox_purge_', SUBSTR(SHA1(CONCAT(COALESCE(DATABASE(), ''), '.', ?)), 1, 32))`

// purgeLock takes a named lock (GET_LOCK) on a connection of its own, which unlock releases
// and closes. A process that dies loses its session, and the lock with it.
func (m *mysql) purgeLock(ctx context.Context, db *sqldb.DB) (func(), bool, error) {
	conn, err := db.DB.DB.Conn(ctx)
	if err != nil {
		return nil, false, err
	}
	var held *int64 // NULL on an error of the server
	if err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(`+myPurgeLock+`, 0)`, m.table).Scan(&held); err != nil || held == nil || *held != 1 {
		if err == nil && held == nil {
			err = errors.New("GET_LOCK returned NULL")
		}
		return nil, false, errors.Join(err, conn.Close())
	}
	return func() {
		_, _ = conn.ExecContext(context.Background(), `SELECT RELEASE_LOCK(`+myPurgeLock+`)`, m.table)
		_ = conn.Close()
	}, true, nil
}
