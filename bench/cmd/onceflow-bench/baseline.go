package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/sqldb"
)

// startBaseline starts the hand-written watermill consumer the issue compares onceflow with:
// watermill's router over watermill-amqp's subscriber (over the SQLite queue's own subscriber
// for the embedded setup), with as many subscriptions as the concurrency, and a handler that
// BEGINs, inserts the message id into a processed-messages table with ON CONFLICT DO NOTHING
// (INSERT IGNORE on MariaDB), inserts the business row when the id was new, COMMITs and
// returns nil, upon which watermill acks. It uses the same pool and prefetch as onceflow.
func (s *suite) startBaseline(ctx context.Context, st setup, brokerURL string, db *sqldb.DB, topic string, tables cellTables, c int, m *meter) (func() error, error) {
	var sub message.Subscriber
	var closeBroker func() error
	switch st.Broker {
	case "amqp":
		cfg := wamqp.NewDurablePubSubConfig(brokerURL, func(topic string) string { return topic + "." + consumerGroup })
		cfg.Consume.Qos.PrefetchCount = s.cfg.prefetch
		if cfg.Consume.Qos.PrefetchCount == 0 {
			cfg.Consume.Qos.PrefetchCount = broker.DefaultPrefetch
		}
		sb, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		sub, closeBroker = sb, sb.Close
	default:
		q, err := sqlitequeue.Open(ctx, brokerURL, sqlitequeue.Config{ConsumerGroup: consumerGroup})
		if err != nil {
			return nil, err
		}
		sb, err := q.Subscriber()
		if err != nil {
			_ = q.Close()
			return nil, err
		}
		sub, closeBroker = sb, func() error { return errors.Join(sb.Close(), q.Close()) }
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
		if fresh > 0 {
			m.tick() // where onceflow's processor counts too: after the business insert
		}
		return tx.Commit()
	}

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		_ = closeBroker()
		return nil, err
	}
	for i := range c {
		r.AddConsumerHandler(fmt.Sprintf("baseline-%d", i), topic, sub, handle)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		_ = closeBroker()
		return nil, fmt.Errorf("watermill router stopped before running: %w", err)
	}
	return func() error {
		cancel()
		err := <-done
		return errors.Join(err, closeBroker())
	}, nil
}

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
