package kafka_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	_ "github.com/onceflow/onceflow/broker/kafka"
	"github.com/onceflow/onceflow/internal/kafkatest"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestOpen_PublishesAndSubscribesWithTheGroupOfTheURL(t *testing.T) {
	t.Parallel()
	b, err := broker.Open(context.Background(), kafkatest.URL(t, "group=billing&partitions=2&nack_delay=0"), broker.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	require.Equal(t, "kafka", b.Scheme())
	require.Equal(t, "kafka", b.MessagingSystem())
	require.Equal(t, "billing", b.ConsumerGroup())

	topic := testsvc.UniqueName("t")
	require.NoError(t, b.Publisher().Publish(topic, message.NewMessage("m-1", []byte("one"))))
	sub, err := b.Subscriber()
	require.NoError(t, err)
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	m := testsvc.Receive(t, ch, within)
	require.Equal(t, "m-1", m.UUID)
	m.Nack()
	m = testsvc.Receive(t, ch, within)
	require.Equal(t, "m-1", m.UUID)
	m.Ack()
	require.NoError(t, sub.Close())
}

func TestOpen_RejectsWhatTheSchemeCannotRead(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ url, want string }{
		{"kafka://user:secret@127.0.0.1:1/", "SASL"},
		{"kafka://127.0.0.1:1/path", "path"},
		{"kafka://127.0.0.1:1/?partitions=0", "partitions"},
		{"kafka://127.0.0.1:1/?replication_factor=x", "replication_factor"},
		{"kafka://127.0.0.1:1/?linger=5ms", "unknown query parameter"},
	} {
		_, err := broker.Open(context.Background(), tc.url, broker.Options{})
		require.ErrorContains(t, err, tc.want, tc.url)
		require.NotContains(t, err.Error(), "secret")
	}
	b, err := broker.Open(context.Background(), kafkatest.URL(t, ""), broker.Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, b.Close()) }()
	require.ErrorContains(t, b.Publisher().Publish("a b", message.NewMessage("x", nil)), "Kafka topic")
}
