package broker_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/redelivery"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

// scheme is one kind of broker under test. Adding a scheme to the suite is one entry in
// schemes.
type scheme struct {
	name string
	// url returns the URL of a broker for one test: a fresh database where the broker lives
	// in one, the shared server otherwise (each test uses topics of its own).
	url func(t testing.TB) string
	// cleanup removes what a test left on a shared server for topic; nil when nothing stays.
	cleanup func(t testing.TB, rawURL, topic string)
}

func schemes() []scheme {
	return []scheme{
		{name: "amqp", url: testsvc.AMQPURL, cleanup: removeTopic},
		{name: "postgres", url: testsvc.PostgresSchemaURL},
		{name: "mysql", url: testsvc.MySQLDatabaseURL},
		{name: "sqlite", url: testsvc.SQLiteURL},
		{name: "nats", url: testsvc.NATSURL, cleanup: removeTopic},
		{name: "redis", url: testsvc.RedisURL, cleanup: removeTopic},
		{name: "mem", url: func(testing.TB) string { return "mem://" + testsvc.UniqueName("mem") }},
	}
}

// testTimings shortens every delay of the brokers so that the suite runs in seconds.
const testTimings = "nack_delay=20ms&ack_timeout=2s&poll_interval=10ms"

// receiveWithin bounds every wait for a message. It is generous because a PostgreSQL queue
// delivers a message only once every older transaction on the server has ended, including
// those of other tests.
const receiveWithin = 30 * time.Second

// forEachScheme runs test as a parallel subtest for every scheme.
func forEachScheme(t *testing.T, test func(t *testing.T, f *fixture)) {
	for _, sc := range schemes() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			test(t, setup(t, sc, testTimings))
		})
	}
}

// fixture is one test's broker URL and topic.
type fixture struct {
	t     *testing.T
	url   string
	topic string
	sc    scheme
	raw   string // url without the test's parameters
}

// cleanupTopic removes what the test left on a shared server for another topic it used.
func (f *fixture) cleanupTopic(topic string) {
	if f.sc.cleanup != nil {
		f.sc.cleanup(f.t, f.raw, topic)
	}
}

func setup(t *testing.T, sc scheme, params string) *fixture {
	return setupTopic(t, sc, params, testsvc.UniqueName("t"))
}

func setupTopic(t *testing.T, sc scheme, params, topic string) *fixture {
	raw := sc.url(t)
	if sc.cleanup != nil {
		t.Cleanup(func() { sc.cleanup(t, raw, topic) })
	}
	return &fixture{t: t, url: withParams(raw, params), topic: topic, sc: sc, raw: raw}
}

// withParams adds query parameters to rawURL.
func withParams(rawURL, params string) string {
	if params == "" {
		return rawURL
	}
	if strings.Contains(rawURL, "?") {
		return rawURL + "&" + params
	}
	return rawURL + "?" + params
}

// open opens a Broker on the fixture's URL, closed when the test ends.
func (f *fixture) open(opts broker.Options) *broker.Broker {
	f.t.Helper()
	b, err := broker.Open(context.Background(), f.url, opts)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { require.NoError(f.t, b.Close()) })
	return b
}

// subscribe makes a new Subscriber of b and subscribes it once to the fixture's topic.
func (f *fixture) subscribe(b *broker.Broker) (message.Subscriber, <-chan *message.Message) {
	f.t.Helper()
	sub, err := b.Subscriber()
	require.NoError(f.t, err)
	f.t.Cleanup(func() { require.NoError(f.t, sub.Close()) })
	ch, err := sub.Subscribe(context.Background(), f.topic)
	require.NoError(f.t, err)
	return sub, ch
}

// message returns the i-th test message of the fixture: a unique UUID, metadata including
// onceflow headers and an empty value, and a payload that is neither JSON nor UTF-8.
func (f *fixture) message(i int) *message.Message {
	m := message.NewMessage(fmt.Sprintf("%s-%03d", f.topic, i), []byte(fmt.Sprintf("payload %d \x00\xff", i)))
	m.Metadata.Set("k", fmt.Sprintf("v%d", i))
	m.Metadata.Set("empty", "")
	m.Metadata.Set(messagedata.HeaderKey, fmt.Sprintf("key-%d", i%3))
	return m
}

// publish publishes messages to the fixture's topic.
func (f *fixture) publish(b *broker.Broker, msgs ...*message.Message) {
	f.t.Helper()
	for _, m := range msgs {
		require.NoError(f.t, b.Publisher().Publish(f.topic, m))
	}
}

// receive returns the next message of ch, failing the test after receiveWithin.
func receive(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	return testsvc.Receive(t, ch, receiveWithin)
}

// requireSame checks that got carries want's UUID, payload and metadata. Brokers may add
// headers of their own (amqp_message_id, ...), never lose or change one.
func requireSame(t *testing.T, want, got *message.Message) {
	t.Helper()
	require.Equal(t, want.UUID, got.UUID)
	require.Equal(t, string(want.Payload), string(got.Payload))
	for k, v := range want.Metadata {
		gv, ok := got.Metadata[k]
		require.True(t, ok, "header %q lost", k)
		require.Equal(t, v, gv, "header %q", k)
	}
}

// ackEach acks every message of ch and passes it on to out, until ch closes.
func ackEach(ch <-chan *message.Message, out chan<- *message.Message) {
	for m := range ch {
		m.Ack()
		out <- m
	}
}

func TestBroker_CompetingConsumersGetEachMessageOnce(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		const n = 20
		b := f.open(broker.Options{})
		_, chA := f.subscribe(b)
		_, chB := f.subscribe(b)
		got := make(chan *message.Message, 4*n)
		go ackEach(chA, got)
		go ackEach(chB, got)

		want := map[string]*message.Message{}
		for i := range n {
			m := f.message(i)
			want[m.UUID] = m
			f.publish(b, m)
		}
		seen := map[string]int{}
		for len(seen) < n {
			m := receive(t, got)
			w, ok := want[m.UUID]
			require.True(t, ok, "unexpected message %q", m.UUID)
			requireSame(t, w, m)
			seen[m.UUID]++
		}
		// A duplicate would arrive before a message published after all of them were acked
		// on every broker whose order is FIFO, and in practice on the others.
		sentinel := f.message(n)
		f.publish(b, sentinel)
		for {
			m := receive(t, got)
			if m.UUID == sentinel.UUID {
				break
			}
			seen[m.UUID]++
		}
		for id, c := range seen {
			require.Equal(t, 1, c, "message %s received and acked %d times", id, c)
		}
		require.Len(t, seen, n)
	})
}

func TestBroker_NackedMessageIsDeliveredAgain(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		_, ch := f.subscribe(b)
		want := f.message(1)
		f.publish(b, want)

		first := receive(t, ch)
		requireSame(t, want, first)
		first.Nack()

		again := receive(t, ch)
		requireSame(t, want, again)
		again.Ack()

		next := f.message(2)
		f.publish(b, next)
		requireSame(t, next, receive(t, ch))
	})
}

func TestBroker_MessageOfAConsumerThatWentAwayGoesToAnother(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		subA, chA := f.subscribe(b)
		want := f.message(1)
		f.publish(b, want)
		held := receive(t, chA)
		requireSame(t, want, held)

		// A second consumer joins while the first holds the message unacknowledged; then the
		// first goes away without acking it. For Redis, the closing consumer makes the pending
		// entry claimable at once, and the second claims it on its next claim pass.
		_, chB := f.subscribe(b)
		require.NoError(t, subA.Close())
		again := receive(t, chB)
		requireSame(t, want, again)
		again.Ack()
		held.Ack() // too late: the first consumer has gone away; this changes nothing
	})
}

func TestBroker_MessagePublishedBeforeAnySubscriptionWaitsForTheGroup(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		want := f.message(1)
		f.publish(b, want)
		_, ch := f.subscribe(b)
		got := receive(t, ch)
		requireSame(t, want, got)
		got.Ack()
	})
}

func TestBroker_AckedMessagesAreNotDeliveredToTheNextConsumer(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		first := f.message(1)
		f.publish(b, first)
		subA, chA := f.subscribe(b)
		m := receive(t, chA)
		requireSame(t, first, m)
		m.Ack()
		// The ack is settled when the next message is delivered: wait for that, then leave.
		second := f.message(2)
		f.publish(b, second)
		m = receive(t, chA)
		requireSame(t, second, m)
		m.Nack()
		require.NoError(t, subA.Close())

		// The group's position survives its consumers: a new one starts after the acked
		// message (NATS: the durable consumer is not deleted with the last subscription).
		_, chB := f.subscribe(b)
		m = receive(t, chB)
		requireSame(t, second, m)
		m.Ack()
	})
}

func TestBroker_AckGivenBeforeTheContextEndsAndCloseIsKept(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		b := f.open(broker.Options{})
		sub, err := b.Subscriber()
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ch, err := sub.Subscribe(ctx, f.topic)
		require.NoError(t, err)
		first := f.message(1)
		f.publish(b, first)
		m := receive(t, ch)
		requireSame(t, first, m)
		m.Ack()
		// A watermill router that closes does both at once: it cancels the context of its
		// subscriptions and closes their Subscriber. The ack given before is not lost.
		cancel()
		require.NoError(t, sub.Close())

		second := f.message(2)
		f.publish(b, second)
		_, next := f.subscribe(b)
		m = receive(t, next)
		requireSame(t, second, m) // not the acked first message again
		m.Ack()
	})
}

func TestBroker_DottedTopic(t *testing.T) {
	t.Parallel()
	for _, sc := range schemes() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			// For NATS the dots separate subject tokens; the stream gets a name without them.
			f := setupTopic(t, sc, testTimings, "orders.created."+testsvc.UniqueName("t"))
			b := f.open(broker.Options{})
			_, ch := f.subscribe(b)
			want := f.message(1)
			f.publish(b, want)
			got := receive(t, ch)
			requireSame(t, want, got)
			got.Ack()
		})
	}
}

func TestBroker_EveryConsumerGroupGetsEveryMessage(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		const n = 5
		billing := f.open(broker.Options{ConsumerGroup: "billing"})
		shipping := f.open(broker.Options{ConsumerGroup: "shipping"})
		require.Equal(t, "billing", billing.ConsumerGroup())
		_, chBilling := f.subscribe(billing)
		_, chShipping := f.subscribe(shipping)
		gotBilling := make(chan *message.Message, 2*n)
		gotShipping := make(chan *message.Message, 2*n)
		go ackEach(chBilling, gotBilling)
		go ackEach(chShipping, gotShipping)
		for i := range n {
			f.publish(billing, f.message(i))
		}
		for _, got := range []chan *message.Message{gotBilling, gotShipping} {
			seen := map[string]bool{}
			for len(seen) < n {
				m := receive(t, got)
				require.False(t, seen[m.UUID], "message %s delivered twice to one group", m.UUID)
				seen[m.UUID] = true
			}
		}
	})
}

func TestBroker_CloseIsIdempotentAndSafeConcurrently(t *testing.T) {
	t.Parallel()
	forEachScheme(t, func(t *testing.T, f *fixture) {
		b, err := broker.Open(context.Background(), f.url, broker.Options{})
		require.NoError(t, err)
		sub, err := b.Subscriber()
		require.NoError(t, err)
		var chans []<-chan *message.Message
		for range 3 {
			ch, err := sub.Subscribe(context.Background(), f.topic)
			require.NoError(t, err)
			chans = append(chans, ch)
		}
		open, err := b.Subscriber() // left open: Broker.Close closes it
		require.NoError(t, err)
		_, err = open.Subscribe(context.Background(), f.topic)
		require.NoError(t, err)

		var wg sync.WaitGroup
		errs := make(chan error, 10)
		for range 5 {
			wg.Go(func() { errs <- sub.Close() })
		}
		wg.Wait()
		for range 5 {
			require.NoError(t, <-errs)
		}
		for _, ch := range chans {
			_, ok := <-ch
			require.False(t, ok, "subscription channel still open after Close")
		}
		_, err = sub.Subscribe(context.Background(), f.topic)
		require.ErrorIs(t, err, broker.ErrClosed)

		for range 5 {
			wg.Go(func() { errs <- b.Close() })
		}
		wg.Wait()
		for range 5 {
			require.NoError(t, <-errs)
		}
		require.NoError(t, b.Close())
		require.ErrorIs(t, b.Publisher().Publish(f.topic, f.message(1)), broker.ErrClosed)
		_, err = b.Subscriber()
		require.ErrorIs(t, err, broker.ErrClosed)
		require.NoError(t, open.Close())
		require.NoError(t, b.Publisher().Close(), "closing the shared publisher is a no-op")
	})
}

func TestBroker_SchemeAndString(t *testing.T) {
	t.Parallel()
	for _, sc := range schemes() {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			f := setup(t, sc, "")
			b := f.open(broker.Options{})
			require.Equal(t, sc.name, b.Scheme())
			require.Equal(t, broker.DefaultConsumerGroup, b.ConsumerGroup())
			require.NotEmpty(t, b.String())
		})
	}
}

// A subscription whose prefetch is left unset holds the window its consumer asks for when it
// subscribes (onceflow's router asks for what its handler can take at once); a prefetch set in
// Options is kept.
func TestBroker_UnsetPrefetchTakesTheWindowTheConsumerAsks(t *testing.T) {
	t.Parallel()
	// Above every scheme's default prefetch (Redis's 100 is the largest).
	const window = 150
	forEachScheme(t, func(t *testing.T, f *fixture) {
		for _, c := range []struct {
			name     string
			prefetch int
			want     int
		}{
			{"unset", 0, window},
			{"explicit", 5, 5},
		} {
			t.Run(c.name, func(t *testing.T) {
				f := setupTopic(t, f.sc, testTimings, f.topic+"_"+c.name)
				b := f.open(broker.Options{Prefetch: c.prefetch})
				msgs := make([]*message.Message, window+10)
				for i := range msgs {
					msgs[i] = f.message(i)
				}
				require.NoError(t, b.Publisher().Publish(f.topic, msgs...))
				sub, err := b.Subscriber()
				require.NoError(t, err)
				t.Cleanup(func() { require.NoError(t, sub.Close()) })
				ch, err := sub.Subscribe(redelivery.WithWindow(context.Background(), window), f.topic)
				require.NoError(t, err)

				for range c.want {
					receive(t, ch) // held unacknowledged
				}
				// The window is full: nothing more comes while no delivery is settled.
				select {
				case m := <-ch:
					t.Fatalf("delivery %s beyond a window of %d", m.UUID, c.want)
				case <-time.After(300 * time.Millisecond):
				}
			})
		}
	})
}
