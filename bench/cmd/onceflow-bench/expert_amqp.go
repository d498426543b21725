package main

import (
	"context"
	"errors"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// startExpertAMQP starts the expert consumer of RabbitMQ on amqp091-go: c workers, each one
// channel with prefetch 128 consuming the topic's queue. A worker collects up to 64 deliveries
// or 2 ms, applies them in one transaction and acknowledges them all with one
// Ack(last tag, multiple); when the transaction fails it gives them all back with
// Nack(last tag, multiple, requeue). A delivery without an id is rejected on its own. The
// returned stop ends the workers after their current batch and closes the connection, which
// gives back the deliveries not acknowledged.
func startExpertAMQP(ctx context.Context, t topic, c int, x *expertSQL, m *meter) (func() error, error) {
	conn, err := amqp.Dial(t.brokerURL)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	errs := make([]error, c)
	stop := func() error {
		cancel()
		wg.Wait()
		return errors.Join(append(errs, conn.Close())...)
	}
	for i := range c {
		ch, err := conn.Channel()
		if err == nil {
			err = ch.Qos(expertPrefetch, 0, false)
		}
		var deliveries <-chan amqp.Delivery
		if err == nil {
			deliveries, err = ch.Consume(t.queue(), "", false, false, false, false, nil)
		}
		if err != nil {
			_ = stop()
			return nil, err
		}
		wg.Go(func() { errs[i] = amqpWorker(runCtx, ch, deliveries, x, m) })
	}
	return stop, nil
}

func amqpWorker(ctx context.Context, ch *amqp.Channel, deliveries <-chan amqp.Delivery, x *expertSQL, m *meter) error {
	buf := make([]amqp.Delivery, 0, expertBatch)
	msgs := make([]inMsg, 0, expertBatch)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	// The transaction of a batch runs to its end when the consumer stops.
	dbCtx := context.WithoutCancel(ctx)
	for {
		batch, ok := collect(ctx, deliveries, buf[:0], expertBatch, expertWait, timer)
		if !ok {
			return nil
		}
		msgs = msgs[:0]
		var last uint64
		for _, d := range batch {
			id := d.MessageId
			if id == "" {
				if err := d.Reject(false); err != nil {
					return err
				}
				m.fail(errNoID)
				continue
			}
			msgs = append(msgs, inMsg{id: id, payload: d.Body, sent: sentAt(d.Headers[headerSent])})
			last = d.DeliveryTag
		}
		if len(msgs) == 0 {
			continue
		}
		fresh, err := x.apply(dbCtx, msgs)
		if err != nil {
			m.fail(err)
			if err := ch.Nack(last, true, true); err != nil {
				return err
			}
			continue
		}
		m.committed(fresh, len(msgs))
		if err := ch.Ack(last, true); err != nil {
			return err
		}
	}
}
