package broker

import (
	"cmp"
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker/sqlqueue"
	"github.com/onceflow/onceflow/sqldb"
	_ "github.com/onceflow/onceflow/sqldb/mysql"
	_ "github.com/onceflow/onceflow/sqldb/postgres"
)

// openSQL opens the queue in a PostgreSQL or MySQL/MariaDB database: watermill-sql's publisher
// and tables, and sqlqueue's subscriber, which keeps Prefetch deliveries in flight per
// subscription with a lease each, delays nacked messages (visible_at) and counts deliveries in
// the lease table.
func openSQL(ctx context.Context, t *target, o Options) (*backend, error) {
	db, err := sqldb.Open(ctx, t.dsn)
	if err != nil {
		return nil, err
	}
	if db.Dialect != sqldb.Postgres && db.Dialect != sqldb.MySQL {
		_ = db.Close()
		return nil, fmt.Errorf("%s is a %s database; the SQL queue supports postgres and mysql (use sqlite:// for the embedded queue)", db, db.Dialect)
	}
	q, err := sqlqueue.New(db.DB.DB, db.Dialect, sqlqueue.Config{
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      cmp.Or(o.Prefetch, DefaultPrefetch),
		AckTimeout:    o.AckTimeout,
		NackDelay:     o.nackDelay(),
		PollInterval:  cmp.Or(o.PollInterval, DefaultPollInterval),
		CloseTimeout:  closeGrace,
		Logger:        o.Logger,
	})
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	pub, err := q.NewPublisher()
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return &backend{
		pub:        pub,
		checkTopic: checkSQLTopic,
		checkMessage: func(m *message.Message) error {
			if len(m.UUID) > sqlqueue.MaxUUID {
				return fmt.Errorf("UUID %q is %d bytes; the SQL queue's uuid column holds %d", m.UUID, len(m.UUID), sqlqueue.MaxUUID)
			}
			return nil
		},
		preparePublish: func(topic string) error {
			return q.EnsureTopic(context.Background(), topic)
		},
		newSubscriber: func() (message.Subscriber, error) { return q.Subscriber(), nil },
		native:        true,
		close:         db.Close,
		view: func(_ context.Context, topic string) (view, error) {
			return &sqlView{q: q, topic: topic}, nil
		},
	}, nil
}

func checkSQLTopic(topic string) error {
	if err := sqlqueue.CheckTopic(topic); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	return nil
}
