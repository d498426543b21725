package broker

import (
	"encoding/json"
	"fmt"
	"math/big"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/onceflow/onceflow/messagedata"
)

// HeaderAMQPRedelivered is set to "true" on a message that RabbitMQ delivered with its
// redelivered flag: it was delivered before, to this or another consumer, and not acked.
const HeaderAMQPRedelivered = "amqp_redelivered"

// amqpPublishChannels is the number of AMQP channels the publisher keeps open: concurrent
// Publish calls up to that number proceed in parallel, each waiting for its confirms.
const amqpPublishChannels = 8

// amqpQueueName names the durable queue of a consumer group on a topic.
func amqpQueueName(topic, group string) string { return topic + "." + group }

func openAMQP(t *target, o Options) (*backend, error) {
	prefetch := o.Prefetch
	if prefetch == 0 {
		prefetch = DefaultPrefetch
	}
	group := o.ConsumerGroup
	cfg := wamqp.Config{
		Connection: wamqp.ConnectionConfig{AmqpURI: t.dsn, Reconnect: wamqp.DefaultReconnectConfig()},
		Marshaler:  AMQPMarshaler{},
		Exchange: wamqp.ExchangeConfig{
			GenerateName: func(topic string) string { return topic },
			Type:         "fanout",
			Durable:      true,
		},
		Queue: wamqp.QueueConfig{
			GenerateName: func(topic string) string { return amqpQueueName(topic, group) },
			Durable:      true,
		},
		QueueBind: wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "" }},
		Publish: wamqp.PublishConfig{
			GenerateRoutingKey: func(string) string { return "" },
			ConfirmDelivery:    true,
			ChannelPoolSize:    amqpPublishChannels,
		},
		Consume:         wamqp.ConsumeConfig{Qos: wamqp.QosConfig{PrefetchCount: prefetch}},
		TopologyBuilder: amqpTopology{},
	}
	pub, err := wamqp.NewPublisher(cfg, o.Logger)
	if err != nil {
		return nil, err
	}
	return &backend{
		pub: pub,
		checkTopic: func(topic string) error {
			if n := len(amqpQueueName(topic, group)); n > 255 {
				return fmt.Errorf("broker: topic %q: the queue name %q would be %d bytes, AMQP allows 255", topic, amqpQueueName(topic, group), n)
			}
			return nil
		},
		newSubscriber: func() (message.Subscriber, error) {
			return wamqp.NewSubscriber(cfg, o.Logger)
		},
		// watermill-amqp nacks with requeue: RabbitMQ redelivers at once.
		relayNackDelay: o.nackDelay(),
		nackOnClose:    true,
		view:           newAMQPView(t.dsn, group),
	}, nil
}

// amqpTopology declares, for a topic, a durable fanout exchange named after the topic and the
// durable queue of the consumer group, bound to it. The publisher declares them too, so that a
// message published before any consumer of the group has subscribed waits in the group's queue
// instead of being dropped by an exchange with no queue bound.
type amqpTopology struct{}

var _ wamqp.TopologyBuilder = amqpTopology{}

// ExchangeDeclare declares the exchange of a topic, and the queue of the configured consumer
// group bound to it.
func (amqpTopology) ExchangeDeclare(ch *amqp.Channel, exchange string, cfg wamqp.Config) error {
	if err := ch.ExchangeDeclare(exchange, cfg.Exchange.Type, cfg.Exchange.Durable, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", exchange, err)
	}
	queue := cfg.Queue.GenerateName(exchange) // the exchange is named after the topic
	if _, err := ch.QueueDeclare(queue, cfg.Queue.Durable, false, false, false, nil); err != nil {
		return fmt.Errorf("declare queue %q: %w", queue, err)
	}
	if err := ch.QueueBind(queue, "", exchange, false, nil); err != nil {
		return fmt.Errorf("bind queue %q to exchange %q: %w", queue, exchange, err)
	}
	return nil
}

// BuildTopology declares what a subscription needs: the same as ExchangeDeclare.
func (t amqpTopology) BuildTopology(ch *amqp.Channel, _ string, exchange string, cfg wamqp.Config, _ watermill.LoggerAdapter) error {
	return t.ExchangeDeclare(ch, exchange, cfg)
}

// AMQPMarshaler converts between watermill messages and AMQP messages, tolerantly. It
// implements watermill-amqp's Marshaler.
//
// Marshal stores the metadata as string headers, the message UUID in the header
// "_watermill_message_uuid" and in the AMQP message_id property, the onceflow_timestamp header
// (when it parses as RFC 3339) in the timestamp property, and makes the message persistent.
//
// Unmarshal never fails, so that no delivery is nacked forever for its headers, as happens
// with watermill-amqp's default marshaler on a header that is not a string (RabbitMQ's x-death,
// numbers and booleans set by other producers). It turns every header into a string: numbers,
// booleans and decimals in their usual text form, timestamps in RFC 3339 with nanoseconds,
// byte arrays as text, tables and arrays (x-death) as JSON. The UUID comes from the header
// "_watermill_message_uuid" and is empty without it; the AMQP message_id property goes to the
// header amqp_message_id (messagedata.HeaderAMQPMessageID), the timestamp property to
// onceflow_timestamp unless that header is set, and the redelivered flag to amqp_redelivered.
type AMQPMarshaler struct{}

var _ wamqp.Marshaler = AMQPMarshaler{}

// Marshal converts msg to an AMQP publishing.
func (AMQPMarshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	headers := make(amqp.Table, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		switch k {
		case messagedata.HeaderAMQPMessageID, HeaderAMQPRedelivered:
			// Properties of a delivery, not headers of the message.
			continue
		}
		headers[k] = v
	}
	id := msg.UUID
	if id == "" {
		id = msg.Metadata.Get(messagedata.HeaderAMQPMessageID)
	}
	if msg.UUID != "" {
		headers[wamqp.DefaultMessageUUIDHeaderKey] = msg.UUID
	}
	if len(id) > 255 {
		return amqp.Publishing{}, fmt.Errorf("message id %q is %d bytes, the AMQP message_id property allows 255", id, len(id))
	}
	p := amqp.Publishing{
		Headers:      headers,
		Body:         msg.Payload,
		DeliveryMode: amqp.Persistent,
		MessageId:    id,
	}
	if ts, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(messagedata.HeaderTimestamp)); err == nil {
		p.Timestamp = ts
	}
	return p, nil
}

// Unmarshal converts an AMQP delivery to a watermill message. It never returns an error.
func (AMQPMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	md := make(message.Metadata, len(d.Headers)+3)
	var id string
	for k, v := range d.Headers {
		if k == wamqp.DefaultMessageUUIDHeaderKey {
			id = headerString(v)
			continue
		}
		md[k] = headerString(v)
	}
	if d.MessageId != "" {
		md[messagedata.HeaderAMQPMessageID] = d.MessageId
	}
	if _, ok := md[messagedata.HeaderTimestamp]; !ok && !d.Timestamp.IsZero() {
		md[messagedata.HeaderTimestamp] = d.Timestamp.UTC().Format(time.RFC3339Nano)
	}
	if d.Redelivered {
		md[HeaderAMQPRedelivered] = "true"
	}
	msg := message.NewMessage(id, d.Body)
	msg.Metadata = md
	return msg, nil
}

// headerString renders an AMQP field value as a string.
func headerString(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	case bool:
		return strconv.FormatBool(v)
	case int8, int16, int32, int64, int, uint8, uint16, uint32, uint64, uint:
		return fmt.Sprint(v)
	case float32:
		return strconv.FormatFloat(float64(v), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case amqp.Decimal:
		return decimalString(v)
	}
	b, err := json.Marshal(jsonValue(v))
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// jsonValue prepares an AMQP field value for JSON: tables and arrays recursively, byte arrays
// as text, timestamps in RFC 3339, decimals as numbers in text.
func jsonValue(v any) any {
	switch v := v.(type) {
	case amqp.Table:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[k] = jsonValue(x)
		}
		return out
	case map[string]any:
		return jsonValue(amqp.Table(v))
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = jsonValue(x)
		}
		return out
	case []byte:
		return string(v)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case amqp.Decimal:
		return json.Number(decimalString(v))
	}
	return v
}

// decimalString renders an AMQP decimal (Value × 10^-Scale) exactly.
func decimalString(d amqp.Decimal) string {
	r := new(big.Rat).SetFrac(big.NewInt(int64(d.Value)), new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(d.Scale)), nil))
	return r.FloatString(int(d.Scale))
}
