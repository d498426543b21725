package kafka

import (
	"context"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/onceflow/onceflow/broker"
)

func init() {
	broker.Register("kafka", openScheme, broker.Params{Own: []string{paramPartitions, paramReplicationFactor}})
}

// URL parameters of the kafka:// scheme, besides those of every scheme.
const (
	// paramPartitions is the partition count of the topics the broker creates.
	paramPartitions = "partitions"
	// paramReplicationFactor is the replication factor of the topics the broker creates.
	paramReplicationFactor = "replication_factor"
)

// openScheme publishes with this package's Publisher and subscribes with its Subscriber. The
// URL names the seed brokers. Every dial, and the metadata request that checks the brokers
// answer, is bounded by opts.ConnectTimeout.
func openScheme(ctx context.Context, t broker.Target, o broker.Options) (*broker.Backend, error) {
	seeds, topics, err := parseURL(t.Parsed)
	if err != nil {
		return nil, err
	}
	clientOpts := []kgo.Opt{kgo.DialTimeout(o.ConnectTimeout)}
	pub, err := NewPublisher(PublisherConfig{Brokers: seeds, ClientOptions: clientOpts})
	if err != nil {
		return nil, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, o.ConnectTimeout)
	defer cancel()
	if err := pub.Client().Ping(pingCtx); err != nil {
		_ = pub.Close()
		return nil, err
	}
	pub.topics = NewTopics(pub.Client(), topics.partitions, topics.replicationFactor)
	cfg := Config{
		Brokers:       seeds,
		ConsumerGroup: o.ConsumerGroup,
		Prefetch:      o.Prefetch,
		NackDelay:     max(o.NackDelay, 0),
		AckTimeout:    o.AckTimeout,
		// ack_timeout bounds how long the records of a member that died stay unavailable:
		// its session ends after it.
		SessionTimeout: o.AckTimeout,
		CloseTimeout:   broker.SubscriberCloseTimeout,
		Topics:         pub.topics,
		ClientOptions:  clientOpts,
		Logger:         o.Logger,
	}
	if err := cfg.Validate(); err != nil {
		_ = pub.Close()
		return nil, err
	}
	return &broker.Backend{
		Publisher:     pub,
		CheckTopic:    checkTopic,
		NewSubscriber: func() (message.Subscriber, error) { return NewSubscriber(cfg) },
		View:          newView(append([]kgo.Opt{kgo.SeedBrokers(seeds...)}, clientOpts...), o.AckTimeout, o.ConsumerGroup),
	}, nil
}

// topicSettings are the settings of the topics a broker creates.
type topicSettings struct {
	partitions        int32
	replicationFactor int16
}

// parseURL returns the seed brokers of a kafka:// URL and the settings of the topics to
// create.
func parseURL(u *url.URL) ([]string, topicSettings, error) {
	ts := topicSettings{partitions: -1, replicationFactor: -1}
	if u.User != nil {
		return nil, ts, fmt.Errorf("kafka: the URL has a user name: SASL is not supported by the kafka:// scheme; use the broker/kafka package's Config.ClientOptions")
	}
	if u.Path != "" && u.Path != "/" {
		return nil, ts, fmt.Errorf("kafka: the URL has the path %q: want kafka://host:port[,host:port...]/", u.Path)
	}
	var seeds []string
	for h := range strings.SplitSeq(u.Host, ",") {
		if h == "" {
			continue
		}
		if !strings.Contains(h, ":") {
			h += ":9092"
		}
		seeds = append(seeds, h)
	}
	if len(seeds) == 0 {
		return nil, ts, fmt.Errorf("kafka: the URL names no broker: want kafka://host:port[,host:port...]/")
	}
	// Open has refused every other query parameter.
	for k, vs := range u.Query() {
		v := vs[len(vs)-1]
		n, err := strconv.ParseInt(v, 10, 32)
		switch {
		case err != nil || n < 1 || k == paramReplicationFactor && n > math.MaxInt16:
			return nil, ts, fmt.Errorf("kafka: query parameter %s=%q: want a positive integer", k, v)
		case k == paramPartitions:
			ts.partitions = int32(n)
		default:
			ts.replicationFactor = int16(n)
		}
	}
	return seeds, ts, nil
}

// legalTopic is what Kafka accepts as a topic name.
var legalTopic = regexp.MustCompile(`^[a-zA-Z0-9._-]+$`)

// checkTopic accepts Kafka's legal topic names: up to 249 of the characters a-z, A-Z, 0-9,
// '.', '_' and '-', and neither "." nor "..".
func checkTopic(topic string) error {
	if len(topic) > 249 || !legalTopic.MatchString(topic) || topic == "." || topic == ".." {
		return fmt.Errorf("broker: topic %q: a Kafka topic is up to 249 of the characters a-z, A-Z, 0-9, '.', '_' and '-'", topic)
	}
	return nil
}
