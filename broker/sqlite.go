package broker

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

func openSQLite(ctx context.Context, t *target, o Options) (*backend, error) {
	resend := o.nackDelay()
	if resend == 0 {
		resend = time.Millisecond // zero would select sqlitequeue's default
	}
	q, err := sqlitequeue.Open(ctx, t.dsn, sqlitequeue.Config{
		ConsumerGroup:  o.ConsumerGroup,
		BatchSize:      o.Prefetch,
		PollInterval:   o.PollInterval,
		ResendInterval: resend,
		AckDeadline:    o.AckTimeout,
		Logger:         o.Logger,
	})
	if err != nil {
		return nil, err
	}
	return &backend{
		pub:           q.Publisher(),
		checkTopic:    sqlitequeue.CheckTopic,
		newSubscriber: q.Subscriber,
		// sqlitequeue keeps a window of Prefetch leased messages per subscription, delays a
		// nacked message by its lease (NackAfter's delay, else NackDelay), counts deliveries in
		// the leases table and gives back what a closing consumer holds.
		native: true,
		close:  q.Close,
		view: func(_ context.Context, topic string) (view, error) {
			return &sqliteView{q: q, group: o.ConsumerGroup, topic: topic}, nil
		},
	}, nil
}
