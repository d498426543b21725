package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"

	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/sqldb"
)

// startBaseline starts the hand-written watermill consumer the issue compares onceflow with:
// watermill's router over the broker's watermill subscriber (watermill-amqp, watermill-nats's
// JetStream subscriber, watermill-redisstream, the SQLite queue's own subscriber), with as many
// subscriptions as the concurrency, and a handler that BEGINs, inserts the message id into a
// processed-messages table with ON CONFLICT DO NOTHING (INSERT IGNORE on MariaDB), inserts the
// business row when the id was new, COMMITs and returns nil, upon which watermill acks. It uses
// the same pool and prefetch as onceflow (but on the SQLite queue, see baselineSubscriber).
func (s *suite) startBaseline(ctx context.Context, cl cell, t topic, db *sqldb.DB, tables cellTables, m *meter) (func() error, error) {
	sub, err := baselineSubscriber(ctx, cl, t)
	if err != nil {
		return nil, err
	}
	sub = &closeOnce{Subscriber: sub}

	insertProcessed := db.Rebind(`INSERT INTO ` + tables.processed + ` (id) VALUES (?) ON CONFLICT DO NOTHING`)
	if db.Dialect == sqldb.MySQL {
		insertProcessed = `INSERT IGNORE INTO ` + tables.processed + ` (id) VALUES (?)`
	}
	insertEffect := effectInsert(db, tables.effects)
	pool := db.DB.DB // database/sql, as a hand-written handler would use it
	handle := func(msg *message.Message) (err error) {
		ctx := msg.Context()
		tx, err := pool.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() {
			if err != nil {
				_ = tx.Rollback()
			}
		}()
		res, err := tx.ExecContext(ctx, insertProcessed, msg.UUID)
		if err != nil {
			return err
		}
		fresh, err := res.RowsAffected()
		if err != nil {
			return err
		}
		if fresh > 0 {
			if _, err := tx.ExecContext(ctx, insertEffect, msg.UUID, []byte(msg.Payload)); err != nil {
				return err
			}
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		m.txns.Add(1)
		if fresh > 0 {
			m.committedOne(msg.Metadata.Get(headerSent))
		} else {
			m.settled.Add(1)
		}
		return nil
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	for i := range cl.c {
		r.AddConsumerHandler(fmt.Sprintf("baseline-%d", i), t.name, sub, handle)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		_ = sub.Close()
		return nil, fmt.Errorf("watermill router stopped before running: %w", err)
	}
	return func() error {
		cancel()
		err := <-done
		return errors.Join(err, sub.Close())
	}, nil
}

// baselineSubscriber returns the watermill subscriber of the cell's broker, configured as its
// documentation suggests for a durable consumer group, with the cell's prefetch.
func baselineSubscriber(ctx context.Context, cl cell, t topic) (message.Subscriber, error) {
	switch cl.st.Broker {
	case "amqp":
		cfg := wamqp.NewDurablePubSubConfig(t.brokerURL, func(topic string) string { return topic + "." + consumerGroup })
		cfg.Consume.Qos.PrefetchCount = cl.prefetch
		return wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	case "nats":
		name := func(_, topic string) string { return consumerGroup + "_" + topic }
		return wnats.NewSubscriber(wnats.SubscriberConfig{
			URL:              t.brokerURL,
			QueueGroupPrefix: consumerGroup,
			SubscribersCount: 1,
			AckWaitTimeout:   30 * time.Second,
			CloseTimeout:     10 * time.Second,
			SubjectCalculator: func(prefix, topic string) *wnats.SubjectDetail {
				return &wnats.SubjectDetail{Primary: topic, QueueGroup: name(prefix, topic)}
			},
			JetStream: wnats.JetStreamConfig{
				SubscribeOptions: []nats.SubOpt{nats.ManualAck(), nats.AckExplicit(), nats.DeliverAll(),
					nats.MaxAckPending(groupPending(cl.st, cl.prefetch, cl.c))},
				DurablePrefix:     consumerGroup,
				DurableCalculator: name,
			},
		}, watermill.NopLogger{})
	case "redis":
		client, err := dialRedis(t.brokerURL, 2*cl.c)
		if err != nil {
			return nil, err
		}
		sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client:        client,
			Unmarshaller:  redissub.Marshaller{},
			ConsumerGroup: consumerGroup,
			OldestId:      "0",
		}, watermill.NopLogger{})
		if err != nil {
			_ = client.Close()
			return nil, err
		}
		return sub, nil // its Close closes the client
	}
	// The queue's subscriber hands out its whole window at once, and watermill runs a goroutine
	// per delivery with no bound: a window of 128 per subscription would make that many
	// writers take turns for the SQLite file. The baseline keeps the queue's default window.
	q, err := sqlitequeue.Open(ctx, t.brokerURL, sqlitequeue.Config{ConsumerGroup: consumerGroup})
	if err != nil {
		return nil, err
	}
	sub, err := q.Subscriber()
	if err != nil {
		_ = q.Close()
		return nil, err
	}
	return &withClose{Subscriber: sub, close: q.Close}, nil
}

// withClose is a Subscriber that releases what it alone uses when it is closed.
type withClose struct {
	message.Subscriber
	close func() error
}

func (w *withClose) Close() error { return errors.Join(w.Subscriber.Close(), w.close()) }

// closeOnce lets watermill's router close the subscriber shared by its handlers once.
type closeOnce struct {
	message.Subscriber
	once sync.Once
	err  error
}

func (c *closeOnce) Close() error {
	c.once.Do(func() { c.err = c.Subscriber.Close() })
	return c.err
}
