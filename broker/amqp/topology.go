package amqp

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
)

// QueueType is the type of the queues the topology declares, RabbitMQ's x-queue-type.
type QueueType string

// Queue types.
const (
	// DefaultQueueType declares queues without an x-queue-type argument: the server's default,
	// a classic queue on RabbitMQ 3.x unless the virtual host says otherwise. Queues that
	// onceflow declared before it had queue types are of this type.
	DefaultQueueType QueueType = ""
	// Classic declares classic queues (x-queue-type=classic).
	Classic QueueType = "classic"
	// Quorum declares quorum queues (x-queue-type=quorum): replicated, and counting the
	// deliveries of each message durably.
	Quorum QueueType = "quorum"
)

// URL query parameters of the queue arguments (ParseQueueParams).
const (
	ParamQueueType          = "queue_type"
	ParamDeliveryLimit      = "delivery_limit"
	ParamDeadLetterExchange = "dead_letter_exchange"
)

// Queue holds the arguments of the queues the topology declares. RabbitMQ refuses to declare an
// existing queue with other arguments (PRECONDITION_FAILED), so every publisher and subscriber
// of a topic and group must use the same Queue; changing it means deleting the queue first.
type Queue struct {
	// Type is the queue type. Defaults to DefaultQueueType (no argument).
	Type QueueType

	// DeliveryLimit, when positive, is RabbitMQ's x-delivery-limit (quorum queues only):
	// RabbitMQ drops a message, or dead-letters it to DeadLetterExchange, once it has been
	// returned DeliveryLimit times (nacked, or held by a consumer that went away). It is a
	// backstop: it must be above the router's own delivery limit, or RabbitMQ removes a
	// failing message before the router can dead-letter it with the reason. Zero sets none.
	DeliveryLimit int

	// DeadLetterExchange, when not empty, is RabbitMQ's x-dead-letter-exchange: where RabbitMQ
	// sends the messages it drops at DeliveryLimit, or that a consumer rejects without
	// requeueing (onceflow never does).
	DeadLetterExchange string
}

// Validate reports the first invalid field, naming it.
func (q Queue) Validate() error {
	switch q.Type {
	case DefaultQueueType, Classic, Quorum:
	default:
		return fmt.Errorf("broker/amqp: Queue.Type: %q is not a queue type (want %q or %q)", q.Type, Classic, Quorum)
	}
	if q.DeliveryLimit < 0 {
		return fmt.Errorf("broker/amqp: Queue.DeliveryLimit: %d is negative (0 sets no limit)", q.DeliveryLimit)
	}
	if q.DeliveryLimit > 0 && q.Type != Quorum {
		return fmt.Errorf("broker/amqp: Queue.DeliveryLimit (%s=%d) needs a quorum queue (%s=%s): RabbitMQ's classic queues have no delivery limit",
			ParamDeliveryLimit, q.DeliveryLimit, ParamQueueType, Quorum)
	}
	if len(q.DeadLetterExchange) > 255 {
		return fmt.Errorf("broker/amqp: Queue.DeadLetterExchange: %d bytes is longer than the 255 AMQP allows", len(q.DeadLetterExchange))
	}
	return nil
}

// Args returns the queue arguments of q for queue.declare; nil when q sets none.
func (q Queue) Args() amqp.Table {
	args := amqp.Table{}
	if q.Type != DefaultQueueType {
		args["x-queue-type"] = string(q.Type)
	}
	if q.DeliveryLimit > 0 {
		args["x-delivery-limit"] = int64(q.DeliveryLimit)
	}
	if q.DeadLetterExchange != "" {
		args["x-dead-letter-exchange"] = q.DeadLetterExchange
	}
	if len(args) == 0 {
		return nil
	}
	return args
}

// ParseQueueParams takes the queue parameters out of a RabbitMQ URL: queue_type=classic|quorum,
// delivery_limit=N (quorum only) and dead_letter_exchange=NAME. It returns the URL without
// them, for amqp091's Dial, and the Queue they describe, validated. Its errors never contain the
// URL.
func ParseQueueParams(rawURL string) (string, Queue, error) {
	base, query, hasQuery := strings.Cut(rawURL, "?")
	if !hasQuery {
		return rawURL, Queue{}, nil
	}
	params, err := url.ParseQuery(query)
	if err != nil {
		return "", Queue{}, errors.New("broker/amqp: malformed URL query")
	}
	var q Queue
	last := func(k string) (string, bool) {
		vs, ok := params[k]
		if !ok {
			return "", false
		}
		delete(params, k)
		return vs[len(vs)-1], true
	}
	if v, ok := last(ParamQueueType); ok {
		switch QueueType(v) {
		case Classic, Quorum:
			q.Type = QueueType(v)
		default:
			return "", Queue{}, fmt.Errorf("broker/amqp: URL parameter %s=%q: want %s or %s", ParamQueueType, v, Classic, Quorum)
		}
	}
	if v, ok := last(ParamDeliveryLimit); ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return "", Queue{}, fmt.Errorf("broker/amqp: URL parameter %s=%q: want a positive integer", ParamDeliveryLimit, v)
		}
		q.DeliveryLimit = n
	}
	if v, ok := last(ParamDeadLetterExchange); ok {
		if v == "" {
			return "", Queue{}, fmt.Errorf("broker/amqp: URL parameter %s is empty: want an exchange name", ParamDeadLetterExchange)
		}
		q.DeadLetterExchange = v
	}
	if err := q.Validate(); err != nil {
		return "", Queue{}, err
	}
	if len(params) == 0 {
		return base, q, nil
	}
	return base + "?" + params.Encode(), q, nil
}

// Topology is how topics map to RabbitMQ: each topic is a durable fanout exchange named after
// it, and each consumer group has a durable queue "<topic>.<group>" bound to it, declared with
// the arguments of Queue. Publishers declare it too (it is NewPublisher's TopologyBuilder), so
// that a message published before the group's first subscription waits in the group's queue.
type Topology struct {
	// ConsumerGroup names the queue of each topic. Required.
	ConsumerGroup string
	// Queue holds the queue arguments.
	Queue Queue
}

var _ wamqp.TopologyBuilder = Topology{}

// Validate reports the first invalid field, naming it.
func (t Topology) Validate() error {
	if t.ConsumerGroup == "" {
		return errors.New("broker/amqp: Topology.ConsumerGroup is empty")
	}
	return t.Queue.Validate()
}

// QueueName returns the name of the consumer group's queue of topic.
func (t Topology) QueueName(topic string) string { return topic + "." + t.ConsumerGroup }

// CheckTopic reports a topic whose exchange or queue name AMQP cannot carry.
func (t Topology) CheckTopic(topic string) error {
	if topic == "" {
		return errors.New("broker/amqp: topic is empty")
	}
	if n := len(t.QueueName(topic)); n > 255 {
		return fmt.Errorf("broker/amqp: topic %q: the queue name %q would be %d bytes, AMQP allows 255", topic, t.QueueName(topic), n)
	}
	return nil
}

// Declare declares the exchange of topic, and the consumer group's queue bound to it. A
// failure (a queue that exists with other arguments) closes ch, as RabbitMQ does.
func (t Topology) Declare(ch *amqp.Channel, topic string) error {
	if err := ch.ExchangeDeclare(topic, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", topic, err)
	}
	queue := t.QueueName(topic)
	if _, err := ch.QueueDeclare(queue, true, false, false, false, t.Queue.Args()); err != nil {
		return fmt.Errorf("declare queue %q: %w", queue, err)
	}
	if err := ch.QueueBind(queue, "", topic, false, nil); err != nil {
		return fmt.Errorf("bind queue %q to exchange %q: %w", queue, topic, err)
	}
	return nil
}

// ExchangeDeclare is Declare for watermill-amqp's publisher, whose exchanges are named after
// their topics.
func (t Topology) ExchangeDeclare(ch *amqp.Channel, exchange string, _ wamqp.Config) error {
	return t.Declare(ch, exchange)
}

// BuildTopology is Declare for watermill-amqp's subscriber.
func (t Topology) BuildTopology(ch *amqp.Channel, _ string, exchange string, _ wamqp.Config, _ watermill.LoggerAdapter) error {
	return t.Declare(ch, exchange)
}
