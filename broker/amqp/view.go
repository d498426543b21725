package amqp

import (
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/broker"
)

// view reads the group's queue <topic>.<group> with basic.get, without acknowledging: the
// messages it gets stay unacknowledged on its channel, hidden from other consumers, until
// Remove acknowledges one or Close closes the channel, which makes RabbitMQ put the rest back
// in their places.
type view struct {
	conn  *amqp.Connection
	ch    *amqp.Channel // nil when the queue does not exist
	queue string
}

func newView(dsn, group string) func(context.Context, string) (broker.View, error) {
	return func(_ context.Context, topic string) (broker.View, error) {
		conn, err := amqp.Dial(dsn)
		if err != nil {
			return nil, err
		}
		v := &view{conn: conn, queue: Topology{ConsumerGroup: group}.QueueName(topic)}
		ch, err := conn.Channel()
		if err != nil {
			_ = conn.Close()
			return nil, err
		}
		// Passive: look, do not declare. A queue that does not exist has no messages; the
		// failed declaration closes the channel.
		if _, err := ch.QueueDeclarePassive(v.queue, true, false, false, false, nil); err != nil {
			var ae *amqp.Error
			if errors.As(err, &ae) && ae.Code == amqp.NotFound {
				return v, nil
			}
			_ = conn.Close()
			return nil, fmt.Errorf("look up queue %q: %w", v.queue, err)
		}
		v.ch = ch
		return v, nil
	}
}

func (v *view) List(_ context.Context, limit int) ([]broker.Entry, error) {
	if v.ch == nil {
		return nil, nil
	}
	var out []broker.Entry
	for len(out) < limit {
		d, ok, err := v.ch.Get(v.queue, false)
		if err != nil {
			return nil, fmt.Errorf("basic.get from queue %q: %w", v.queue, err)
		}
		if !ok {
			break
		}
		msg, _ := Marshaler{}.Unmarshal(d) // never fails
		out = append(out, broker.Entry{Message: msg, Pos: d.DeliveryTag})
	}
	return out, nil
}

func (v *view) Remove(_ context.Context, e broker.Entry) error {
	if err := v.ch.Ack(e.Pos.(uint64), false); err != nil {
		return fmt.Errorf("ack on queue %q: %w", v.queue, err)
	}
	return nil
}

// Close closes the channel, synchronously: RabbitMQ has handled the acknowledgements sent on it
// when close returns, and has put the messages not acknowledged back in the queue.
func (v *view) Close() error {
	var err error
	if v.ch != nil {
		err = v.ch.Close()
	}
	if cerr := v.conn.Close(); cerr != nil && !errors.Is(cerr, amqp.ErrClosed) {
		err = errors.Join(err, cerr)
	}
	return err
}
