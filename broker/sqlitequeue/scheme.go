package sqlitequeue

import (
	"context"
	"time"

	"github.com/onceflow/onceflow/broker"
)

func init() { broker.Register("sqlite", openScheme, broker.Params{Database: true}) }

// openScheme opens the queue file: broker.Open's sqlite:// scheme. A file has no connect to
// bound: opts.ConnectTimeout does not apply.
func openScheme(ctx context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	resend := max(o.NackDelay, 0)
	if resend == 0 {
		resend = time.Millisecond // zero would select sqlitequeue's default
	}
	open := Open
	if o.MustExist {
		open = OpenExisting
	}
	q, err := open(ctx, t.URL, Config{
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
	return &broker.Backend{
		Publisher:     q.Publisher(),
		CheckTopic:    CheckTopic,
		NewSubscriber: q.Subscriber,
		Trim:          q.Trim,
		Close:         q.Close,
		View: func(ctx context.Context, topic string) (broker.View, error) {
			// A group that has not subscribed has no row of its own: only the topic can be
			// looked up.
			if _, err := q.existingTables(ctx, topic); err != nil {
				return nil, err
			}
			return q.view(topic, o.ConsumerGroup), nil
		},
	}, nil
}
