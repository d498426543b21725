package sqlqueue

import (
	"cmp"
	"context"
	"fmt"
	"net/url"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/connect"
	"github.com/onceflow/onceflow/sqldb"
)

func init() {
	broker.Register("postgres", openScheme, broker.Params{Database: true})
	broker.Register("mysql", openScheme, broker.Params{Database: true})
}

// openScheme opens the queue in a PostgreSQL or MySQL/MariaDB database: broker.Open's postgres://
// and mysql:// schemes. Every connect of the database's pool is bounded by opts.ConnectTimeout
// (sqldb's connect_timeout).
func openScheme(ctx context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	db, err := sqldb.Open(ctx, withConnectTimeout(t.URL, o))
	if err != nil {
		return nil, err
	}
	if db.Dialect != sqldb.Postgres && db.Dialect != sqldb.MySQL {
		_ = db.Close()
		return nil, fmt.Errorf("%s is a %s database; the SQL queue supports postgres and mysql (use sqlite:// for the embedded queue)", db, db.Dialect)
	}
	q, err := New(db.DB.DB, db.Dialect, Config{
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      o.Prefetch,
		AckTimeout:    o.AckTimeout,
		NackDelay:     max(o.NackDelay, 0),
		PollInterval:  cmp.Or(o.PollInterval, broker.DefaultPollInterval),
		CloseTimeout:  broker.SubscriberCloseTimeout,
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
	return &broker.Backend{
		Publisher:  &publisher{Publisher: pub, q: q},
		CheckTopic: q.checkTopic,
		CheckMessage: func(m *message.Message) error {
			if len(m.UUID) > MaxUUID {
				return fmt.Errorf("UUID %q is %d bytes; the SQL queue's uuid column holds %d", m.UUID, len(m.UUID), MaxUUID)
			}
			return nil
		},
		PreparePublish: func(topic string) error {
			return q.EnsureTopic(context.Background(), topic)
		},
		NewSubscriber: func() (message.Subscriber, error) { return q.Subscriber(), nil },
		Trim:          q.Trim,
		Close:         db.Close,
		View: func(ctx context.Context, topic string) (broker.View, error) {
			if _, err := q.lookUp(ctx, topic, true); err != nil {
				return nil, err
			}
			return q.view(topic), nil
		},
	}, nil
}

// withConnectTimeout gives sqldb.Open the broker's connect timeout, in the parameter that
// package broker took out of the URL.
func withConnectTimeout(dsn string, o broker.Options) string {
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	return dsn + sep + connect.Param + "=" + url.QueryEscape(o.ConnectTimeout.String())
}
