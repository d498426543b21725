package sqlitequeue_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
)

// deadLetter is a router middleware that publishes a message its handler fails on to topic,
// and acknowledges it, like watermill's PoisonQueue middleware: it publishes the incoming
// message itself, so with the incoming message's context.
func deadLetter(pub message.Publisher, topic string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			msg.Metadata.Set("reason", err.Error())
			return nil, pub.Publish(topic, msg)
		}
	}
}

// A watermill router consuming the queue sends a failing message to a dead-letter topic of the
// same queue file, with the incoming message's context, while the subscription keeps other
// messages in flight: no writer waits for another.
func TestRouter_DeadLetterToTheSameQueueFile(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	q := setup(t, sqlitequeue.Config{})

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(deadLetter(q.Publisher(), "orders.dead"))
	sub, err := q.Subscriber()
	require.NoError(t, err)
	processed := make(chan string, 10)
	router.AddConsumerHandler("orders", "orders", sub, func(msg *message.Message) error {
		if string(msg.Payload) == "bad" {
			return errors.New("cannot process a bad order")
		}
		processed <- msg.UUID
		return nil
	})
	testsvc.StartRouter(t, router)

	start := time.Now()
	pub := q.Publisher()
	require.NoError(t, pub.Publish("orders",
		message.NewMessage("good-1", []byte("good")),
		message.NewMessage("bad-1", []byte("bad")),
		message.NewMessage("good-2", []byte("good")),
	))
	require.ElementsMatch(t, []string{"good-1", "good-2"}, []string{<-processed, <-processed})
	eventuallyEqual(t, 0, func() (int64, error) { return q.Backlog(ctx, "orders", sqlitequeue.DefaultConsumerGroup) }, "backlog")
	require.Less(t, time.Since(start), 5*time.Second)

	dead, err := q.List(ctx, "orders.dead", 0, 10)
	require.NoError(t, err)
	require.Len(t, dead, 1)
	require.Equal(t, "bad-1", dead[0].Message.UUID)
	require.Equal(t, "cannot process a bad order", dead[0].Message.Metadata.Get("reason"))

	require.NoError(t, router.Close())
}
