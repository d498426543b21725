package sqlitequeue

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	neturl "net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/internal/dbqueue"
	"github.com/onceflow/onceflow/broker/internal/inflight"
	"github.com/onceflow/onceflow/broker/internal/lifecycle"
	"github.com/onceflow/onceflow/internal/queuetable"
	"github.com/onceflow/onceflow/sqldb"
)

// ErrClosed is returned by the methods of a closed Queue, and by Publish on a closed Publisher.
var ErrClosed = errors.New("sqlitequeue: closed")

// Queue is a durable message queue in one SQLite file. It makes watermill Publishers and
// Subscribers over that file and answers questions about its contents. A Queue is safe for
// concurrent use; several Queues, in one process or in several, may use the same file.
type Queue struct {
	db    *sqldb.DB
	ownDB bool
	cfg   Config
	// batchSize is Config.BatchSize as given: 0 lets each subscription take the window its
	// consumer asks for (redelivery.WithWindow).
	batchSize int
	schema    SchemaAdapter
	// wakes are the wake-ups of the subscriptions over the file in this process (wakesOf).
	wakes *dbqueue.Wakes

	// initialized holds the topics whose tables this Queue has created or found.
	initialized sync.Map
	// pools holds the settlements of each topic's subscriptions (*settlements).
	pools sync.Map
	// leases is the connection of the subscriptions' claims and settlements.
	leases leaseConn
	// life holds the open Subscribers until Close.
	life lifecycle.Set[*subscriber]
}

// Open opens, creating it if missing, the queue file that url names and returns a Queue over
// it. url is "sqlite://path/queue.db", "sqlite:///absolute/path/queue.db" or a bare file path;
// query parameters of a sqlite:// URL are passed to sqldb.Open. The directory must exist.
// Without the SQLite driver's import (package documentation) Open fails with an error that
// names it. The Queue owns the connection pool: Close closes it.
func Open(ctx context.Context, url string, cfg Config) (*Queue, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	url, path, err := parseURL(url)
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(filepath.Dir(path)); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("sqlitequeue: queue URL %q: directory %q does not exist", url, filepath.Dir(path))
	}
	db, err := sqldb.Open(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("sqlitequeue: %w", err)
	}
	// A few idle connections, for the short transactions of subscriptions and publishers.
	db.SetMaxIdleConns(8)
	q, err := New(db, cfg)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	q.ownDB = true
	return q, nil
}

// ErrNoQueue reports a queue file that OpenExisting did not find. It is an fs.ErrNotExist too
// (errors.Is).
var ErrNoQueue error = notExist("no such queue")

// notExist is an error that errors.Is counts as fs.ErrNotExist.
type notExist string

func (e notExist) Error() string      { return string(e) }
func (notExist) Is(target error) bool { return target == fs.ErrNotExist }

// OpenExisting is Open for commands that read or maintain a queue and must not create one:
// a file that does not exist fails with ErrNoQueue and the path, where Open would create an
// empty queue.
func OpenExisting(ctx context.Context, url string, cfg Config) (*Queue, error) {
	_, path, err := parseURL(url)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("sqlitequeue: %w: %s", ErrNoQueue, path)
	}
	return Open(ctx, url, cfg)
}

// parseURL returns url as a sqlite:// URL, and the path of the file it names.
func parseURL(url string) (string, string, error) {
	if !strings.Contains(url, "://") {
		if url == "" {
			return "", "", errors.New("sqlitequeue: empty queue URL (want sqlite://path/queue.db or a file path)")
		}
		url = "sqlite://" + url
	}
	scheme, rest, _ := strings.Cut(url, "://")
	if s := strings.ToLower(scheme); s != "sqlite" && s != "sqlite3" {
		return "", "", fmt.Errorf("sqlitequeue: queue URL %q: scheme %q is not sqlite (want sqlite://path/queue.db or a file path)", sqldb.Redact(url), scheme)
	}
	path, query, _ := strings.Cut(rest, "?")
	if path == "" || strings.HasPrefix(path, ":memory:") || strings.Contains(query, "mode=memory") {
		return "", "", fmt.Errorf("sqlitequeue: queue URL %q names no file (an in-memory database is neither durable nor shared between connections)", url)
	}
	if p, err := neturl.PathUnescape(path); err == nil {
		path = p
	}
	return url, path, nil
}

// New returns a Queue over db, an SQLite database that must have been opened with sqldb.Open
// (or with the same settings: above all BEGIN IMMEDIATE transactions, without which consumers
// of one group are not kept apart and claims fail under concurrent publishing). The Queue does
// not own db: Close leaves it open.
func New(db *sqldb.DB, cfg Config) (*Queue, error) {
	if db == nil {
		return nil, errors.New("sqlitequeue.New: db is nil")
	}
	if db.Dialect != sqldb.SQLite {
		return nil, fmt.Errorf("sqlitequeue.New: %s is a %s database, want sqlite", db, db.Dialect)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	batchSize := cfg.BatchSize
	cfg = cfg.withDefaults()
	return &Queue{
		db:        db,
		cfg:       cfg,
		batchSize: batchSize,
		wakes:     wakesOf(db.Path),
		schema:    SchemaAdapter{BatchSize: cfg.BatchSize},
	}, nil
}

// DB returns the queue's database.
func (q *Queue) DB() *sqldb.DB { return q.db }

// Config returns the queue's configuration with defaults filled in.
func (q *Queue) Config() Config { return q.cfg }

// Publisher returns a new Publisher of the queue. Publishers are cheap; give each user (each
// router handler, which closes its publisher when it stops) one of its own. Closing a
// Publisher does not close the Queue. Publish commits the messages of one call together, in
// their order, with synchronous=FULL.
func (q *Queue) Publisher() message.Publisher { return &publisher{q: q} }

// Subscriber returns a new Subscriber of the queue in the configured consumer group, whose
// subscriptions deliver as the package documentation says (Delivery). Closing it ends its
// subscriptions, not the Queue; Close of the Queue closes it too.
func (q *Queue) Subscriber() (message.Subscriber, error) {
	s := &subscriber{q: q, subs: inflight.NewGroup(ErrClosed)}
	if !q.life.Add(s) {
		return nil, ErrClosed
	}
	return s, nil
}

// Close closes the queue's subscribers, waiting for their subscriptions to end, and then the
// database if Open opened it. Publishers of a closed queue fail with ErrClosed. Close is
// idempotent.
func (q *Queue) Close() error {
	subs, first := q.life.Close()
	if !first {
		return nil
	}
	var errs []error
	for _, s := range subs {
		errs = append(errs, s.Close())
	}
	q.leases.close()
	if q.ownDB {
		errs = append(errs, q.db.Close())
	}
	return errors.Join(errs...)
}

// CreateTables creates topic's tables (messages, offsets and leases) when they are missing,
// without recording a consumer group: for a migration that runs before any consumer of the
// topic, such as that of onceflow's outbox, whose SQLite tables are a queue topic's. It is
// harmless to repeat.
func (q *Queue) CreateTables(ctx context.Context, topic string) error {
	if err := CheckTopic(topic); err != nil {
		return err
	}
	err := q.write(ctx, func(tx *sql.Tx) error { return q.createTables(ctx, tx, topic) })
	if err != nil {
		return fmt.Errorf("sqlitequeue: %w", err)
	}
	q.tablesCreated(topic)
	return nil
}

// Wake makes this process's idle subscriptions of topic, over the queue's file, look for
// messages at once rather than at their next poll, as a Publisher of the queue does: for
// messages written by other means, such as onceflow's outbox. A Wake with nothing to claim
// costs each woken subscription one look, which takes no lock.
func (q *Queue) Wake(topic string) { q.wakes.Wake(topic) }

// createTables creates topic's tables in tx unless this Queue has seen them before. It does
// not remember them: tx may roll back. Callers call tablesCreated after a commit.
func (q *Queue) createTables(ctx context.Context, tx *sql.Tx, topic string) error {
	if _, ok := q.initialized.Load(topic); ok {
		return nil
	}
	var queries []string
	for _, query := range append(q.schema.SchemaInitializingQueries(topic), OffsetsAdapter{}.SchemaInitializingQueries(topic)...) {
		queries = append(queries, query.Query)
	}
	for _, query := range append(queries, queuetable.LeasesSchema(topic)...) {
		if _, err := tx.ExecContext(ctx, query); err != nil {
			return fmt.Errorf("create tables of topic %q: %w", topic, err)
		}
	}
	return nil
}

// tablesCreated remembers that topic's tables exist.
func (q *Queue) tablesCreated(topic string) { q.initialized.Store(topic, struct{}{}) }

// prepareTopic makes sure that topic's tables exist (the leases table too, in a file written
// before the queue had leases) and that group has its row in the offsets table (cursor 0 for a
// new group), so that Backlog and Trim know the group from its first subscription on. It looks
// before it writes: when everything exists, it takes no turn to write.
func (q *Queue) prepareTopic(ctx context.Context, topic, group string) error {
	t, err := q.topicTables(ctx, topic)
	if err != nil {
		return err
	}
	if t.all() {
		var known bool
		err := q.db.QueryRowContext(ctx, `SELECT count(*) FROM `+quote(OffsetsTable(topic))+` WHERE consumer_group = ?`, group).Scan(&known)
		if err != nil {
			return fmt.Errorf("sqlitequeue: look up consumer group %q of topic %q: %w", group, topic, err)
		}
		if known {
			q.tablesCreated(topic)
			return nil
		}
	}
	err = q.write(ctx, func(tx *sql.Tx) error {
		if err := q.createTables(ctx, tx, topic); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO `+quote(OffsetsTable(topic))+` (consumer_group, offset_acked) VALUES (?, 0) ON CONFLICT DO NOTHING`, group)
		return err
	})
	if err != nil {
		return fmt.Errorf("sqlitequeue: prepare topic %q for consumer group %q: %w", topic, group, err)
	}
	q.tablesCreated(topic)
	return nil
}

// write runs fn in a transaction of the queue file, in this process's turn (sqldb.Open's).
func (q *Queue) write(ctx context.Context, fn func(tx *sql.Tx) error) error {
	return dbqueue.InTx(ctx, rawDB(q.db), nil, fn)
}

// rawDB returns the database/sql pool under db.
func rawDB(db *sqldb.DB) *sql.DB { return db.DB.DB }
