package outbox

import (
	"context"
	"database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/onceflow/onceflow/sqldb"
)

// mysql is the MySQL and MariaDB dialect: watermill-sql's DefaultMySQLSchema and
// DefaultMySQLOffsetsAdapter on the tables <table> and <table>_offsets, plus a one-row table
// <table>_lock.
//
// Offsets are AUTO_INCREMENT values, allocated when a row is inserted, not when it commits.
// Were two publishing transactions to run side by side, the one with the larger offset could
// commit first, the relay would send it and record its offset, and the other's row, committed
// later below that offset, would never be sent. (Even watermill-sql's locking read at
// SERIALIZABLE waits for rows already inserted and not committed, but not for an offset
// allocated whose INSERT is still waiting for a lock, which that read's own gap lock causes.)
// So Publish first locks the row of <table>_lock (SELECT ... FOR UPDATE), and the
// transactions that publish take turns from their Publish to their commit: offsets commit in
// the order they were allocated. Publish as the processor's last step to keep the turn short;
// the rate of publishing transactions is then bounded by the commit latency, which group
// commit (several messages per transaction) divides.
//
// The relay reads at READ COMMITTED, not at the SERIALIZABLE that watermill-sql's MySQL
// adapter asks for. SERIALIZABLE makes the read lock the gap after the last row, and the relay
// holds its batch's transaction open while it sends the batch: a Publish would wait for the
// destination broker. Where the destination's consumers hold a lock of the destination while
// they publish to the outbox (the embedded SQLite queue's write lock), the relay and they wait
// for each other until the destination's ack deadline breaks the cycle. The locking read is not
// needed: the publish lock makes offsets commit in the order they were allocated, so a
// consistent read of the committed rows above the group's offset never skips one. The group's
// offsets row is still read FOR UPDATE, so the relays of a group take turns.
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

func (m *mysql) tables() (string, string) { return m.table, m.offsetsTable }

func (m *mysql) schema(batchSize int) wsql.SchemaAdapter {
	return mysqlSchema{wsql.DefaultMySQLSchema{
		GenerateMessagesTableName: func(string) string { return sqldb.MySQL.Quote(m.table) },
		SubscribeBatchSize:        batchSize,
	}}
}

// mysqlSchema is DefaultMySQLSchema read at READ COMMITTED (see mysql).
type mysqlSchema struct {
	wsql.DefaultMySQLSchema
}

// SubscribeIsolationLevel is READ COMMITTED: the relay's read locks no gap that Publish would
// wait for.
func (mysqlSchema) SubscribeIsolationLevel() sql.IsolationLevel { return sql.LevelReadCommitted }

func (m *mysql) offsets() wsql.OffsetsAdapter {
	return mysqlOffsets{
		DefaultMySQLOffsetsAdapter: wsql.DefaultMySQLOffsetsAdapter{
			GenerateMessagesOffsetsTableName: func(string) string { return sqldb.MySQL.Quote(m.offsetsTable) },
		},
		table: sqldb.MySQL.Quote(m.offsetsTable),
	}
}

// mysqlOffsets is DefaultMySQLOffsetsAdapter with the group registered before subscribing:
// without its row, the FOR UPDATE of two relays' first polls would lock only a gap, which
// both may hold at once.
type mysqlOffsets struct {
	wsql.DefaultMySQLOffsetsAdapter
	table string // quoted
}

func (a mysqlOffsets) BeforeSubscribingQueries(_, consumerGroup string) []wsql.Query {
	return []wsql.Query{{
		Query: `INSERT INTO ` + a.table + ` (consumer_group, offset_acked, offset_consumed) VALUES (?, 0, 0)
ON DUPLICATE KEY UPDATE consumer_group = consumer_group`,
		Args: []any{consumerGroup},
	}}
}

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
	return nil
}

func (m *mysql) statsQuery() string {
	t, o := sqldb.MySQL.Quote(m.table), sqldb.MySQL.Quote(m.offsetsTable)
	return "SELECT COUNT(*),\n" +
		"\tCOALESCE(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(created_at)), 0),\n" +
		"\tCOALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6)), 0)\n" +
		"FROM " + t + "\n" +
		"WHERE `offset` > COALESCE((SELECT offset_acked FROM " + o + " WHERE consumer_group = ?), 0)"
}

// purgeQuery deletes rows strictly below the smallest acknowledged offset of the registered
// groups. It keeps the last relayed row, so that MAX(offset) never falls below an acknowledged
// offset: servers that recompute AUTO_INCREMENT from MAX(offset) at start-up (MySQL before 8.0)
// would otherwise hand out offsets that the relay has already passed.
func (m *mysql) purgeQuery() string {
	t, o := sqldb.MySQL.Quote(m.table), sqldb.MySQL.Quote(m.offsetsTable)
	return "DELETE FROM " + t + " WHERE `offset` < (SELECT MIN(COALESCE(offset_acked, 0)) FROM " + o + ")" +
		" ORDER BY `offset` LIMIT ?"
}
