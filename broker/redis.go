package broker

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/vmihailenco/msgpack"
)

// Redis stream fields that watermill-redisstream writes.
const (
	redisFieldMetadata = "metadata"
	redisFieldPayload  = "payload"
)

// HeaderRedisMetadata carries the raw "metadata" field of a Redis stream entry that did not
// decode as watermill metadata (an entry written by another producer).
const HeaderRedisMetadata = "redis_metadata"

// redisBlockTime is how long one XREADGROUP waits for new entries; it also bounds how long a
// closing subscriber waits for its reads.
const redisBlockTime = 100 * time.Millisecond

// redisClaimInterval returns how often a consumer looks for pending entries that another
// consumer has left idle for longer than ackTimeout: a tenth of it, between 100 ms and 1 s.
func redisClaimInterval(ackTimeout time.Duration) time.Duration {
	return min(max(ackTimeout/10, 100*time.Millisecond), time.Second)
}

func openRedis(ctx context.Context, t *target, o Options) (*backend, error) {
	ropts, err := redis.ParseURL(t.dsn)
	if err != nil {
		return nil, err
	}
	client := redis.NewClient(ropts)
	if err := client.Ping(ctx).Err(); err != nil {
		_ = client.Close()
		return nil, err
	}
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: client, Marshaller: redisMarshaller{}}, o.Logger)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	nackSleep := o.nackDelay()
	if nackSleep == 0 {
		nackSleep = redisstream.NoSleep
	}
	return &backend{
		pub: pub,
		newSubscriber: func() (message.Subscriber, error) {
			// The subscriber closes its client when it closes: give it one of its own.
			return redisstream.NewSubscriber(redisstream.SubscriberConfig{
				Client:                        redis.NewClient(ropts),
				Unmarshaller:                  redisMarshaller{},
				Consumer:                      "onceflow-" + watermill.NewShortUUID(),
				ConsumerGroup:                 o.ConsumerGroup,
				NackResendSleep:               nackSleep,
				BlockTime:                     redisBlockTime,
				ClaimInterval:                 redisClaimInterval(o.AckTimeout),
				MaxIdleTime:                   o.AckTimeout,
				OldestId:                      "0",
				DisableIndefiniteInitialBlock: true,
			}, o.Logger)
		},
		// watermill-redisstream sleeps NackResendSleep and delivers a nacked message again to
		// the same consumer; the message of a closing consumer stays pending until another
		// consumer re-claims it after MaxIdleTime. Closing the publisher closes client.
		view: newRedisView(client, o.ConsumerGroup),
	}, nil
}

// redisMarshaller is watermill-redisstream's marshaller with a tolerant Unmarshal: it never
// fails, because watermill-redisstream ends the whole subscription on a message it cannot
// unmarshal.
type redisMarshaller struct{}

var _ redisstream.MarshallerUnmarshaller = redisMarshaller{}

// Marshal converts msg to the fields of a stream entry: the UUID, the msgpack-encoded
// metadata and the payload.
func (redisMarshaller) Marshal(topic string, msg *message.Message) (map[string]any, error) {
	return redisstream.DefaultMarshallerUnmarshaller{}.Marshal(topic, msg)
}

// Unmarshal converts the fields of a stream entry to a watermill message. An entry without a
// UUID field gets an empty UUID; fields other than the UUID, metadata and payload (written by
// another producer) become metadata; metadata that does not decode is kept in the header
// redis_metadata.
func (redisMarshaller) Unmarshal(values map[string]any) (*message.Message, error) {
	md := message.Metadata{}
	var id, payload string
	for k, v := range values {
		s := fmt.Sprint(v)
		switch k {
		case redisstream.UUIDHeaderKey:
			id = s
		case redisFieldPayload:
			payload = s
		case redisFieldMetadata:
			if s == "" {
				continue
			}
			decoded := message.Metadata{}
			if err := msgpack.Unmarshal([]byte(s), &decoded); err != nil {
				md[HeaderRedisMetadata] = s
				continue
			}
			for mk, mv := range decoded {
				md[mk] = mv
			}
		default:
			if _, ok := md[k]; !ok {
				md[k] = s
			}
		}
	}
	msg := message.NewMessage(id, []byte(payload))
	msg.Metadata = md
	return msg, nil
}
