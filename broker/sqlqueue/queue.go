package sqlqueue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/sqldb"
)

// ErrClosed is returned by a closed Subscriber.
var ErrClosed = errors.New("sqlqueue: subscriber closed")

// Name prefixes of DefaultTables. The messages and offsets tables are watermill-sql's; the
// lease table's prefix cannot collide with theirs, which all begin with "watermill_".
const (
	messagesPrefix = "watermill_"
	offsetsPrefix  = "watermill_offsets_"
	leasesPrefix   = "onceflow_leases_"
	dueIndexPrefix = "onceflow_due_"
)

// MaxTopic is the longest topic, in bytes, whose table and index names all fit the identifier
// limit of PostgreSQL (63 bytes; it silently truncates longer names) and MySQL (64).
const MaxTopic = 63 - max(len(offsetsPrefix), len(leasesPrefix), len(dueIndexPrefix))

// MaxUUID is the size of watermill-sql's uuid column, VARCHAR(36).
const MaxUUID = 36

// topicPattern is what watermill-sql accepts in a topic: table names are made from it.
var topicPattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

// maxIdentifier is the longest table or index name: PostgreSQL's limit (MySQL's is 64).
const maxIdentifier = 63

// Tables names the tables of one topic, unquoted.
type Tables struct {
	// Messages is the messages table, laid out as watermill-sql's of the dialect.
	Messages string
	// Offsets is the offsets table, a cursor per consumer group, as watermill-sql's.
	Offsets string
	// Leases has one row per message a group has handed out and not acknowledged.
	Leases string
	// DueIndex names the PostgreSQL index of due leases; MySQL does not use it.
	DueIndex string
}

// DefaultTables returns the tables of topic by the names the package documentation gives
// (Tables), and the index "onceflow_due_<topic>".
func DefaultTables(topic string) Tables {
	return Tables{
		Messages: messagesPrefix + topic,
		Offsets:  offsetsPrefix + topic,
		Leases:   leasesPrefix + topic,
		DueIndex: dueIndexPrefix + topic,
	}
}

// quoted returns t with each name between q, the dialect's identifier quote.
func (t Tables) quoted(q string) Tables {
	return Tables{Messages: q + t.Messages + q, Offsets: q + t.Offsets + q, Leases: q + t.Leases + q, DueIndex: q + t.DueIndex + q}
}

// check reports the first name of t that cannot name a table: empty, longer than 63 bytes,
// or with a quote character.
func (t Tables) check() error {
	for _, n := range []struct{ field, name string }{
		{"Messages", t.Messages}, {"Offsets", t.Offsets}, {"Leases", t.Leases}, {"DueIndex", t.DueIndex},
	} {
		if n.name == "" || len(n.name) > maxIdentifier || strings.ContainsAny(n.name, "\"`\x00") {
			return fmt.Errorf("table name %s %q: want 1 to %d bytes without quotes", n.field, n.name, maxIdentifier)
		}
	}
	return nil
}

// CheckTopic reports whether topic can name a queue with the default table names: letters,
// digits and - $ : . _, at most MaxTopic bytes.
func CheckTopic(topic string) error {
	if !topicPattern.MatchString(topic) {
		return fmt.Errorf("topic %q: an SQL queue topic may contain only letters, digits and - $ : . _", topic)
	}
	if len(topic) > MaxTopic {
		return fmt.Errorf("topic %q: an SQL queue topic is at most %d bytes (table names are made from it)", topic, MaxTopic)
	}
	return nil
}

// Queue is the message queue that a PostgreSQL or MySQL/MariaDB database holds (see Tables in
// the package documentation), as one consumer group sees it. It makes the group's Subscribers
// and the watermill-sql Publisher that writes the same tables, and lists and removes waiting
// messages. A Queue is safe for concurrent use; it does not own the database pool.
type Queue struct {
	db  *sql.DB
	d   dialect
	cfg Config

	mu    sync.Mutex
	ready map[string]bool // topics whose tables and group row exist

	wakes dbqueue.Wakes // of the subscriptions, per topic

	keysMu    sync.Mutex
	keysReady bool // DeadLetterKeysTable exists
}

// New returns the queue in db, whose dialect is d (sqldb.Postgres or sqldb.MySQL), for the
// consumer group of cfg. It checks cfg and touches no table: EnsureTopic and Subscribe create
// a topic's tables when they are missing.
func New(db *sql.DB, d sqldb.Dialect, cfg Config) (*Queue, error) {
	if db == nil {
		return nil, errors.New("sqlqueue: db is nil")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	q := &Queue{db: db, cfg: cfg.withDefaults(), ready: map[string]bool{}}
	names := q.cfg.Tables
	if names == nil {
		names = DefaultTables
	}
	switch d {
	case sqldb.Postgres:
		q.d = postgres{names: names}
	case sqldb.MySQL:
		q.d = mysql{names: names, gapWait: q.cfg.GapWait}
	default:
		return nil, fmt.Errorf("sqlqueue: dialect %q: the SQL queue supports postgres and mysql", d)
	}
	return q, nil
}

// Config returns the Queue's configuration, defaults filled in.
func (q *Queue) Config() Config { return q.cfg }

// SchemaAdapter returns the watermill-sql schema of the messages tables, for a publisher: the
// default schema of the dialect with a binary payload column (BYTEA, LONGBLOB), so that
// payloads need not be JSON.
func (q *Queue) SchemaAdapter() wsql.SchemaAdapter { return q.d.messagesSchema() }

// NewPublisher returns a publisher that writes the Queue's messages tables.
func (q *Queue) NewPublisher() (message.Publisher, error) {
	pub, err := wsql.NewPublisher(q.db, wsql.PublisherConfig{SchemaAdapter: q.d.messagesSchema()}, q.cfg.log)
	if err != nil {
		return nil, err
	}
	return pub, nil
}

// EnsureTopic creates the tables of topic that do not exist (messages and offsets as
// watermill-sql creates them, and the lease table) and the consumer group's cursor row, once
// per Queue and topic; tables that exist are left as they are.
func (q *Queue) EnsureTopic(ctx context.Context, topic string) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.ready[topic] {
		return nil
	}
	if err := q.CreateTables(ctx, topic); err != nil {
		return err
	}
	if err := q.d.addGroup(ctx, q.db, topic, q.cfg.ConsumerGroup); err != nil {
		return fmt.Errorf("sqlqueue: create consumer group %q of topic %q: %w", q.cfg.ConsumerGroup, topic, err)
	}
	q.ready[topic] = true
	return nil
}

// CreateTables creates the tables of topic that do not exist, as EnsureTopic does, without
// creating the consumer group's cursor row: for a migration that runs before any consumer of
// the topic. It is harmless to repeat and safe to run from several processes at once.
func (q *Queue) CreateTables(ctx context.Context, topic string) error {
	if err := q.checkTopic(topic); err != nil {
		return err
	}
	if err := q.create(ctx, q.d.schema(topic)...); err != nil {
		return fmt.Errorf("sqlqueue: create tables of topic %q: %w", topic, err)
	}
	return nil
}

// createKeysTable creates DeadLetterKeysTable, which the topics share, once per Queue, before
// its first publish of a dead letter (outside the publish's transaction: on MySQL, DDL would
// commit it).
func (q *Queue) createKeysTable(ctx context.Context) error {
	q.keysMu.Lock()
	defer q.keysMu.Unlock()
	if q.keysReady {
		return nil
	}
	err := q.create(ctx, wsql.Query{Query: q.d.keys().Schema})
	q.keysReady = err == nil
	return err
}

// create runs stmts, CREATE ... IF NOT EXISTS statements, again while they fail because another
// process created the same objects at the same moment: on PostgreSQL two concurrent CREATEs of
// one table can fail with a unique violation or an object that already exists.
func (q *Queue) create(ctx context.Context, stmts ...wsql.Query) error {
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		for _, stmt := range stmts {
			if _, err = q.db.ExecContext(ctx, stmt.Query); err != nil {
				break
			}
		}
		if err == nil {
			return nil
		}
		if c := sqldb.Classify(err); c != sqldb.UniqueViolation && c != sqldb.Conflict && !alreadyExists(err) {
			break
		}
	}
	return err
}

// alreadyExists reports whether err is PostgreSQL's duplicate_table or duplicate_object: a
// concurrent CREATE ... IF NOT EXISTS created the same table, index or type first.
func alreadyExists(err error) bool {
	var state interface{ SQLState() string }
	if !errors.As(err, &state) {
		return false
	}
	code := state.SQLState()
	return code == "42P07" || code == "42710"
}

// checkTopic reports whether topic can name a queue: CheckTopic with the default table names,
// the names of Config.Tables otherwise.
func (q *Queue) checkTopic(topic string) error {
	if q.cfg.Tables == nil {
		if err := CheckTopic(topic); err != nil {
			return fmt.Errorf("sqlqueue: %w", err)
		}
		return nil
	}
	if topic == "" {
		return errors.New("sqlqueue: the topic is empty")
	}
	if err := q.cfg.Tables(topic).check(); err != nil {
		return fmt.Errorf("sqlqueue: topic %q: %w", topic, err)
	}
	return nil
}

// Wake makes the idle subscriptions of topic that this Queue's Subscribers run look for
// messages at once rather than at their next poll. Call it when something outside the Queue
// learns that messages were committed to the topic: a PostgreSQL notification sent at the
// commit, a writer of the same process. A Wake with nothing to claim costs each woken
// subscription one look; a message held back (Visibility order in the package documentation)
// waits for the next poll or Wake.
func (q *Queue) Wake(topic string) { q.wakes.Wake(topic) }

// dialect is the SQL of one database family over one topic's tables, named by Config.Tables.
// Topics are checked by Queue.checkTopic before they reach it: their table names contain no
// quote.
type dialect interface {
	// messagesSchema is watermill-sql's schema of the messages tables.
	messagesSchema() wsql.SchemaAdapter
	// schema returns the statements that create the topic's tables: the messages and offsets
	// tables as watermill-sql's schema and offsets adapter of the dialect create them, then
	// the lease table.
	schema(topic string) []wsql.Query
	// keys are the statements of DeadLetterKeysTable.
	keys() dbqueue.DeadLetterKeys
	// addGroup creates the group's cursor row at the start of the topic when it has none.
	addGroup(ctx context.Context, db *sql.DB, topic, group string) error
	// probe reports, without taking a lock, whether the group has due leases and whether
	// messages wait after its cursor.
	probe(ctx context.Context, db *sql.DB, topic, group string) (due, fresh bool, err error)
	// claimDue leases again up to n of the group's due leases, oldest first: deliveries + 1,
	// visible until now + lease. It skips leases that another transaction holds locked. Rows
	// whose message is gone come back with orphan set.
	claimDue(ctx context.Context, db *sql.DB, topic, group string, n int, lease time.Duration) ([]row, error)
	// claimNew leases up to n messages after the group's cursor, in the order the group
	// receives them, and moves the cursor past them, in one transaction. It claims nothing
	// when another consumer of the group holds the cursor.
	claimNew(ctx context.Context, db *sql.DB, topic, group string, n int, lease time.Duration) ([]row, error)
	// settle writes a batch of acknowledgements and lease changes of the group, atomically.
	settle(ctx context.Context, db *sql.DB, topic, group string, b *batch) error
	// existing returns which of the topic's tables exist, for the methods below.
	existing(ctx context.Context, db *sql.DB, topic string) (tableSet, error)
	// hasGroup reports whether group has its cursor row in the topic's offsets table.
	hasGroup(ctx context.Context, db *sql.DB, topic, group string) (bool, error)
	// waiting lists up to limit messages waiting for the group: leased or after its cursor,
	// in the order the group receives them.
	waiting(ctx context.Context, db *sql.DB, topic, group string, have tableSet, limit int) ([]row, error)
	// remove deletes a message that waiting returned, with its leases in every group.
	remove(ctx context.Context, db *sql.DB, topic string, have tableSet, r row) error
	// trim deletes up to limit of the messages that Queue.Trim deletes, oldest first, and
	// returns how many; have has the offsets table.
	trim(ctx context.Context, db *sql.DB, topic string, have tableSet, limit int) (int64, error)
	// ackInTx is the statement that deletes a lease of the group (its parameters: group,
	// offset, deliveries) only while its deliveries count is the given one.
	ackInTx(topic string) string
}

// tableSet says which of a topic's tables exist.
type tableSet struct{ messages, offsets, leases bool }

// row is a message as a claim or a listing reads it.
type row struct {
	offset int64
	// txID is the PostgreSQL transaction id (xid8) that wrote the message; 0 on MySQL.
	txID       int64
	deliveries int
	// leased marks, in a listing, a message that the group has leased.
	leased bool
	// orphan marks a lease whose message row is gone (removed while leased).
	orphan            bool
	uuid              string
	payload, metadata []byte
	// settled marks, on MySQL, a new message old enough that a gap before it is a publish
	// that rolled back (Config.GapWait).
	settled bool
}

// leaseRef names one lease as one delivery knows it: a lease claimed again since carries a
// higher deliveries count, so a late settlement of an older delivery matches nothing.
type leaseRef struct {
	offset     int64
	deliveries int
}

// leaseUpdate makes a lease visible again after delay, changing its deliveries count by delta
// (-1 for a message claimed but never handed out).
type leaseUpdate struct {
	leaseRef
	delay time.Duration
	delta int
}

// batch is what one settle writes for one topic: leases to delete (acknowledged messages) and
// leases to change (nacked, given back).
type batch struct {
	acks    []leaseRef
	updates []leaseUpdate
}

// inTx runs f in a read-committed transaction, as dbqueue.InTx.
func inTx(ctx context.Context, db *sql.DB, f func(tx *sql.Tx) error) error {
	return dbqueue.InTx(ctx, db, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, f)
}
