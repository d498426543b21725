package conformance

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
)

// removeTopics removes what a test left on a shared server for its topics: the AMQP
// exchanges and the consumer group's queues, the NATS streams (with their consumers), the Redis
// streams. A broker that keeps its messages in a database or a file of the test's own needs
// nothing. Failures are logged, not reported: a leftover queue is not a wrong result.
func removeTopics(t testing.TB, brokerURL, group string, topics []string) {
	if len(topics) == 0 {
		return
	}
	if u, err := url.Parse(brokerURL); err == nil {
		if g := u.Query().Get("group"); g != "" {
			group = g
		}
	}
	var err error
	switch scheme(brokerURL) {
	case "amqp", "amqps":
		err = removeAMQP(brokerURL, group, topics)
	case "nats":
		err = removeNATS(brokerURL, topics)
	case "redis", "rediss":
		err = removeRedis(brokerURL, topics)
	}
	if err != nil {
		t.Logf("cleanup of topics %v: %v", topics, err)
	}
}

func removeAMQP(brokerURL, group string, topics []string) error {
	conn, err := amqp.Dial(brokerURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	var errs []error
	for _, topic := range topics {
		// A topic that was never declared makes RabbitMQ close the channel with NOT_FOUND:
		// one channel per topic.
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		if _, err := ch.QueueDelete(topic+"."+group, false, false, false); err != nil && !amqpNotFound(err) {
			errs = append(errs, err)
		} else if err == nil {
			if err := ch.ExchangeDelete(topic, false, false); err != nil && !amqpNotFound(err) {
				errs = append(errs, err)
			}
		}
		_ = ch.Close()
	}
	return errors.Join(errs...)
}

func amqpNotFound(err error) bool {
	var e *amqp.Error
	return errors.As(err, &e) && e.Code == amqp.NotFound
}

func removeNATS(brokerURL string, topics []string) error {
	nc, err := nats.Connect(brokerURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return err
	}
	// The suite's topics are plain names: each is its stream's name.
	var errs []error
	for _, topic := range topics {
		if err := js.DeleteStream(topic); err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func removeRedis(brokerURL string, topics []string) error {
	opts, err := redis.ParseURL(brokerURL)
	if err != nil {
		return err
	}
	c := redis.NewClient(opts)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Del(ctx, topics...).Err()
}
