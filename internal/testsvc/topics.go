package testsvc

import (
	"context"
	"errors"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// RemoveTopics removes what a test left on a shared broker server for its topics: on RabbitMQ
// the topics' exchanges and the queues of groups (and of the group the URL names), on NATS the
// streams that hold the topics (with their consumers), on Redis the streams, on Kafka the
// topics. Brokers that keep
// their messages in a database or a file of the test's own need nothing. Failures are logged,
// not reported: a leftover queue is not a wrong result.
func RemoveTopics(t testing.TB, brokerURL string, groups []string, topics ...string) {
	if len(topics) == 0 {
		return
	}
	u, err := url.Parse(brokerURL)
	if err != nil {
		t.Logf("cleanup of topics %v: %v", topics, err)
		return
	}
	if g := u.Query().Get("group"); g != "" {
		groups = append(slices.Clip(groups), g)
	}
	switch strings.ToLower(u.Scheme) {
	case "amqp", "amqps":
		err = removeAMQP(brokerURL, groups, topics, true)
	case "nats":
		err = removeNATS(brokerURL, topics)
	case "redis", "rediss":
		err = removeRedis(brokerURL, topics)
	case "kafka":
		err = removeKafka(u, topics)
	}
	if err != nil {
		t.Logf("cleanup of topics %v: %v", topics, err)
	}
}

// RemoveQueues removes, on RabbitMQ, the queues that the consumer groups groups (and the group
// the URL names) left for topics, and leaves the topics' exchanges, which other tests at once
// may publish to: for a test that consumes shared topics under groups of its own. Elsewhere it
// does nothing. Failures are logged, not reported.
func RemoveQueues(t testing.TB, brokerURL string, groups []string, topics ...string) {
	u, err := url.Parse(brokerURL)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") {
		return
	}
	if g := u.Query().Get("group"); g != "" {
		groups = append(slices.Clip(groups), g)
	}
	if err := removeAMQP(brokerURL, groups, topics, false); err != nil {
		t.Logf("cleanup of the queues of %v: %v", topics, err)
	}
}

// removeAMQP deletes the queues <topic>.<group>, and with exchanges the exchanges <topic>.
func removeAMQP(brokerURL string, groups, topics []string, exchanges bool) error {
	conn, err := amqp.Dial(brokerURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	var errs []error
	// A name that was never declared makes RabbitMQ close the channel with NOT_FOUND: one
	// channel per deletion.
	del := func(f func(*amqp.Channel) error) {
		ch, err := conn.Channel()
		if err != nil {
			errs = append(errs, err)
			return
		}
		defer ch.Close()
		var e *amqp.Error
		if err := f(ch); err != nil && !(errors.As(err, &e) && e.Code == amqp.NotFound) {
			errs = append(errs, err)
		}
	}
	for _, topic := range topics {
		for _, group := range groups {
			del(func(ch *amqp.Channel) error {
				_, err := ch.QueueDelete(topic+"."+group, false, false, false)
				return err
			})
		}
		if exchanges {
			del(func(ch *amqp.Channel) error { return ch.ExchangeDelete(topic, false, false) })
		}
	}
	return errors.Join(errs...)
}

// removeNATS deletes the stream that holds each topic's subject.
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
	var errs []error
	for _, topic := range topics {
		name, err := js.StreamNameBySubject(topic)
		if errors.Is(err, nats.ErrNoMatchingStream) || errors.Is(err, nats.ErrStreamNotFound) {
			continue
		}
		if err == nil {
			err = js.DeleteStream(name)
		}
		if err != nil && !errors.Is(err, nats.ErrStreamNotFound) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeRedis deletes the topics' streams.
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

// removeKafka deletes the topics (the consumer groups' offsets of them go with them).
func removeKafka(u *url.URL, topics []string) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(u.Host, ",")...))
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := kadm.NewClient(cl).DeleteTopics(ctx, topics...)
	if err != nil {
		return err
	}
	return resp.Error()
}
