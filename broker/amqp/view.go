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
	ch    *amqp.Channel
	queue string
}

// newView opens views of the group's queues. A topic without its exchange, or a group without
// its queue, is an error wrapping broker.ErrNotFound: the publishers declare both (Topology).
func newView(dsn, group string) func(context.Context, string) (broker.View, error) {
	return func(_ context.Context, topic string) (broker.View, error) {
		conn, err := amqp.Dial(dsn)
		if err != nil {
			return nil, err
		}
		v := &view{conn: conn, queue: Topology{ConsumerGroup: group}.QueueName(topic)}
		ch, err := conn.Channel()
		if err == nil {
			// Passive: look, do not declare. A failed declaration closes the channel.
			if _, err = ch.QueueDeclarePassive(v.queue, true, false, false, false, nil); replyCode(err) == amqp.NotFound {
				err = lookUpExchange(conn, topic, group)
			} else if err != nil {
				err = fmt.Errorf("look up queue %q: %w", v.queue, err)
			}
		}
		if err != nil {
			_ = conn.Close()
			return nil, err
		}
		v.ch = ch
		return v, nil
	}
}

// lookUpExchange returns the error of a group whose queue does not exist: the topic's, when
// its exchange does not exist either, and otherwise the group's.
func lookUpExchange(conn *amqp.Connection, topic, group string) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	err = ch.ExchangeDeclarePassive(topic, amqp.ExchangeFanout, true, false, false, false, nil)
	switch {
	case replyCode(err) == amqp.NotFound:
		return broker.NotFound("topic", topic)
	case err != nil:
		return fmt.Errorf("look up exchange %q: %w", topic, err)
	}
	_ = ch.Close()
	return fmt.Errorf("%w (no queue %q)", broker.NotFound("consumer group", group), Topology{ConsumerGroup: group}.QueueName(topic))
}

func (v *view) List(_ context.Context, limit int) ([]broker.Entry, error) {
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
	err := v.ch.Close()
	if cerr := v.conn.Close(); cerr != nil && !errors.Is(cerr, amqp.ErrClosed) {
		err = errors.Join(err, cerr)
	}
	return err
}
