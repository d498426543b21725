package amqp_test

import (
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker/amqp"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
)

func TestParseQueueParams(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		in      string
		dsn     string
		queue   amqp.Queue
		wantErr string
	}{
		{name: "none", in: "amqp://u:p@h:5672/v", dsn: "amqp://u:p@h:5672/v"},
		{name: "others stay", in: "amqp://h/?heartbeat=5", dsn: "amqp://h/?heartbeat=5"},
		{
			name:  "quorum with limit and dead letters",
			in:    "amqp://u:p@h/?queue_type=quorum&delivery_limit=20&dead_letter_exchange=dlx&heartbeat=5",
			dsn:   "amqp://u:p@h/?heartbeat=5",
			queue: amqp.Queue{Type: amqp.Quorum, DeliveryLimit: 20, DeadLetterExchange: "dlx"},
		},
		{name: "classic", in: "amqp://h/?queue_type=classic", dsn: "amqp://h/", queue: amqp.Queue{Type: amqp.Classic}},
		{name: "dead letters on classic", in: "amqp://h/?dead_letter_exchange=dlx", dsn: "amqp://h/", queue: amqp.Queue{DeadLetterExchange: "dlx"}},
		{name: "limit on the default type", in: "amqp://h/?delivery_limit=5", wantErr: "delivery_limit=5) needs a quorum queue (queue_type=quorum)"},
		{name: "limit on classic", in: "amqp://h/?queue_type=classic&delivery_limit=5", wantErr: "delivery_limit=5) needs a quorum queue"},
		{name: "unknown type", in: "amqp://h/?queue_type=stream", wantErr: `queue_type="stream": want classic or quorum`},
		{name: "limit not a number", in: "amqp://h/?queue_type=quorum&delivery_limit=many", wantErr: `delivery_limit="many": want a positive integer`},
		{name: "limit zero", in: "amqp://h/?queue_type=quorum&delivery_limit=0", wantErr: `delivery_limit="0"`},
		{name: "empty exchange", in: "amqp://h/?dead_letter_exchange=", wantErr: "dead_letter_exchange is empty"},
		{name: "malformed query, secret kept out", in: "amqp://u:s3cret@h/?queue_type=%zz", wantErr: "malformed URL query"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dsn, q, err := amqp.ParseQueueParams(tc.in)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.NotContains(t, err.Error(), "s3cret")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.dsn, dsn)
			require.Equal(t, tc.queue, q)
		})
	}
}

func TestQueue_Args(t *testing.T) {
	t.Parallel()
	require.Nil(t, amqp.Queue{}.Args(), "the default declares queues as before queue types")
	require.Equal(t, amqp091.Table{"x-queue-type": "classic"}, amqp.Queue{Type: amqp.Classic}.Args())
	require.Equal(t, amqp091.Table{
		"x-queue-type":           "quorum",
		"x-delivery-limit":       int64(7),
		"x-dead-letter-exchange": "dlx",
	}, amqp.Queue{Type: amqp.Quorum, DeliveryLimit: 7, DeadLetterExchange: "dlx"}.Args())
}

func TestTopology_CheckTopic(t *testing.T) {
	t.Parallel()
	tp := amqp.Topology{ConsumerGroup: "billing"}
	require.NoError(t, tp.CheckTopic("orders"))
	require.Equal(t, "orders.billing", tp.QueueName("orders"))
	require.ErrorContains(t, tp.CheckTopic(string(make([]byte, 250))), "would be 258 bytes, AMQP allows 255")
	require.ErrorContains(t, tp.CheckTopic(""), "topic is empty")
}

// The publisher declared the group's queue as a quorum queue; a subscriber that would declare
// it classic is refused at Subscribe, with RabbitMQ's reason.
func TestSubscriber_QueueArgumentsOtherThanThePublishersAreRefused(t *testing.T) {
	t.Parallel()
	f := setup(t, amqp.Queue{Type: amqp.Quorum})
	f.publish("m", 1)
	cfg := f.config(1)
	cfg.Topology.Queue = amqp.Queue{}
	s := f.subscriber(cfg)
	_, err := s.Subscribe(t.Context(), f.topic)
	require.ErrorContains(t, err, "PRECONDITION_FAILED")
	require.ErrorContains(t, err, "x-queue-type")
	require.ErrorContains(t, err, f.topology.QueueName(f.topic))
}

// RabbitMQ's delivery limit on a quorum queue: with delivery_limit=2 a message that keeps
// failing is delivered 3 times, then goes to the dead-letter exchange.
func TestSubscriber_QuorumDeliveryLimitDeadLettersToTheExchange(t *testing.T) {
	t.Parallel()
	url := testsvc.AMQPURL(t)
	dlx := testsvc.UniqueName("dlx")
	t.Cleanup(func() { testsvc.RemoveTopics(t, url, []string{"all"}, dlx) })
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, amqp.Topology{ConsumerGroup: "all"}.Declare(ch, dlx))

	f := setup(t, amqp.Queue{Type: amqp.Quorum, DeliveryLimit: 2, DeadLetterExchange: dlx})
	id := f.publish("m", 1)[0]
	msgs := f.subscribe(f.subscriber(f.config(10)))
	for want := 1; want <= 3; want++ {
		m := receive(t, msgs)
		require.Equal(t, id, m.UUID)
		require.Equal(t, want, testsvc.Info(t, m).Count)
		require.True(t, redelivery.NackAfter(m, 0))
	}
	var dead amqp091.Delivery
	testsvc.Eventually(t, within, func() bool {
		d, ok, err := ch.Get(dlx+".all", true)
		require.NoError(t, err)
		dead = d
		return ok
	}, "the message did not reach the dead-letter exchange %s", dlx)
	require.Equal(t, id, dead.MessageId)
	testsvc.RequireNothing(t, msgs, 300*time.Millisecond)
}
