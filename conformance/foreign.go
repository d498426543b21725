package conformance

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/nats-io/nats.go"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/messagedata"
)

// KafkaProducer is a plain franz-go producer: it writes a record with the value payload to the
// topic, with the header onceflow_id and the key id when id is not empty (Kafka has no message
// id of its own: an offset is a position), and no header nor key otherwise. brokerURL is a
// kafka:// URL.
func KafkaProducer(t testing.TB, brokerURL, topic, id string, payload []byte) {
	t.Helper()
	u, err := url.Parse(brokerURL)
	require.NoError(t, err)
	cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(u.Host, ",")...))
	require.NoError(t, err)
	defer cl.Close()
	r := &kgo.Record{Topic: topic, Value: payload}
	if id != "" {
		r.Key = []byte(id)
		r.Headers = []kgo.RecordHeader{{Key: messagedata.HeaderID, Value: []byte(id)}}
	}
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	defer cancel()
	require.NoError(t, cl.ProduceSync(ctx, r).FirstErr())
}

// publishTimeout bounds a foreign producer's publish.
const publishTimeout = 10 * time.Second

// AMQPProducer is a plain amqp091 producer: it publishes a persistent message to the topic's
// exchange, with id as the AMQP message_id property (none when id is empty) and no watermill
// header, and waits for the publisher confirm.
func AMQPProducer(t testing.TB, brokerURL, topic, id string, payload []byte) {
	t.Helper()
	amqpPublish(t, brokerURL, topic, amqp.Publishing{
		MessageId:    id,
		DeliveryMode: amqp.Persistent,
		ContentType:  "text/plain",
		Body:         payload,
	})
}

// AMQPUUIDProducer is a plain amqp091 producer that carries id in watermill's UUID header
// (_watermill_message_uuid), which RabbitMQ stores whatever its length, and sets no message_id
// property, which holds 255 bytes: the way a message id longer than that reaches an onceflow
// consumer on RabbitMQ. It waits for the publisher confirm.
func AMQPUUIDProducer(t testing.TB, brokerURL, topic, id string, payload []byte) {
	t.Helper()
	amqpPublish(t, brokerURL, topic, amqp.Publishing{
		Headers:      amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: id},
		DeliveryMode: amqp.Persistent,
		Body:         payload,
	})
}

// amqpPublish publishes p to the topic's exchange and waits for the publisher confirm.
func amqpPublish(t testing.TB, brokerURL, topic string, p amqp.Publishing) {
	t.Helper()
	conn, err := amqp.Dial(brokerURL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	defer cancel()
	conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, topic, "", false, false, p)
	require.NoError(t, err)
	ok, err := conf.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, ok, "RabbitMQ did not confirm the publish")
}

// NATSProducer is a plain nats.go JetStream producer: it publishes to the subject topic, with
// id as the Nats-Msg-Id header (none when id is empty), and waits for the JetStream
// acknowledgement. The topic's stream must exist: a subscribed router has created it.
func NATSProducer(t testing.TB, brokerURL, topic, id string, payload []byte) {
	t.Helper()
	nc, err := nats.Connect(brokerURL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := nc.JetStream()
	require.NoError(t, err)
	opts := []nats.PubOpt{nats.AckWait(publishTimeout)}
	if id != "" {
		opts = append(opts, nats.MsgId(id))
	}
	_, err = js.Publish(topic, payload, opts...)
	require.NoError(t, err)
}

// RedisProducer is a plain go-redis producer: it appends an entry to the stream topic with the
// field payload and, when id is not empty, the field onceflow_id (Redis has no message id of
// its own: an entry id is a position in the stream).
func RedisProducer(t testing.TB, brokerURL, topic, id string, payload []byte) {
	t.Helper()
	opts, err := redis.ParseURL(brokerURL)
	require.NoError(t, err)
	c := redis.NewClient(opts)
	defer c.Close()
	values := map[string]any{"payload": payload}
	if id != "" {
		values[messagedata.HeaderID] = id
	}
	ctx, cancel := context.WithTimeout(context.Background(), publishTimeout)
	defer cancel()
	require.NoError(t, c.XAdd(ctx, &redis.XAddArgs{Stream: topic, Values: values}).Err())
}
