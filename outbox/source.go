package outbox

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/internal/wmlog"
	"github.com/onceflow/onceflow/sqldb"
)

// source is where a relay takes the outbox's rows from: one subscription of its consumer group
// over the outbox's tables, as the lease-based queues consume their topics (broker/sqlqueue on
// PostgreSQL and MySQL, broker/sqlitequeue on SQLite). Each delivered message is one row, its
// payload the envelope that Publish wrote; its context carries a redelivery.Info whose Count
// is the row's delivery count in the group, kept in the leases table. An ack deletes the
// row's lease; a nack makes it visible again after the delay of redelivery.NackAfter; a lease
// not settled within RelayConfig.AckDeadline is claimed again.
type source interface {
	// subscribe registers the consumer group (at the start of the outbox for a new group) and
	// starts the subscription; it ends when ctx ends or close is called.
	subscribe(ctx context.Context) (<-chan *message.Message, error)
	// wake makes an idle subscription look for new rows at once.
	wake()
	// close ends the subscription: it writes the acknowledgements and nacks given before and
	// gives back the leases of the rows that are not settled, for the next relay of the group.
	close() error
}

// sqlSource is the relay's subscription on PostgreSQL and MySQL: broker/sqlqueue over the
// outbox's tables. Claims take a few short transactions; none is open while rows are sent.
type sqlSource struct {
	q     *sqlqueue.Queue
	topic string
	sub   *sqlqueue.Subscriber // made by subscribe
}

func newSQLSource(cfg RelayConfig, tables sqlqueue.Tables) (*sqlSource, error) {
	q, err := sqlqueue.New(cfg.DB.DB.DB, cfg.DB.Dialect, sqlqueue.Config{
		ConsumerGroup: cfg.ConsumerGroup,
		Prefetch:      cfg.BatchSize,
		AckTimeout:    cfg.AckDeadline,
		NackDelay:     cfg.ResendInterval,
		PollInterval:  cfg.PollInterval,
		RetryInterval: cfg.RetryInterval,
		CloseTimeout:  cfg.CloseTimeout,
		Logger:        wmlog.Quiet(cfg.Logger),
		Tables:        func(string) sqlqueue.Tables { return tables },
	})
	if err != nil {
		return nil, err
	}
	return &sqlSource{q: q, topic: cfg.Table}, nil
}

func (s *sqlSource) subscribe(ctx context.Context) (<-chan *message.Message, error) {
	s.sub = s.q.Subscriber()
	return s.sub.Subscribe(ctx, s.topic)
}

func (s *sqlSource) wake() { s.q.Wake(s.topic) }

func (s *sqlSource) close() error {
	if s.sub == nil {
		return nil
	}
	return s.sub.Close()
}

// sqliteSource is the relay's subscription on SQLite: broker/sqlitequeue over the application
// database, whose outbox tables are a queue topic's. Claims and settlements are short write
// transactions; none is open while rows are sent, so the relay never holds the database's
// write lock while the destination takes a message.
type sqliteSource struct {
	db    *sqldb.DB
	cfg   sqlitequeue.Config
	topic string
	q     *sqlitequeue.Queue // made by subscribe
}

func newSQLiteSource(cfg RelayConfig) (*sqliteSource, error) {
	qc := sqlitequeue.Config{
		ConsumerGroup:  cfg.ConsumerGroup,
		BatchSize:      cfg.BatchSize,
		PollInterval:   cfg.PollInterval,
		ResendInterval: max(cfg.ResendInterval, time.Millisecond),
		RetryInterval:  cfg.RetryInterval,
		AckDeadline:    cfg.AckDeadline,
		Logger:         wmlog.Quiet(cfg.Logger),
	}
	if err := qc.Validate(); err != nil {
		return nil, err
	}
	return &sqliteSource{db: cfg.DB, cfg: qc, topic: cfg.Table}, nil
}

func (s *sqliteSource) subscribe(ctx context.Context) (<-chan *message.Message, error) {
	q, err := sqlitequeue.New(s.db, s.cfg)
	if err != nil {
		return nil, err
	}
	s.q = q
	sub, err := q.Subscriber()
	if err != nil {
		return nil, err
	}
	return sub.Subscribe(ctx, s.topic)
}

func (s *sqliteSource) wake() {
	if s.q != nil {
		s.q.Wake(s.topic)
	}
}

// close closes the queue, and with it its subscriber; the application database stays open.
func (s *sqliteSource) close() error {
	if s.q == nil {
		return nil
	}
	return s.q.Close()
}

var (
	_ source = (*sqlSource)(nil)
	_ source = (*sqliteSource)(nil)
)
