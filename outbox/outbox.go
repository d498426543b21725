package outbox

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/onceflow/onceflow/internal/telemetry"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// DefaultTable is the name of an outbox whose Config.Table is empty.
const DefaultTable = "onceflow_outbox"

// offsetsSuffix and leasesSuffix make the names of the offsets and leases tables from the
// outbox's name on PostgreSQL and MySQL.
const (
	offsetsSuffix = "_offsets"
	leasesSuffix  = "_leases"
)

// MaxTableLen is the longest Config.Table: the offsets table's name, Table + "_offsets", must
// fit PostgreSQL's 63-character identifiers.
const MaxTableLen = 63 - len(offsetsSuffix)

// maxMessagesPerInsert bounds the rows of one INSERT, well below every dialect's limit on
// parameters (three per message).
const maxMessagesPerInsert = 1000

// ErrNoTransaction reports a Publish whose context carries no transaction: the outbox row
// would not commit or roll back with the business writes, so Publish refuses to write it.
// It is middleware.ErrNoTransaction.
var ErrNoTransaction = middleware.ErrNoTransaction

// Config configures an Outbox. The zero value is valid.
type Config struct {
	// Table names the outbox: the watermill-sql topic whose tables hold its messages. It must
	// be a plain SQL identifier (see sqldb.CheckIdentifier) of at most MaxTableLen characters.
	// The tables are <Table>, <Table>_offsets and <Table>_leases on PostgreSQL and MySQL (plus
	// the one-row <Table>_lock on MySQL), and the embedded queue's onceflow_queue_<Table>,
	// onceflow_offsets_<Table> and onceflow_leases_<Table> on SQLite. Defaults to
	// DefaultTable.
	Table string

	// NotifyInTransaction makes Publish, on PostgreSQL, issue its notification to the relays
	// (pg_notify) inside the transaction, so that the database delivers it exactly when the
	// transaction commits. By default Publish announces the coming commit from outside the
	// transaction instead, and the relays look for it until it is visible (see Relay): a
	// millisecond or two later, but without the cost of a notifying transaction. PostgreSQL
	// serialises the commits of transactions that notify (a lock held through the commit), so
	// that concurrent publishing transactions commit one at a time: measured on loopback with 8
	// concurrent writers, 4,000 to 6,200 commits/s without a notification in the transaction,
	// 750 to 1,230 with one. Set it where transactions that publish are few, or batched by
	// group commit. Other dialects ignore it.
	NotifyInTransaction bool

	// Propagator writes the trace context of Publish's ctx into each message's metadata (the
	// W3C traceparent and tracestate headers with a propagation.TraceContext), so that the
	// trace continues in the consumers of the destination broker. Defaults to the global
	// propagator, otel.GetTextMapPropagator(), read at each Publish; the global default
	// propagates nothing until the application sets one.
	Propagator propagation.TextMapPropagator
}

// Validate reports the first invalid field of c, by name.
func (c Config) Validate() error {
	if c.Table == "" {
		return nil
	}
	if err := sqldb.CheckIdentifier("Table", c.Table); err != nil {
		return err
	}
	if len(c.Table) > MaxTableLen {
		return fmt.Errorf("Table: %q has %d characters, more than %d (the offsets table's name adds %q)", c.Table, len(c.Table), MaxTableLen, offsetsSuffix)
	}
	return nil
}

// Outbox writes outgoing messages into a table of the application database, in the
// transaction of the business writes, for a Relay to send to the destination broker. It is
// safe for concurrent use; build one per database and table and share it.
type Outbox struct {
	db         *sqldb.DB
	table      string
	d          dialect
	insert     wsql.SchemaAdapter
	propagator propagation.TextMapPropagator
	// local names the outbox among the relays of this process that Publish wakes.
	local string
	// notifyInTx is the statement that Publish runs in the transaction to notify the relays,
	// or "".
	notifyInTx string
	// announcer notifies the relays of other processes, from outside the transaction; nil
	// when the dialect cannot or notifyInTx does.
	announcer *announcer
}

// New returns the outbox of cfg.Table on db, whose Dialect chooses the SQL. It does not touch
// the database: call Migrate (or register it with Router.AddMigration) before the first
// Publish.
func New(db *sqldb.DB, cfg Config) (*Outbox, error) {
	if db == nil || db.DB == nil {
		return nil, errors.New("outbox.New: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("outbox.New: %w", err)
	}
	table := cmp.Or(cfg.Table, DefaultTable)
	d, err := newDialect(db.Dialect, table)
	if err != nil {
		return nil, fmt.Errorf("outbox.New: db.Dialect: %w", err)
	}
	o := &Outbox{db: db, table: table, d: d, insert: d.insertSchema(), propagator: cfg.Propagator, local: localKey(db, table)}
	if stmt := d.notify(); stmt != "" {
		if cfg.NotifyInTransaction {
			o.notifyInTx = stmt
		} else {
			o.announcer = &announcer{db: db, stmt: stmt, table: table}
		}
	}
	return o, nil
}

// Table returns the outbox's name (Config.Table or DefaultTable).
func (o *Outbox) Table() string { return o.table }

// Tables returns the names of the outbox's tables in the database: the messages table, which
// Publish writes, and the offsets table, with one row per consumer group of relays, its
// cursor. (Beside them, the leases table has a row per message that a group has handed to a
// relay and not yet seen sent; on MySQL, <Table>_lock holds the row that publishing
// transactions lock in turn.)
func (o *Outbox) Tables() (messages, offsets string) { return o.d.tables() }

// Publish writes msgs for the destination topic into the outbox, through the transaction
// that the Transaction middleware opened for the message being processed
// (processor.TxFromContext). The messages commit or roll back with everything else the
// transaction writes: if it rolls back, they are never sent; once it commits, a Relay sends
// them, at least once, with their UUID, payload and metadata unchanged.
//
// On MySQL and MariaDB, Publish first locks a row that every publishing transaction locks,
// and holds it until the transaction ends, so that the outbox's AUTO_INCREMENT offsets commit
// in order (see the package documentation): call it as the processor's last step.
//
// The relays hear of the commit at once (see Relay): Publish wakes the relays of this outbox
// that run in this process, and on PostgreSQL it notifies the relays of every process, from
// outside the transaction (or inside it: Config.NotifyInTransaction).
//
// It fails with ErrNoTransaction when ctx carries no transaction, and refuses nil messages,
// messages without a UUID and an empty topic before it writes anything. It does not change
// msgs: the trace context of ctx (see Config.Propagator) goes into copies of their metadata.
// Publish with no messages writes nothing.
//
// Give each outgoing message a UUID derived from the incoming message (DerivedID): if the
// incoming message is processed again, after a rollback or without duplicate detection, the
// outgoing message gets the same UUID, and the consumers' duplicate detection absorbs the
// second copy. The relay's own resends keep the UUID too.
func (o *Outbox) Publish(ctx context.Context, topic string, msgs ...*message.Message) error {
	tx, ok := processor.TxFromContext(ctx)
	if !ok {
		return fmt.Errorf("outbox: Publish: %w (run the processor inside the Transaction middleware, or call PublishTx with a transaction of your own)", ErrNoTransaction)
	}
	if d, err := sqldb.DialectOf(tx.DriverName()); err != nil || d != o.db.Dialect {
		return fmt.Errorf("outbox: Publish: the handler's transaction is on a %q database, the outbox %s on %s", tx.DriverName(), o.table, o.db.Dialect)
	}
	return o.publish(ctx, tx.Tx, topic, msgs)
}

// PublishTx is Publish through tx, a transaction of the outbox's database that the caller
// opened and will commit or roll back: for code that runs outside a handler, such as an HTTP
// request that stores an order and announces it. ctx gives the trace context.
func (o *Outbox) PublishTx(ctx context.Context, tx *sql.Tx, topic string, msgs ...*message.Message) error {
	if tx == nil {
		return errors.New("outbox: PublishTx: tx is nil")
	}
	return o.publish(ctx, tx, topic, msgs)
}

func (o *Outbox) publish(ctx context.Context, exec wsql.ContextExecutor, topic string, msgs []*message.Message) error {
	if topic == "" {
		return errors.New("outbox: publish: the destination topic is empty")
	}
	if len(msgs) == 0 {
		return nil
	}
	prop := o.propagator
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	}
	rows := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		switch {
		case m == nil:
			return fmt.Errorf("outbox: publish to topic %q: message %d of %d is nil", topic, i, len(msgs))
		case m.UUID == "":
			return fmt.Errorf("outbox: publish to topic %q: message %d of %d has no UUID (give each outgoing message a stable id, see DerivedID)", topic, i, len(msgs))
		}
		cp := message.NewMessage(m.UUID, m.Payload)
		cp.Metadata = make(message.Metadata, len(m.Metadata)+2)
		maps.Copy(cp.Metadata, m.Metadata)
		prop.Inject(ctx, telemetry.HeaderCarrier(cp.Metadata))
		row, err := wrap(topic, cp)
		if err != nil {
			return fmt.Errorf("outbox: publish to topic %q: %w", topic, err)
		}
		rows[i] = row
	}

	if lock := o.d.publishLock(); lock != "" {
		var id int
		if err := exec.QueryRowContext(ctx, lock).Scan(&id); err != nil {
			return fmt.Errorf("outbox: publish to topic %q: lock %s for publishing: %w", topic, o.table, err)
		}
	}
	// A watermill-sql publisher on the transaction is two small structs; it never creates
	// tables (AutoInitializeSchema is off: on MySQL, DDL would commit the transaction).
	wp, err := wsql.NewPublisher(exec, wsql.PublisherConfig{SchemaAdapter: o.insert}, nil)
	if err != nil {
		return fmt.Errorf("outbox: publish to topic %q: %w", topic, err)
	}
	for chunk := range slices.Chunk(rows, maxMessagesPerInsert) {
		if err := wp.Publish(o.table, chunk...); err != nil {
			return fmt.Errorf("outbox: write %d messages for topic %q to %s: %w", len(chunk), topic, o.table, err)
		}
	}
	if o.notifyInTx != "" {
		if _, err := exec.ExecContext(ctx, o.notifyInTx, o.table); err != nil {
			return fmt.Errorf("outbox: publish to topic %q: notify the relays of %s: %w", topic, o.table, err)
		}
	}
	if o.announcer != nil {
		o.announcer.announce()
	}
	wakeLocal(o.local)
	return nil
}

// Migrate creates the outbox's tables when they do not exist and leaves them alone when they
// do. It is idempotent and safe to run from several processes at once. Register it to run
// before the handlers start with router.AddMigration(ob.Migrate).
func (o *Outbox) Migrate(ctx context.Context) error {
	if err := o.d.migrate(ctx, o.db); err != nil {
		return fmt.Errorf("outbox: migrate %s: %w", o.table, err)
	}
	return nil
}

// Stats describes the messages that a consumer group of relays has not sent yet.
type Stats struct {
	// Backlog is the number of committed messages the group has not sent: not handed to a
	// relay yet, being sent, or waiting to be sent again after a failed attempt (a message sent
	// whose acknowledgement is not written yet counts too, for a few milliseconds). Messages
	// of transactions that have not committed are not counted, nor dead-lettered ones.
	Backlog int64
	// OldestUnsent is when the oldest of them was written, by the database clock; the zero
	// time when Backlog is 0.
	OldestUnsent time.Time
	// Lag is the age of that message, by the database clock; 0 when Backlog is 0. A lag that
	// keeps growing means no relay is running, the destination is down or refuses a message
	// that has not reached RelayConfig.MaxAttempts yet, or (on PostgreSQL) a long transaction
	// holds the relays back.
	Lag time.Duration
}

// Stats returns the backlog of consumerGroup (DefaultConsumerGroup if empty). A group that has
// never run has sent nothing: every message counts. It reads the outbox in one statement
// without locking it; on a large backlog, call it at the pace of a metrics scrape.
func (o *Outbox) Stats(ctx context.Context, consumerGroup string) (Stats, error) {
	group := cmp.Or(consumerGroup, DefaultConsumerGroup)
	var st Stats
	var oldest, age int64
	query, args := o.d.stats(group)
	if err := o.db.QueryRowContext(ctx, query, args...).Scan(&st.Backlog, &oldest, &age); err != nil {
		return Stats{}, fmt.Errorf("outbox: stats of %s for consumer group %q: %w", o.table, group, err)
	}
	if st.Backlog > 0 {
		st.OldestUnsent = time.UnixMicro(oldest)
		st.Lag = max(time.Duration(age)*time.Microsecond, 0)
	}
	return st, nil
}

// DefaultPurgeBatchSize is the batch size of a Purge whose BatchSize is zero.
const DefaultPurgeBatchSize = sqldb.DefaultPurgeBatchSize

// PurgeOptions bounds a Purge: rows per DELETE and DELETEs per purge.
type PurgeOptions = sqldb.PurgeOptions

// PurgeResult says what one Purge did; Skipped is never set.
type PurgeResult = sqldb.PurgeResult

// Purge deletes messages that every consumer group registered in the offsets table has sent
// (or dead-lettered), in batches of BatchSize rows, each its own statement, until a batch
// deletes fewer rows, MaxBatches batches have run, or ctx ends. It keeps the last message
// passed by the slowest group's cursor, and every message a group still holds (being sent, or
// waiting to be sent again). A group is registered when a relay of it first runs; with no
// group registered, Purge deletes nothing. A group registered after a Purge does not see the
// deleted messages, and a group that no relay runs any more holds every message back until
// its row is deleted from the offsets table.
//
// Relays purge by themselves (RelayConfig.PurgeInterval), one process at a time. Purging
// concurrently from several processes is safe, only wasteful. On error, the result counts
// what was deleted before it.
func (o *Outbox) Purge(ctx context.Context, opts PurgeOptions) (res PurgeResult, err error) {
	if err := opts.Validate(); err != nil {
		return res, fmt.Errorf("outbox: Purge: %w", err)
	}
	query := o.d.purgeQuery()
	res, err = sqldb.PurgeBatches(ctx, opts, func(ctx context.Context, batch int) (int64, error) {
		return o.db.PurgeExec(ctx, query, batch)
	})
	if err != nil {
		return res, fmt.Errorf("outbox: purge %s: %w", o.table, err)
	}
	return res, nil
}
