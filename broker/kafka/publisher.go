package kafka

import (
	"cmp"
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker/internal/lifecycle"
)

// DefaultPublishTimeout bounds one Publish when PublisherConfig.PublishTimeout is zero.
const DefaultPublishTimeout = 30 * time.Second

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Brokers are the seed brokers, host:port. Required.
	Brokers []string
	// Topics creates the topics that Publish finds missing. Nil creates them with the
	// brokers' default partition count and replication factor.
	Topics *Topics
	// PublishTimeout bounds one Publish call, the records' retries included. Defaults to
	// DefaultPublishTimeout.
	PublishTimeout time.Duration
	// ClientOptions are passed to kgo.NewClient after the seed brokers: dial timeouts, TLS,
	// SASL, linger, compression.
	ClientOptions []kgo.Opt
}

// Publisher is a watermill message.Publisher on Kafka, with kgo's idempotent producer: the
// brokers drop a record that the producer sends again after a lost reply, so that a retry
// within one Publish does not duplicate it. Each message is one record (see Record). A
// Publisher is safe for concurrent use.
type Publisher struct {
	cl      *kgo.Client
	topics  *Topics
	timeout time.Duration
	life    lifecycle.Set[struct{}] // counts the Publish calls in progress
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher with a client of its own.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafka: PublisherConfig.Brokers is empty")
	}
	if cfg.PublishTimeout < 0 {
		return nil, errors.New("kafka: PublisherConfig.PublishTimeout is negative")
	}
	cfg.PublishTimeout = cmp.Or(cfg.PublishTimeout, DefaultPublishTimeout)
	opts := append([]kgo.Opt{kgo.SeedBrokers(cfg.Brokers...)}, cfg.ClientOptions...)
	opts = append(opts,
		// Every record of a Publish is on the brokers of all in-sync replicas when it
		// returns; kgo's producer is idempotent unless told otherwise.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordDeliveryTimeout(cfg.PublishTimeout),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	p := &Publisher{cl: cl, topics: cfg.Topics, timeout: cfg.PublishTimeout}
	if p.topics == nil {
		p.topics = NewTopics(cl, -1, -1)
	}
	return p, nil
}

// Publish writes msgs to topic, creating the topic when it is missing, and returns when the
// brokers have them all, or with the first error. The records of one Publish are sent
// together; records of one key keep their order.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if !p.life.Enter() {
		return ErrClosed
	}
	defer p.life.Leave()
	ctx, cancel := context.WithTimeout(context.Background(), p.timeout)
	defer cancel()
	if err := p.topics.Ensure(ctx, topic); err != nil {
		return err
	}
	recs := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		recs[i] = Record(topic, m)
	}
	return p.cl.ProduceSync(ctx, recs...).FirstErr()
}

// Close waits for the Publish calls in progress and closes the client. It is idempotent.
func (p *Publisher) Close() error {
	if _, first := p.life.Close(); first {
		p.life.Wait()
		p.cl.Close()
	}
	return nil
}

// Client returns the Publisher's client, for administration (the scheme's topic creation).
func (p *Publisher) Client() *kgo.Client { return p.cl }
