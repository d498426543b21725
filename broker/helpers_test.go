package broker_test

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker"
)

// The cleanup functions remove what a test left on a shared server. They report failures
// without failing the test: a leftover queue is not a wrong result.

func cleanupAMQP(t testing.TB, rawURL, topic string) {
	conn, err := amqp.Dial(rawURL)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer ch.Close()
	for _, group := range []string{broker.DefaultConsumerGroup, "billing", "shipping"} {
		if _, err := ch.QueueDelete(broker.AMQPQueueName(topic, group), false, false, false); err != nil {
			t.Logf("cleanup: %v", err)
			return
		}
	}
	if err := ch.ExchangeDelete(topic, false, false); err != nil {
		t.Logf("cleanup: %v", err)
	}
}

func cleanupNATS(t testing.TB, rawURL, topic string) {
	nc, err := nats.Connect(rawURL)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	if err := js.DeleteStream(broker.NATSStreamName(topic)); err != nil && err != nats.ErrStreamNotFound {
		t.Logf("cleanup: %v", err)
	}
}

func cleanupRedis(t testing.TB, rawURL, topic string) {
	opts, err := redis.ParseURL(rawURL)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	c := redis.NewClient(opts)
	defer c.Close()
	if err := c.Del(context.Background(), topic).Err(); err != nil {
		t.Logf("cleanup: %v", err)
	}
}
