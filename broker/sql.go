package broker

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/sqldb"
)

// sqlRetryInterval is how long an SQL consumer waits after a failed query that is not a
// transient conflict (the database is down, say) before it queries again.
const sqlRetryInterval = time.Second

// sqlTopicPattern is what watermill-sql accepts in a topic: its table names are made from it.
var sqlTopicPattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

// sqlMaxTopic bounds topics so that "watermill_offsets_<topic>" fits the identifier limit of
// PostgreSQL (63 bytes, longer names are silently truncated) and MySQL (64).
const sqlMaxTopic = 63 - len("watermill_offsets_")

// sqlMaxUUID is the size of watermill-sql's uuid column, VARCHAR(36).
const sqlMaxUUID = 36

func openSQL(ctx context.Context, t *target, o Options) (*backend, error) {
	db, err := sqldb.Open(ctx, t.dsn)
	if err != nil {
		return nil, err
	}
	batch := o.Prefetch
	if batch == 0 {
		batch = DefaultPrefetch
	}
	poll := o.PollInterval
	if poll == 0 {
		poll = DefaultPollInterval
	}
	resend := o.nackDelay()
	if resend == 0 {
		resend = time.Millisecond // watermill-sql wants a positive interval
	}

	var schema wsql.SchemaAdapter
	var offsets wsql.OffsetsAdapter
	switch db.Dialect {
	case sqldb.Postgres:
		schema = wsql.DefaultPostgreSQLSchema{
			// The default, JSON, refuses payloads that are not JSON.
			GeneratePayloadType: func(string) string { return "BYTEA" },
			SubscribeBatchSize:  batch,
		}
		offsets = wsql.DefaultPostgreSQLOffsetsAdapter{}
	case sqldb.MySQL:
		schema = wsql.DefaultMySQLSchema{
			GeneratePayloadType: func(string) string { return "LONGBLOB" },
			SubscribeBatchSize:  batch,
		}
		offsets = wsql.DefaultMySQLOffsetsAdapter{}
	default:
		_ = db.Close()
		return nil, fmt.Errorf("%s is a %s database; the SQL queue supports postgres and mysql (use sqlite:// for the embedded queue)", db, db.Dialect)
	}
	raw := db.DB.DB
	tables := &sqlTables{db: raw, dialect: db.Dialect, group: o.ConsumerGroup, schema: schema, offsets: offsets, done: map[string]bool{}}
	pub, err := wsql.NewPublisher(raw, wsql.PublisherConfig{SchemaAdapter: schema}, o.Logger)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	ackDeadline := o.AckTimeout
	cfg := wsql.SubscriberConfig{
		ConsumerGroup:  o.ConsumerGroup,
		AckDeadline:    &ackDeadline,
		PollInterval:   poll,
		ResendInterval: resend,
		RetryInterval:  sqlRetryInterval,
		BackoffManager: sqlBackoff{poll: poll, retry: sqlRetryInterval},
		SchemaAdapter:  schema,
		OffsetsAdapter: offsets,
	}
	return &backend{
		pub:        pub,
		checkTopic: checkSQLTopic,
		checkMessage: func(m *message.Message) error {
			if len(m.UUID) > sqlMaxUUID {
				return fmt.Errorf("UUID %q is %d bytes; the SQL queue's uuid column holds %d", m.UUID, len(m.UUID), sqlMaxUUID)
			}
			return nil
		},
		preparePublish: func(topic string) error {
			return tables.ensure(context.Background(), topic)
		},
		newSubscriber: func() (message.Subscriber, error) {
			up, err := wsql.NewSubscriber(raw, cfg, o.Logger)
			if err != nil {
				return nil, err
			}
			return &sqlSubscriber{Subscriber: up, tables: tables}, nil
		},
		// watermill-sql waits ResendInterval before it delivers a nacked message again, and
		// abandons the message of a closing consumer to the next one.
		close: db.Close,
		view: func(_ context.Context, topic string) (view, error) {
			return &sqlView{db: raw, dialect: db.Dialect, group: o.ConsumerGroup, topic: topic, schema: schema}, nil
		},
	}, nil
}

func checkSQLTopic(topic string) error {
	if !sqlTopicPattern.MatchString(topic) {
		return fmt.Errorf("broker: topic %q: an SQL queue topic may contain only letters, digits and - $ : . _", topic)
	}
	if len(topic) > sqlMaxTopic {
		return fmt.Errorf("broker: topic %q: an SQL queue topic is at most %d bytes (table names are made from it)", topic, sqlMaxTopic)
	}
	return nil
}

// sqlSubscriber creates the tables of a topic before watermill-sql subscribes to it.
type sqlSubscriber struct {
	*wsql.Subscriber
	tables *sqlTables
}

// Subscribe creates the topic's tables if needed and subscribes.
func (s *sqlSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.tables.ensure(ctx, topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// sqlTables creates the messages and offsets tables of topics, once per topic and Broker.
// It does what watermill-sql's InitializeSchema does, but serialised within the process and
// run again on a transient error: on PostgreSQL, two concurrent CREATE TABLE IF NOT EXISTS of
// one table can fail with a unique violation.
//
// On MySQL it also creates the consumer group's offsets row, which watermill-sql leaves to the
// first acknowledgement. Without the row, the SELECT ... FOR UPDATE that serialises the
// group's consumers locks a gap instead of a row, and two consumers that start together can
// both read from offset 0 and deliver the same messages. It looks before it writes, because a
// consumer of the group holds the row's lock while it works through a batch.
type sqlTables struct {
	db      *sql.DB
	dialect sqldb.Dialect
	group   string
	schema  wsql.SchemaAdapter
	offsets wsql.OffsetsAdapter

	mu   sync.Mutex
	done map[string]bool
}

func (t *sqlTables) ensure(ctx context.Context, topic string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done[topic] {
		return nil
	}
	queries := append(t.schema.SchemaInitializingQueries(topic), t.offsets.SchemaInitializingQueries(topic)...)
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		if err = runQueries(ctx, t.db, queries); err == nil {
			break
		}
		if c := sqldb.Classify(err); c != sqldb.UniqueViolation && c != sqldb.Conflict {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("create tables of topic %q: %w", topic, err)
	}
	if t.dialect == sqldb.MySQL {
		table := wsql.DefaultMySQLOffsetsAdapter{}.MessagesOffsetsTable(topic)
		var n int
		if err := t.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table+" WHERE consumer_group = ?", t.group).Scan(&n); err != nil {
			return fmt.Errorf("look up consumer group %q of topic %q: %w", t.group, topic, err)
		}
		if n == 0 {
			_, err := t.db.ExecContext(ctx, "INSERT INTO "+table+" (consumer_group, offset_acked, offset_consumed) VALUES (?, 0, 0) "+
				"ON DUPLICATE KEY UPDATE consumer_group = consumer_group", t.group)
			if err != nil {
				return fmt.Errorf("create consumer group %q of topic %q: %w", t.group, topic, err)
			}
		}
	}
	t.done[topic] = true
	return nil
}

func runQueries(ctx context.Context, db *sql.DB, queries []wsql.Query) error {
	for _, q := range queries {
		if _, err := db.ExecContext(ctx, q.Query, q.Args...); err != nil {
			return err
		}
	}
	return nil
}

// sqlBackoff decides how long an SQL consumer waits before its next query. A transient
// conflict (serialization failure or deadlock when consumers of a group compete for the
// offsets row) is retried at once and logged at debug level only: it is how the consumers of
// a group take turns.
type sqlBackoff struct {
	poll, retry time.Duration
}

// HandleError implements watermill-sql's BackoffManager.
func (b sqlBackoff) HandleError(logger watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	switch {
	case err == nil && noMsg:
		return b.poll
	case err == nil:
		return 0
	case sqldb.Classify(err) == sqldb.Conflict:
		logger.Debug("consumers of the group took turns; querying again", watermill.LogFields{"err": err.Error()})
		return 0
	case errors.Is(err, context.Canceled):
		return b.poll
	default:
		logger.Error("querying for messages failed", err, watermill.LogFields{"wait_time": b.retry})
		return b.retry
	}
}
