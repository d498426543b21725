package broker_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	rabbitmq "github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

// amqpFixture is a test's broker, topic and a plain amqp091 channel standing for producers and
// consumers that are not watermill.
type amqpFixture struct {
	*fixture
	ch *amqp.Channel
}

func setupAMQP(t *testing.T) *amqpFixture {
	f := setup(t, scheme{name: "amqp", url: testsvc.AMQPURL, cleanup: removeTopic}, testTimings)
	conn, err := amqp.Dial(testsvc.AMQPURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	return &amqpFixture{fixture: f, ch: ch}
}

// publishRaw publishes p to the topic's exchange as a plain AMQP producer and waits for the
// broker's confirm.
func (f *amqpFixture) publishRaw(p amqp.Publishing) {
	f.t.Helper()
	conf, err := f.ch.PublishWithDeferredConfirmWithContext(context.Background(), f.topic, "", false, false, p)
	require.NoError(f.t, err)
	ok, err := conf.WaitContext(context.Background())
	require.NoError(f.t, err)
	require.True(f.t, ok, "publish not confirmed")
}

func TestAMQP_MessageIDPropertyOfAForeignProducerIsTheID(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	b := f.open(broker.Options{})
	_, msgs := f.subscribe(b)
	sent := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	f.publishRaw(amqp.Publishing{MessageId: "ext-1", Timestamp: sent, Body: []byte("from elsewhere")})

	m := receive(t, msgs)
	require.Empty(t, m.UUID, "no watermill uuid header: the UUID stays empty")
	require.Equal(t, "ext-1", m.Metadata.Get(messagedata.HeaderAMQPMessageID))
	require.Equal(t, "2026-03-04T05:06:07Z", m.Metadata.Get(messagedata.HeaderTimestamp))
	require.Equal(t, "from elsewhere", string(m.Payload))
	md, err := converter.New(converter.Config{}).FromMessage(f.topic, m)
	require.NoError(t, err)
	require.Equal(t, "ext-1", md.ID)
	require.Equal(t, sent, md.Timestamp.UTC())
	m.Ack()
}

func TestAMQP_MessageWithoutAnyIDHasAnEmptyID(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	b := f.open(broker.Options{})
	_, msgs := f.subscribe(b)
	f.publishRaw(amqp.Publishing{Body: []byte("anonymous")})

	m := receive(t, msgs)
	require.Empty(t, m.UUID)
	_, has := m.Metadata[messagedata.HeaderAMQPMessageID]
	require.False(t, has, "no message_id property: no %s header", messagedata.HeaderAMQPMessageID)
	_, err := converter.New(converter.Config{}).FromMessage(f.topic, m)
	require.ErrorIs(t, err, messagedata.ErrNoMessageID)
	m.Ack()
}

func TestAMQP_NonStringHeadersAreConsumedAsText(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	b := f.open(broker.Options{})
	_, msgs := f.subscribe(b)
	death := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f.publishRaw(amqp.Publishing{
		MessageId: "dead-1",
		Headers: amqp.Table{
			"x-death": []any{amqp.Table{
				"count":        int64(2),
				"reason":       "rejected",
				"queue":        "orders",
				"time":         death,
				"routing-keys": []any{"orders"},
			}},
			"x-count":  int32(3),
			"x-big":    int64(1) << 40,
			"x-flag":   true,
			"x-ratio":  1.5,
			"x-bytes":  []byte("raw"),
			"x-price":  amqp.Decimal{Scale: 2, Value: 1999},
			"x-when":   death,
			"x-string": "plain",
		},
		Body: []byte("with headers"),
	})

	m := receive(t, msgs) // the default marshaler would nack this delivery for ever
	require.Equal(t, "3", m.Metadata.Get("x-count"))
	require.Equal(t, "1099511627776", m.Metadata.Get("x-big"))
	require.Equal(t, "true", m.Metadata.Get("x-flag"))
	require.Equal(t, "1.5", m.Metadata.Get("x-ratio"))
	require.Equal(t, "raw", m.Metadata.Get("x-bytes"))
	require.Equal(t, "19.99", m.Metadata.Get("x-price"))
	require.Equal(t, "2026-01-02T03:04:05Z", m.Metadata.Get("x-when"))
	require.Equal(t, "plain", m.Metadata.Get("x-string"))
	var xDeath []map[string]any
	require.NoError(t, json.Unmarshal([]byte(m.Metadata.Get("x-death")), &xDeath), m.Metadata.Get("x-death"))
	require.Equal(t, []map[string]any{{
		"count":        float64(2),
		"reason":       "rejected",
		"queue":        "orders",
		"time":         "2026-01-02T03:04:05Z",
		"routing-keys": []any{"orders"},
	}}, xDeath)
	require.Equal(t, "dead-1", m.Metadata.Get(messagedata.HeaderAMQPMessageID))
	m.Ack()
}

func TestAMQP_PublishSetsMessageIDPropertyAndPersistence(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	b := f.open(broker.Options{})
	m := f.message(1)
	m.Metadata.Set(messagedata.HeaderTimestamp, "2026-05-06T07:08:09.5Z")
	m.Metadata.Set(messagedata.HeaderAMQPMessageID, "stale") // a property, never a header
	f.publish(b, m)                                          // before any subscription

	// The publisher declared the default group's queue: read it as a plain consumer.
	d, ok, err := f.ch.Get(queueName(f.topic, broker.DefaultConsumerGroup), false)
	require.NoError(t, err)
	require.True(t, ok, "the message is waiting in the consumer group's queue")
	require.Equal(t, m.UUID, d.MessageId)
	require.Equal(t, m.UUID, d.Headers["_watermill_message_uuid"])
	require.Equal(t, uint8(amqp.Persistent), d.DeliveryMode)
	require.Equal(t, time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC), d.Timestamp.UTC(), "AMQP timestamps have whole seconds")
	require.Equal(t, "v1", d.Headers["k"])
	_, has := d.Headers[messagedata.HeaderAMQPMessageID]
	require.False(t, has)
	require.NoError(t, d.Ack(false))
}

func TestAMQP_RedeliveredFlagBecomesAHeader(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	b := f.open(broker.Options{})
	_, msgs := f.subscribe(b)
	f.publish(b, f.message(1))

	first := receive(t, msgs)
	require.Empty(t, first.Metadata.Get(broker.HeaderAMQPRedelivered))
	first.Nack()
	again := receive(t, msgs)
	require.Equal(t, first.UUID, again.UUID)
	require.Equal(t, "true", again.Metadata.Get(broker.HeaderAMQPRedelivered))
	again.Ack()
}

func TestAMQP_PrefetchComesFromTheURL(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	f.url = withParams(f.url, "prefetch=3")
	b := f.open(broker.Options{Prefetch: 50})
	_, msgs := f.subscribe(b)
	for i := range 5 {
		f.publish(b, f.message(i))
	}
	held := receive(t, msgs) // not acked: the subscription holds prefetch=3 messages
	q := queueName(f.topic, broker.DefaultConsumerGroup)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		info, err := f.ch.QueueDeclarePassive(q, true, false, false, false, nil)
		return err == nil && info.Messages == 2
	}, "queue %s should keep 5 - 3 prefetched = 2 messages ready", q)
	held.Ack()
}

// queue_type=quorum makes the publisher and the subscriber declare quorum queues, with the
// delivery limit of the URL; the delivery count then comes from RabbitMQ.
func TestAMQP_QuorumQueueWithADeliveryLimitFromTheURL(t *testing.T) {
	t.Parallel()
	f := setupAMQP(t)
	f.url = withParams(f.url, "queue_type=quorum&delivery_limit=10")
	b := f.open(broker.Options{})
	_, msgs := f.subscribe(b)
	f.publish(b, f.message(1))

	first := receive(t, msgs)
	info, ok := redelivery.FromContext(first.Context())
	require.True(t, ok, "the Broker hands the subscriber's messages through, with their redelivery.Info")
	require.Equal(t, redelivery.Info{Count: 1, DelaysNacks: true}, info)
	require.True(t, redelivery.NackAfter(first, 0))
	again := receive(t, msgs)
	info, _ = redelivery.FromContext(again.Context())
	require.Equal(t, 2, info.Count)
	again.Ack()

	// RabbitMQ holds the queue as declared: the same arguments are equivalent, none are not.
	q := queueName(f.topic, broker.DefaultConsumerGroup)
	conn, err := amqp.Dial(testsvc.AMQPURL(t))
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(10)})
	require.NoError(t, err)
	_, err = ch.QueueDeclare(q, true, false, false, false, nil)
	require.ErrorContains(t, err, "PRECONDITION_FAILED")
}

func TestOpen_AMQPQueueParametersAreCheckedBeforeConnecting(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ params, want string }{
		{"delivery_limit=5", "delivery_limit=5) needs a quorum queue (queue_type=quorum)"},
		{"queue_type=classic&delivery_limit=5", "needs a quorum queue"},
		{"queue_type=lazy", `queue_type="lazy"`},
		{"queue_type=quorum&delivery_limit=-1", `delivery_limit="-1"`},
		{"dead_letter_exchange=", "dead_letter_exchange is empty"},
	} {
		t.Run(tc.params, func(t *testing.T) {
			t.Parallel()
			// Nothing listens on port 1: the error comes before any connection.
			_, err := broker.Open(context.Background(), "amqp://user:S3cr3t@127.0.0.1:1/?"+tc.params, broker.Options{})
			require.ErrorContains(t, err, tc.want)
			require.NotContains(t, err.Error(), "S3cr3t")
		})
	}
}

// queueName names the queue of a consumer group on a topic, as the amqp scheme declares it.
func queueName(topic, group string) string {
	return rabbitmq.Topology{ConsumerGroup: group}.QueueName(topic)
}
