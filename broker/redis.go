package broker

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"

	redissub "github.com/onceflow/onceflow/broker/redis"
)

// HeaderRedisMetadata carries the raw "metadata" field of a Redis stream entry that did not
// decode as watermill metadata (an entry written by another producer).
const HeaderRedisMetadata = redissub.HeaderMetadata

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

// redisMarshaller is the stream entry format of watermill-redisstream, with an Unmarshal that
// never fails: watermill-redisstream ends the whole subscription on a message it cannot
// unmarshal.
type redisMarshaller = redissub.Marshaller
