package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/onceflow/onceflow/broker"
	rabbitmq "github.com/onceflow/onceflow/broker/amqp"
	redissub "github.com/onceflow/onceflow/broker/redis"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
)

// headerSent carries the time a message was published, in Unix nanoseconds, for the latency of
// the steady-state scenario. Every consumer reads it from its broker's headers (a field of the
// stream entry on Redis, which onceflow's subscriber turns into a header).
const headerSent = "bench_sent_at"

// A topic is the stream of one cell on its broker, laid out as onceflow's broker adapters lay
// it out, so that onceflow, the watermill baseline and the expert all consume what the same
// code published:
//
//	amqp    a fanout exchange named after the topic, the durable queue "<topic>.bench" bound to it
//	nats    a JetStream stream named after the topic, capturing its subject (file storage)
//	redis   the stream <topic>, with the consumer group "bench" from its first entry
//	sqlite  the queue's table of the topic in the cell's queue file
type topic struct {
	st        setup
	brokerURL string
	name      string
}

// prepare creates the topic on its broker. The consumers find it there; onceflow's would create
// it the same way.
func (t topic) prepare(ctx context.Context) error {
	switch t.st.Broker {
	case "amqp":
		conn, err := amqp.Dial(t.brokerURL)
		if err != nil {
			return err
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return err
		}
		defer ch.Close()
		if err := ch.ExchangeDeclare(t.name, "fanout", true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(t.queue(), true, false, false, false, nil); err != nil {
			return err
		}
		return ch.QueueBind(t.queue(), "", t.name, false, nil)
	case "nats":
		nc, js, err := dialJetStream(t.brokerURL)
		if err != nil {
			return err
		}
		defer nc.Close()
		_, err = js.CreateStream(ctx, jetstream.StreamConfig{
			Name: t.name, Subjects: []string{t.name}, Storage: jetstream.FileStorage, Retention: jetstream.LimitsPolicy,
		})
		return err
	case "redis":
		c, err := dialRedis(t.brokerURL, 0)
		if err != nil {
			return err
		}
		defer c.Close()
		return c.XGroupCreateMkStream(ctx, t.name, consumerGroup, "0").Err()
	}
	return nil // the SQLite queue creates its tables on the first publish
}

// queue is the AMQP queue of the bench's consumer group.
func (t topic) queue() string { return t.name + "." + consumerGroup }

// remove deletes what the cell left on a broker server: the topic and its dead-letter topic.
// The SQLite queue is a file of the cell's directory, removed with it.
func (t topic) remove() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	names := []string{t.name, t.name + "_dead"}
	switch t.st.Broker {
	case "amqp":
		deleteAMQPTopic(t.brokerURL, t.name)
	case "nats":
		nc, js, err := dialJetStream(t.brokerURL)
		if err != nil {
			return
		}
		defer nc.Close()
		for _, n := range names {
			if stream, err := js.StreamNameBySubject(ctx, n); err == nil {
				_ = js.DeleteStream(ctx, stream)
			}
		}
	case "redis":
		c, err := dialRedis(t.brokerURL, 0)
		if err != nil {
			return
		}
		defer c.Close()
		_ = c.Del(ctx, names...).Err()
	}
}

// sender puts messages on a topic. send may return before the broker has stored them; wait
// returns once every message sent so far is stored.
type sender interface {
	send(ctx context.Context, msgs []*message.Message) error
	wait(ctx context.Context) error
	close() error
}

// newSender returns a sender to t, with a connection of its own.
func newSender(ctx context.Context, t topic) (sender, error) {
	switch t.st.Broker {
	case "amqp":
		return newAMQPSender(t)
	case "nats":
		nc, js, err := dialJetStream(t.brokerURL)
		if err != nil {
			return nil, err
		}
		return &natsSender{nc: nc, js: js, subject: t.name}, nil
	case "redis":
		c, err := dialRedis(t.brokerURL, 0)
		if err != nil {
			return nil, err
		}
		return &redisSender{c: c, stream: t.name}, nil
	}
	q, err := sqlitequeue.Open(ctx, t.brokerURL, sqlitequeue.Config{ConsumerGroup: consumerGroup})
	if err != nil {
		return nil, err
	}
	return &sqliteSender{q: q, pub: q.Publisher(), topic: t.name}, nil
}

// newMessages returns n messages with new UUIDs and the run's payload.
func newMessages(n int, payload []byte) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	return msgs
}

// publishBacklog puts n messages on t ahead of the consumer, from 4 senders at once (one on the
// SQLite queue, which has one writer at a time), and waits until the broker has stored them
// all. It is not measured.
func publishBacklog(ctx context.Context, t topic, n int, payload []byte) error {
	const chunk = 500
	senders := 4
	if t.st.Broker == "sqlite" {
		senders = 1
	}
	var next atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	for range senders {
		g.Go(func() error {
			s, err := newSender(gctx, t)
			if err != nil {
				return err
			}
			defer s.close()
			for {
				from := next.Add(chunk) - chunk
				if from >= int64(n) {
					return s.wait(gctx)
				}
				if err := s.send(gctx, newMessages(int(min(chunk, int64(n)-from)), payload)); err != nil {
					return err
				}
			}
		})
	}
	return g.Wait()
}

// publishPaced publishes n messages to t at rate messages per second, each stamped with its
// publish time (headerSent) just before it is sent: all the messages due at a moment go out
// together, so a broker that is slow to take one does not lower the offered rate. It waits
// until the broker has stored them all.
func publishPaced(ctx context.Context, t topic, n int, rate float64, payload []byte) error {
	s, err := newSender(ctx, t)
	if err != nil {
		return err
	}
	defer s.close()
	start := time.Now()
	for sent := 0; sent < n; {
		due := min(int(time.Since(start).Seconds()*rate)+1, n) - sent
		if due <= 0 {
			next := start.Add(time.Duration(float64(sent) / rate * float64(time.Second)))
			select {
			case <-time.After(time.Until(next)):
			case <-ctx.Done():
				return ctx.Err()
			}
			continue
		}
		msgs := newMessages(due, payload)
		at := strconv.FormatInt(time.Now().UnixNano(), 10)
		for _, m := range msgs {
			m.Metadata.Set(headerSent, at)
		}
		if err := s.send(ctx, msgs); err != nil {
			return err
		}
		sent += due
	}
	return s.wait(ctx)
}

// amqpSender publishes persistent messages, marshaled as onceflow's broker does, on one channel
// with publisher confirms, up to 256 of them unconfirmed.
type amqpSender struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	topic   string
	pending []*amqp.DeferredConfirmation
}

func newAMQPSender(t topic) (*amqpSender, error) {
	conn, err := amqp.Dial(t.brokerURL)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &amqpSender{conn: conn, ch: ch, topic: t.name}, nil
}

func (s *amqpSender) send(ctx context.Context, msgs []*message.Message) error {
	for _, m := range msgs {
		p, err := rabbitmq.Marshaler{}.Marshal(m)
		if err != nil {
			return err
		}
		dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, s.topic, "", false, false, p)
		if err != nil {
			return err
		}
		if s.pending = append(s.pending, dc); len(s.pending) >= 256 {
			if err := s.wait(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

func (s *amqpSender) wait(ctx context.Context) error {
	for _, dc := range s.pending {
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("publish nacked by RabbitMQ")
		}
	}
	s.pending = s.pending[:0]
	return nil
}

func (s *amqpSender) close() error { return s.conn.Close() }

// natsSender publishes to JetStream asynchronously, with the headers of onceflow's broker:
// watermill's, and as Nats-Msg-Id the message UUID, or broker.HeaderNATSMsgID when it is set
// (JetStream drops a second publish of one Nats-Msg-Id).
type natsSender struct {
	nc      *nats.Conn
	js      jetstream.JetStream
	subject string
	acks    []jetstream.PubAckFuture
}

func (s *natsSender) send(ctx context.Context, msgs []*message.Message) error {
	for _, m := range msgs {
		msgID := cmp.Or(m.Metadata.Get(broker.HeaderNATSMsgID), m.UUID)
		delete(m.Metadata, broker.HeaderNATSMsgID)
		nm, err := (&wnats.NATSMarshaler{}).Marshal(s.subject, m)
		if err != nil {
			return err
		}
		nm.Header.Set(nats.MsgIdHdr, msgID)
		// On a loaded machine the server's acks lag: wait for room rather than fail the cell
		// after the default 200 ms.
		f, err := s.js.PublishMsgAsync(nm, jetstream.WithStallWait(natsStallWait))
		if err != nil {
			return err
		}
		s.acks = append(s.acks, f)
	}
	return nil
}

// natsStallWait bounds how long a publish waits for room among the publishes not yet acked.
const natsStallWait = 30 * time.Second

func (s *natsSender) wait(ctx context.Context) error {
	select {
	case <-s.js.PublishAsyncComplete():
	case <-ctx.Done():
		return ctx.Err()
	}
	for _, f := range s.acks {
		select {
		case err := <-f.Err():
			return fmt.Errorf("JetStream publish: %w", err)
		default:
		}
	}
	s.acks = s.acks[:0]
	return nil
}

func (s *natsSender) close() error { s.nc.Close(); return nil }

// redisSender adds stream entries in watermill-redisstream's format, pipelined; the publish
// time, when set, goes in a field of its own.
type redisSender struct {
	c      *redis.Client
	stream string
}

func (s *redisSender) send(ctx context.Context, msgs []*message.Message) error {
	p := s.c.Pipeline()
	for _, m := range msgs {
		sent := m.Metadata.Get(headerSent)
		delete(m.Metadata, headerSent)
		values, err := redissub.Marshaller{}.Marshal(s.stream, m)
		if err != nil {
			return err
		}
		if sent != "" {
			values[headerSent] = sent
		}
		p.XAdd(ctx, &redis.XAddArgs{Stream: s.stream, Values: values})
	}
	_, err := p.Exec(ctx)
	return err
}

func (s *redisSender) wait(context.Context) error { return nil }
func (s *redisSender) close() error               { return s.c.Close() }

// sqliteSender publishes through the SQLite queue's own publisher: each send is one
// transaction of the queue file.
type sqliteSender struct {
	q     *sqlitequeue.Queue
	pub   message.Publisher
	topic string
}

func (s *sqliteSender) send(_ context.Context, msgs []*message.Message) error {
	return s.pub.Publish(s.topic, msgs...)
}

func (s *sqliteSender) wait(context.Context) error { return nil }
func (s *sqliteSender) close() error               { return s.q.Close() }

func dialJetStream(url string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(url, nats.Name("onceflow-bench"))
	if err != nil {
		return nil, nil, err
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return nc, js, nil
}

// dialRedis returns a client with at least poolSize connections.
func dialRedis(url string, poolSize int) (*redis.Client, error) {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	opts.PoolSize = max(opts.PoolSize, poolSize)
	return redis.NewClient(opts), nil
}

// deleteAMQPTopic deletes the exchange and queues a cell declared.
func deleteAMQPTopic(amqpURL, topic string) {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return
	}
	defer conn.Close()
	for _, name := range []string{topic, topic + "_dead"} {
		// A failed delete closes the channel: one channel per statement.
		for _, del := range []func(*amqp.Channel) error{
			func(ch *amqp.Channel) error {
				_, err := ch.QueueDelete(name+"."+consumerGroup, false, false, false)
				return err
			},
			func(ch *amqp.Channel) error { return ch.ExchangeDelete(name, false, false) },
		} {
			if ch, err := conn.Channel(); err == nil {
				_ = del(ch)
				_ = ch.Close()
			}
		}
	}
}
